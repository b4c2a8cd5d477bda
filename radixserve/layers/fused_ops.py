"""The fused element-wise steps of a decoder layer (csrc/fused_ops.cpp) and the switch that
turns them on for a model.

A module that has a fused form inherits `FusedOp`: its `forward` takes the fused form when
`fused` is set and the tensors suit the kernel (a CPU tensor of the weight's dtype), the
reference form otherwise. The reference forms stay the portable path and the test oracle;
ModelRunner turns the fused forms on with the cpu_paged attention backend, whose library holds
these kernels (`--attention-backend torch_native` keeps every step in PyTorch).
"""

from __future__ import annotations

import torch
from torch import nn


class FusedOp:
    """Mixin: `fused` selects the C++ form of this module's step (see the module docstring)."""

    fused: bool = False

    def can_fuse(self, x: torch.Tensor) -> bool:
        return self.fused and x.device.type == "cpu"


def set_fused_ops(model: nn.Module, enabled: bool) -> int:
    """Turn the fused forms of `model`'s FusedOp modules on or off; returns how many there are.
    Loads the kernel library first when turning them on (KernelBuildError where it cannot)."""
    if enabled:
        from radixserve.layers.cpu_kernels import load_cpu_kernels

        load_cpu_kernels()
    count = 0
    for module in model.modules():
        if isinstance(module, FusedOp):
            module.fused = enabled
            count += 1
        if not enabled and getattr(module, "decode_step", None) is not None:
            module.decode_step = None  # the C++ decode step (decode_step.py) runs these kernels
    return count
