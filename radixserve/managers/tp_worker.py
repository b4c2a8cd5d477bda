"""TpModelWorker: turns a ScheduleBatch into a ForwardBatch, runs the model and samples.

The scheduler's only door to the model. With one rank there is no collective; with tensor
parallelism every rank would run the same step and agree on the sampled tokens (invariant 10).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.args import ServerArgs
from radixserve.layers.sampler import SamplingBatchInfo
from radixserve.managers.schedule_batch import ScheduleBatch
from radixserve.model_executor.model_runner import ModelRunner


@dataclass
class GenerationBatchResult:
    next_token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[float, int]]] | None = None


class TpModelWorker:
    def __init__(self, server_args: ServerArgs, model_runner: ModelRunner | None = None) -> None:
        self.model_runner = model_runner or ModelRunner(server_args)
        self.device = self.model_runner.device
        self.vocab_size = self.model_runner.model_config.vocab_size

    def forward_batch_generation(self, batch: ScheduleBatch) -> GenerationBatchResult:
        fb = batch.get_forward_batch(self.device)
        info = SamplingBatchInfo.from_reqs(batch.reqs, self.vocab_size, self.device)
        if batch.vocab_mask is not None:
            info.vocab_mask = batch.vocab_mask.to(self.device)
        logits = self.model_runner.forward(fb).next_token_logits
        want_lp = any(r.return_logprob for r in batch.reqs)
        top_n = max((r.top_logprobs_num for r in batch.reqs), default=0)
        out = self.model_runner.sample(logits, info, want_lp, top_n)
        result = GenerationBatchResult(out.next_token_ids.tolist())
        if out.logprobs is not None:
            result.logprobs = out.logprobs.tolist()
        if out.top_logprobs is not None:
            vals, ids = out.top_logprobs
            result.top_logprobs = [
                list(zip(v, i, strict=True))
                for v, i in zip(vals.tolist(), ids.tolist(), strict=True)
            ]
        return result

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
