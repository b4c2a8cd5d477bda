"""Tensor-parallel linear and embedding layers (Megatron's split, SGLang's names).

Built by the Llama model only when --tp-size > 1 (at tp 1 it builds the dense `Linear` and
`nn.Embedding`, so a single rank pays for nothing here). Each rank holds a shard:

* ColumnParallelLinear: rows of the output (qkv, gate_up); no collective — its output stays
  split, and feeds the attention heads / MLP columns this rank owns.
* RowParallelLinear: columns of the input (o_proj, down_proj); the partial products are
  summed by an all-reduce, then the (unsplit) bias is added once.
* VocabParallelEmbedding: rows [start, start + rows) of the vocabulary (padded so every rank
  holds the same number); a token outside them looks up zeros, the all-reduce fills it in.
* ParallelLMHead: the same rows of the output head; the logits are all-gathered.

The loader (LlamaForCausalLM.load_weights) narrows each full checkpoint tensor to the rank's
shard; these layers only compute.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.distributed.parallel_state import TpGroup
from radixserve.layers.linear import Linear, linear


class ColumnParallelLinear(Linear):
    """The output rows of this rank (`out_features` is the local count)."""


class RowParallelLinear(Linear):
    """The input columns of this rank (`in_features` is the local count); output summed."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TpGroup) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(
        self, x: torch.Tensor, add_partial: Callable[[torch.Tensor], None] | None = None
    ) -> torch.Tensor:
        """`add_partial` adds to this rank's partial product before the all-reduce (a LoRA
        delta of this rank's input columns, lora/manager.py)."""
        out = linear(x, self.weight)
        if add_partial is not None:
            add_partial(out)
        out = self.tp.all_reduce(out)
        return out if self.bias is None else out + self.bias


def vocab_shard(vocab_size: int, tp: TpGroup) -> tuple[int, int]:
    """(first row, rows per rank) of the padded vocabulary split."""
    rows = -(-vocab_size // tp.world_size)
    return tp.rank * rows, rows


class _VocabShard(nn.Module):
    """This rank's rows of a [vocab, hidden] weight (vocab_shard)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TpGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.start, rows = vocab_shard(vocab_size, tp)
        self.weight = nn.Parameter(torch.zeros(rows, hidden_size))


class VocabParallelEmbedding(_VocabShard):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(_VocabShard):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_logits(linear(hidden, self.weight), self.vocab_size, self.tp)


def gather_logits(local: torch.Tensor, vocab_size: int, tp: TpGroup) -> torch.Tensor:
    """[..., rows] logits of this rank's vocabulary shard -> [..., vocab_size] on every rank."""
    return tp.all_gather_last_dim(local)[..., :vocab_size]
