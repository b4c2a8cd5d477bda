"""TpModelWorker: runs one step's ModelWorkerBatch through the model and samples.

The scheduler's only door to the model. With one rank there is no collective; with tensor
parallelism every rank runs the same step, and `sample` hands every rank rank 0's sampled
tokens (a broadcast on the model's group, from the thread that runs the forward), so the ranks
agree on the tokens whatever their sampling did (invariant 10).
The step is split in two (`forward` → logits, `sample` → tokens) so the overlap loop can run
the forward before the sampling inputs are known (grammar masks, penalties).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from radixserve.args import ServerArgs
from radixserve.distributed.parallel_state import TpGroup
from radixserve.layers.sampler import SampleOutput, SamplingBatchInfo
from radixserve.model_executor.forward_batch import ModelWorkerBatch
from radixserve.model_executor.model_runner import InputLogprobs, LogitsOutput, ModelRunner

Pairs = list[tuple[float, int]]
MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass
class GenerationBatchResult:
    next_token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[Pairs] | None = None
    # Prompt logprobs of an extend step, per row: (logprob, prompt token), and the top-k.
    input_token_logprobs: list[Pairs] | None = None
    input_top_logprobs: list[list[Pairs]] | None = None

    @classmethod
    def from_sample(
        cls,
        out: SampleOutput,
        mwb: ModelWorkerBatch | None = None,
        input_logprobs: InputLogprobs | None = None,
    ) -> GenerationBatchResult:
        result = cls(out.next_token_ids.tolist())
        if out.logprobs is not None:
            result.logprobs = out.logprobs.tolist()
        if out.top_logprobs is not None:
            result.top_logprobs = _pairs(*out.top_logprobs)
        if input_logprobs is not None:
            assert mwb is not None and mwb.input_logprob_counts is not None
            assert mwb.input_logprob_targets is not None
            pairs = list(
                zip(input_logprobs.token_logprobs.tolist(), mwb.input_logprob_targets, strict=True)
            )
            tops = _pairs(*input_logprobs.top) if input_logprobs.top is not None else None
            result.input_token_logprobs, result.input_top_logprobs = [], []
            pos = 0
            for n in mwb.input_logprob_counts:
                result.input_token_logprobs.append(pairs[pos : pos + n])
                result.input_top_logprobs.append(tops[pos : pos + n] if tops else [])
                pos += n
        return result


def _pairs(vals: torch.Tensor, ids: torch.Tensor) -> list[Pairs]:
    return [list(zip(v, i, strict=True)) for v, i in zip(vals.tolist(), ids.tolist(), strict=True)]


class TpModelWorker:
    def __init__(
        self,
        server_args: ServerArgs,
        model_runner: ModelRunner | None = None,
        tp: TpGroup | None = None,
        tokenizer: Any = None,
    ) -> None:
        self.tp_group = tp or TpGroup.single()
        self.model_runner = model_runner or ModelRunner(
            server_args, tp=self.tp_group, tokenizer=tokenizer
        )
        self.device = self.model_runner.device
        self.vocab_size = self.model_runner.model_config.vocab_size

    def forward(self, mwb: ModelWorkerBatch, input_ids: torch.Tensor | None = None) -> LogitsOutput:
        """Next-token logits [B, V] (and prompt logprobs where asked for); `input_ids` replaces
        mwb.input_ids (resolved futures)."""
        fb = mwb.to_forward_batch(self.device, input_ids)
        return self.model_runner.forward(fb)

    def sample(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        vocab_mask: torch.Tensor | None,
        mwb: ModelWorkerBatch,
    ) -> SampleOutput:
        if vocab_mask is not None:
            info.vocab_mask = vocab_mask.to(self.device)
        out = self.model_runner.sample(logits, info, mwb.return_logprob, mwb.top_logprobs_num)
        if self.tp_group.world_size > 1:
            ids = out.next_token_ids.contiguous()
            out.next_token_ids = self.tp_group.broadcast_from_first(ids)
        return out

    def forward_batch_generation(
        self, mwb: ModelWorkerBatch, vocab_mask: torch.Tensor | None = None
    ) -> GenerationBatchResult:
        """One whole step, as the normal loop runs it."""
        assert isinstance(mwb.sampling_info, SamplingBatchInfo)
        out = self.forward(mwb)
        return GenerationBatchResult.from_sample(
            self.sample(out.next_token_logits, mwb.sampling_info, vocab_mask, mwb),
            mwb,
            out.input_logprobs,
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
            "architectures": [mr.model_config.architecture],
            "model_type": mr.model_config.hf_config.get("model_type")
            or MODEL_TYPES.get(mr.model_config.architecture),
        }
