"""A fake TpModelWorker for scheduler tests: no model, but a "KV pool" that stores the token id
and the position written at each slot. Every step checks that the req_to_token rows it was
given point, position by position, at written slots (prefix cache hits included), and the next
token is a fixed function of the whole sequence read back from those slots: a row pointing at
a wrong slot changes that request's output, which the tests compare with `expected_output`.
It works as the real worker does, from the step's snapshot (ModelWorkerBatch) only, so the
overlap loop can run it on its forward thread with future input ids."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from radixserve.distributed.parallel_state import TpGroup
from radixserve.layers.sampler import Sampler
from radixserve.managers.tp_worker import TpModelWorker
from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from radixserve.model_executor.forward_batch import ModelWorkerBatch
from radixserve.model_executor.model_runner import InputLogprobs, LogitsOutput

VOCAB = 97
EOS = 2


def next_token(seq: list[int], window: int | None = None) -> int:
    """A hash of the whole sequence; or, with `window`, of its last `window` tokens into 8
    tokens only: a model whose text soon repeats itself, for speculative decoding."""
    h = 0
    for t in seq[-window:] if window else seq:
        h = (h * 31 + t) % 1_000_003
    return 3 + h % (8 if window else VOCAB - 3)


def prompt_logprob(prefix: list[int], token: int) -> float:
    """The fake model's logprob of `token` after `prefix` (a prompt logprob)."""
    return -float(1 + (next_token(prefix) * 7 + token) % 11)


@dataclass
class FakeConfig:
    vocab_size: int = VOCAB
    eos_token_ids: tuple[int, ...] = (EOS,)


class FakeModelRunner:
    def __init__(
        self, total_tokens: int, max_running: int, context_len: int, page_size: int
    ) -> None:
        self.device = "cpu"
        self.model_path = "fake-model"  # no files: the storage tier's namespace names it only
        self.model_config = FakeConfig()
        self.max_total_num_tokens = total_tokens
        self.max_running_requests = max_running
        self.context_len = context_len
        self.req_to_token_pool = ReqToTokenPool(max_running, context_len + 8)
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(total_tokens, page_size)
        self.kv = torch.full((total_tokens + page_size,), -1, dtype=torch.int64)
        self.kv_pos = torch.full((total_tokens + page_size,), -1, dtype=torch.int64)
        # The per-slot buffers a hierarchical cache copies between tiers (its K and V).
        self.token_to_kv_pool = SimpleNamespace(k_buffer=[self.kv], v_buffer=[self.kv_pos])
        self.fused_ops = False  # torch's ops (a real runner's flag for radixserve's kernels)
        self.sampler = Sampler()

    def sample(self, logits, info, return_logprob=False, top_logprobs_num=0):
        return self.sampler(logits, info, return_logprob, top_logprobs_num)


class FakeWorker(TpModelWorker):
    def __init__(
        self,
        total_tokens: int = 4096,
        max_running: int = 16,
        context_len: int = 2048,
        page_size: int = 1,
        window: int | None = None,
    ) -> None:
        self.model_runner = FakeModelRunner(total_tokens, max_running, context_len, page_size)
        self.tp_group = TpGroup.single()  # one rank: TpModelWorker.sample broadcasts nothing
        self.window = window
        self.device = "cpu"
        self.vocab_size = VOCAB
        self.steps = 0

    def forward(self, mwb: ModelWorkerBatch, input_ids: torch.Tensor | None = None):
        """Logits [B, VOCAB] whose argmax is next_token(the row's sequence)."""
        mr = self.model_runner
        ids = input_ids if input_ids is not None else torch.tensor(mwb.input_ids)
        assert bool((ids >= 0).all()), "an unresolved future input id"
        loc = mwb.out_cache_loc
        assert len(loc) == len(ids)
        assert len(torch.unique(loc)) == len(loc), "two new tokens share a slot"
        mr.kv[loc] = ids
        mr.kv_pos[loc] = torch.tensor(mwb.positions, dtype=torch.int64)
        logits = torch.zeros(mwb.batch_size, VOCAB)
        for b, seq_len in enumerate(mwb.seq_lens):
            slots = mwb.kv_rows[b, :seq_len]
            pos = mr.kv_pos[slots].tolist()
            assert pos == list(range(seq_len)), (
                f"{mwb.rids[b]}: its row points at slots of positions {pos[:8]}..."
            )
            # Ignored for intermediate chunks; otherwise seq_len covers prompt + outputs.
            logits[b, next_token(mr.kv[slots].tolist(), self.window)] = 1.0
        self.steps += 1
        return LogitsOutput(logits, self._input_logprobs(mwb))

    def _input_logprobs(self, mwb: ModelWorkerBatch) -> InputLogprobs | None:
        """prompt_logprob of each target after the sequence read back from the KV "pool" up
        to that token's position; top-k: next_token, next_token + 1, ... at -1, -2, ..."""
        if mwb.input_logprob_indices is None:
            return None
        assert mwb.input_logprob_targets is not None and mwb.input_logprob_counts is not None
        mr, vals, tops, k = self.model_runner, [], [], mwb.top_logprobs_num
        row_of = [b for b, n in enumerate(mwb.extend_lens) for _ in range(n)]
        for idx, target in zip(mwb.input_logprob_indices, mwb.input_logprob_targets, strict=True):
            b, pos = row_of[idx], mwb.positions[idx]
            prefix = mr.kv[mwb.kv_rows[b, : pos + 1]].tolist()
            vals.append(prompt_logprob(prefix, target))
            tops.append([(next_token(prefix) + j) % VOCAB for j in range(k)])
        top = None
        if k > 0:
            ids = torch.tensor(tops, dtype=torch.int64).view(-1, k)
            top = (-torch.arange(1, k + 1, dtype=torch.float32).expand(len(vals), k), ids)
        return InputLogprobs(torch.tensor(vals), top)

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        mr = self.model_runner
        mr.kv[dst] = mr.kv[src]
        mr.kv_pos[dst] = mr.kv_pos[src]

    def get_memory_info(self) -> dict:
        mr = self.model_runner
        return {
            "max_total_num_tokens": mr.max_total_num_tokens,
            "max_running_requests": mr.max_running_requests,
            "context_len": mr.context_len,
            "vocab_size": VOCAB,
        }


def expected_output(prompt: list[int], n: int, window: int | None = None) -> list[int]:
    seq = list(prompt)
    out = []
    for _ in range(n):
        t = next_token(seq, window)
        out.append(t)
        seq.append(t)
    return out


class FakeRun:
    """A Scheduler over the fake worker, driven step by step in this process; outputs collected
    per rid. `overlap` forces the loop (None: what this machine's CPUs choose)."""

    def __init__(
        self,
        total_tokens: int = 4096,
        max_running: int = 16,
        tokenizer=None,
        overlap: bool | None = None,
        window: int | None = None,
        **kwargs,
    ) -> None:
        from radixserve.args import ServerArgs
        from radixserve.managers.scheduler import Scheduler

        kwargs.setdefault("enable_integrity_checks", True)
        if overlap is not None:
            kwargs["disable_overlap_schedule"] = not overlap
        args = ServerArgs(device="cpu", dtype="float32", **kwargs).resolve()
        self.worker = FakeWorker(
            total_tokens=total_tokens,
            max_running=max_running,
            page_size=kwargs.get("page_size", 1),
            window=window,
        )
        self.outs: list = []
        self.s = Scheduler(args, self.outs.append, tokenizer=tokenizer, tp_worker=self.worker)
        if overlap is not None:
            self.s.enable_overlap = overlap
        self.prompts: dict[str, list[int]] = {}
        self.max_new: dict[str, int] = {}
        self.launched: list[list[str]] = []  # rids of each step's batch, in launch order

    def submit(
        self,
        rid: str,
        prompt: list[int],
        max_new: int = 16,
        *,
        stream: bool = False,
        logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        **params,
    ) -> None:
        from radixserve.io_struct import TokenizedGenerateReqInput
        from radixserve.sampling_params import SamplingParams

        self.prompts[rid], self.max_new[rid] = prompt, max_new
        params.setdefault("temperature", 0.0)
        params.setdefault("ignore_eos", True)
        sp = SamplingParams(max_new_tokens=max_new, **params)
        msg = TokenizedGenerateReqInput(
            rid,
            None,
            prompt,
            sp,
            stream,
            logprob,
            top_logprobs_num=top_logprobs_num,
            logprob_start_len=logprob_start_len,
        )
        self.s.process_input_requests([msg])

    def abort(self, rid: str) -> None:
        from radixserve.io_struct import AbortReq

        self.s.process_input_requests([AbortReq(rid)])

    def step(self):
        batch = self.s.step()
        self.launched.append([r.rid for r in batch.reqs] if batch is not None else [])
        return batch

    def drain(self, max_steps: int = 20_000) -> None:
        for _ in range(max_steps):
            if not self.s.has_work():
                self.s.assert_drained()
                return
            self.step()
        raise AssertionError("the scheduler did not drain")

    def token_outputs(self) -> list:
        """The requests' outputs (not the control calls' answers)."""
        return [m for m in self.outs if hasattr(m, "rids")]

    def tokens(self) -> dict[str, list[int]]:
        got: dict[str, list[int]] = {}
        for msg in self.token_outputs():
            for rid, ids in zip(msg.rids, msg.output_ids, strict=True):
                got.setdefault(rid, []).extend(ids)
        return got

    def reasons(self) -> dict[str, dict]:
        got: dict[str, dict] = {}
        for msg in self.token_outputs():
            for rid, reason in zip(msg.rids, msg.finished_reasons, strict=True):
                if reason is not None:
                    assert rid not in got, f"{rid} finished twice"
                    got[rid] = reason
        return got


class PackedMaskBackend:
    """The vocabulary-mask layout of the xgrammar backend (int32 words, bit set = allowed),
    without a tokenizer, for grammar tests with fake matchers."""

    def __init__(self, vocab_size: int = VOCAB) -> None:
        self.vocab_size = vocab_size

    def close(self) -> None:
        pass

    def allocate_vocab_mask(self, batch_size: int) -> torch.Tensor:
        return torch.full((batch_size, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)

    @staticmethod
    def unpack_vocab_mask(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
        shifts = torch.arange(32, dtype=torch.int32)
        bits = (mask.unsqueeze(-1) >> shifts) & 1
        return bits.view(mask.shape[0], -1)[:, :vocab_size] == 0
