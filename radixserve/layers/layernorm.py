"""RMSNorm as Llama/Qwen apply it: normalise in fp32, scale in the input dtype.

Called with a residual it first adds the sublayer's output `x` into the residual stream and
normalises the sum, returning (normalised, new residual), as SGLang's fused_add_rmsnorm does.
The fused form (fused_ops) does either in one pass over each row.
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.layers.fused_ops import FusedOp


class RMSNorm(FusedOp, nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.can_fuse(x) and x.dim() == 2 and x.dtype == self.weight.dtype:
            if residual is None:
                return torch.ops.radixserve.rms_norm(x, self.weight, self.eps)
            torch.ops.radixserve.add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        if residual is None:
            return self._norm(x)
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
