"""TpModelWorker: runs one step's ModelWorkerBatch through the model and samples.

The scheduler's only door to the model. With one rank there is no collective; with tensor
parallelism every rank would run the same step and agree on the sampled tokens (invariant 10).
The step is split in two (`forward` → logits, `sample` → tokens) so the overlap loop can run
the forward before the sampling inputs are known (grammar masks, penalties).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.args import ServerArgs
from radixserve.layers.sampler import SampleOutput, SamplingBatchInfo
from radixserve.model_executor.forward_batch import ModelWorkerBatch
from radixserve.model_executor.model_runner import ModelRunner


@dataclass
class GenerationBatchResult:
    next_token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[float, int]]] | None = None

    @classmethod
    def from_sample(cls, out: SampleOutput) -> GenerationBatchResult:
        result = cls(out.next_token_ids.tolist())
        if out.logprobs is not None:
            result.logprobs = out.logprobs.tolist()
        if out.top_logprobs is not None:
            vals, ids = out.top_logprobs
            result.top_logprobs = [
                list(zip(v, i, strict=True))
                for v, i in zip(vals.tolist(), ids.tolist(), strict=True)
            ]
        return result


class TpModelWorker:
    def __init__(self, server_args: ServerArgs, model_runner: ModelRunner | None = None) -> None:
        self.model_runner = model_runner or ModelRunner(server_args)
        self.device = self.model_runner.device
        self.vocab_size = self.model_runner.model_config.vocab_size

    def forward(self, mwb: ModelWorkerBatch, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token logits [B, V]; `input_ids` replaces mwb.input_ids (resolved futures)."""
        fb = mwb.to_forward_batch(self.device, input_ids)
        return self.model_runner.forward(fb).next_token_logits

    def sample(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        vocab_mask: torch.Tensor | None,
        mwb: ModelWorkerBatch,
    ) -> SampleOutput:
        if vocab_mask is not None:
            info.vocab_mask = vocab_mask.to(self.device)
        return self.model_runner.sample(logits, info, mwb.return_logprob, mwb.top_logprobs_num)

    def forward_batch_generation(
        self, mwb: ModelWorkerBatch, vocab_mask: torch.Tensor | None = None
    ) -> GenerationBatchResult:
        """One whole step, as the normal loop runs it."""
        assert isinstance(mwb.sampling_info, SamplingBatchInfo)
        logits = self.forward(mwb)
        return GenerationBatchResult.from_sample(
            self.sample(logits, mwb.sampling_info, vocab_mask, mwb)
        )

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.model_runner.token_to_kv_pool.move_kv(src, dst)

    @torch.inference_mode()
    def get_memory_info(self) -> dict[str, int]:
        mr = self.model_runner
        return {
            "max_total_num_tokens": mr.max_total_num_tokens,
            "max_running_requests": mr.max_running_requests,
            "context_len": mr.context_len,
            "vocab_size": self.vocab_size,
            "eos_token_ids": list(mr.model_config.eos_token_ids),
        }
