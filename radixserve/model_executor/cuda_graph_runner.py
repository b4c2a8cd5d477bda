"""CudaGraphRunner: decode steps on a GPU replayed from CUDA graphs captured at start-up.

A decode step of a small model on a GPU is bounded by launching its kernels, not by running
them: a few hundred kernels of microseconds each, every one issued from Python. The runner
captures the whole decode forward (embedding, every layer, the final norm, the head) once per
shape and replays it with one call, as SGLang's CudaGraphRunner does.

A graph's shapes are fixed, so the runner captures one per (batch-size bucket, KV-length
bucket): batch sizes 1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, … up to --cuda-graph-max-bs, and
KV lengths 256, 512, 1024, … up to the context length. A step is padded to the smallest bucket
that holds it: padded rows read token 0 at position 0, attend one slot and write their KV to
slot 0 (reserved for padding writes, memory_pool.py); their logits are dropped. The inputs go
into static buffers the graphs read (input ids, positions, sequence lengths, the new tokens'
slots, the step's req_to_token rows), and every graph writes its logits into one static
buffer, which replay copies out. Attention is the torch-native backend's decode (K/V gathered
through the step's rows, padded to the KV bucket, masked by the sequence lengths), its
metadata built inside the graph from those buffers (init_forward_metadata_graph), so nothing
in the captured step reads a host value.

The padded gather costs memory in proportion to batch × KV length (a layer's K and V copies,
scores and probabilities), so a pair whose gather would not fit in half the device memory left
after the KV pool is not captured: a long-context model gets graphs for its short rows, and
its long rows at large batches run eagerly instead of failing at start-up.

Steps a graph does not cover run eagerly: extend and mixed steps, batches above the largest
bucket, pairs not captured. `--disable-cuda-graph` turns it off. With `capture=False` (tests,
on CPU) the same padded step runs eagerly through the same buffers.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING

import torch

from radixserve.model_executor.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from radixserve.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

DEFAULT_MAX_BS = 128
MIN_KV_BUCKET = 256


def batch_size_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then 16·2^k and 24·2^k (a padded batch is at most a third larger), up to
    and including max_bs."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_bs]
    b = 16
    while b < max_bs:
        sizes += [s for s in (b, b * 3 // 2) if s < max_bs]
        b *= 2
    return sizes + [max_bs]


def kv_len_buckets(context_len: int) -> list[int]:
    """256, 512, 1024, … below context_len, then context_len itself."""
    lens, n = [], MIN_KV_BUCKET
    while n < context_len:
        lens.append(n)
        n *= 2
    return lens + [context_len]


class _StaticInputs:
    """The buffers every graph reads and writes; a step's inputs are copied into their head."""

    def __init__(self, max_bs: int, max_len: int, vocab: int, device: str) -> None:
        def ints(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        self.input_ids = ints(max_bs)
        self.positions = ints(max_bs)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int64, device=device)
        self.out_cache_loc = ints(max_bs)  # padding rows write slot 0
        self.kv_rows = ints(max_bs, max_len)
        self.logits = torch.zeros(max_bs, vocab, dtype=torch.float32, device=device)


def gather_bytes_per_slot(runner: ModelRunner) -> int:
    """Bytes one (row, KV position) of a padded decode step holds at once, in one layer: its K
    and V copies in the model's dtype, fp32 scores and the probabilities, the slot index and
    the mask."""
    cfg = runner.model_config
    elem = torch.empty((), dtype=runner.dtype).element_size()
    kv = 2 * cfg.num_key_value_heads * cfg.head_dim * elem
    return kv + cfg.num_attention_heads * (4 + 4 + elem) + 8 + 8


class CudaGraphRunner:
    """`memory_budget`: bytes a graph's padded gather may take (None: half the device memory
    free at capture; no limit without capture)."""

    def __init__(
        self, model_runner: ModelRunner, capture: bool = True, memory_budget: int | None = None
    ) -> None:
        self.runner = model_runner
        sa = model_runner.server_args
        max_bs = min(sa.cuda_graph_max_bs or DEFAULT_MAX_BS, model_runner.max_running_requests)
        self.batch_sizes = batch_size_buckets(max_bs)
        self.kv_lens = kv_len_buckets(model_runner.context_len)
        self.device = model_runner.device
        if memory_budget is None and capture:
            memory_budget = torch.cuda.mem_get_info()[0] // 2
        per_slot = gather_bytes_per_slot(model_runner)
        self.pairs = {
            (bs, kv_len)
            for bs in self.batch_sizes
            for kv_len in self.kv_lens
            if memory_budget is None or bs * kv_len * per_slot <= memory_budget
        }
        with torch.inference_mode():
            self.buffers = _StaticInputs(
                self.batch_sizes[-1],
                self.kv_lens[-1],
                model_runner.model_config.vocab_size,
                self.device,
            )
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.captured = capture
        if capture:
            self.capture()

    # -- capture --------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        total = len(self.pairs)
        logger.info(
            "capturing %d CUDA graphs for decode: batch sizes %s × KV lengths %s%s",
            total,
            self.batch_sizes,
            self.kv_lens,
            _skipped_note(len(self.batch_sizes) * len(self.kv_lens) - total),
        )
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        # The largest first: later graphs reuse its memory from the shared pool.
        for kv_len in reversed(self.kv_lens):
            for bs in reversed(self.batch_sizes):
                if (bs, kv_len) not in self.pairs:
                    continue
                with torch.cuda.stream(stream):
                    self._step(bs, kv_len)  # warm-up: cuBLAS handles, the rope table's device
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._step(bs, kv_len)
                self.graphs[(bs, kv_len)] = graph
            logger.info(
                "captured %d/%d CUDA graphs (%.1f s)",
                len(self.graphs),
                total,
                time.perf_counter() - start,
            )
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def _step(self, bs: int, kv_len: int) -> None:
        """The decode forward of the first `bs` rows of the static buffers, over `kv_len` KV
        columns, its logits written into buffers.logits[:bs]."""
        runner, b = self.runner, self.buffers
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=b.input_ids[:bs],
            positions=b.positions[:bs],
            req_pool_indices=b.input_ids.new_zeros(0),  # not read by a decode forward
            seq_lens=b.seq_lens[:bs],
            out_cache_loc=b.out_cache_loc[:bs],
            seq_lens_cpu=[],  # host values do not exist inside a graph
            extend_prefix_lens_cpu=[],
            extend_seq_lens_cpu=[],
            kv_rows=b.kv_rows[:bs, :kv_len],
            req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool=runner.token_to_kv_pool,
            attn_backend=runner.attn_backend,
        )
        runner.attn_backend.init_forward_metadata_graph(fb)
        hidden = runner.model(fb)
        b.logits[:bs].copy_(runner.model.compute_logits(hidden))

    # -- replay ---------------------------------------------------------------------------------
    def buckets(self, fb: ForwardBatch) -> tuple[int, int] | None:
        """The (batch size, KV length) graph a step pads to, or None where none covers it."""
        if (
            not fb.forward_mode.is_decode()
            or not 0 < fb.batch_size <= self.batch_sizes[-1]
            or fb.input_logprob_indices is not None
        ):
            return None
        longest = max(fb.seq_lens_cpu)
        if longest > self.kv_lens[-1]:
            return None
        pair = (
            self.batch_sizes[bisect.bisect_left(self.batch_sizes, fb.batch_size)],
            self.kv_lens[bisect.bisect_left(self.kv_lens, longest)],
        )
        return pair if pair in self.pairs else None

    def can_run(self, fb: ForwardBatch) -> bool:
        return self.buckets(fb) is not None

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """The step's next-token logits [B, vocab] fp32, from the graph of its buckets."""
        bs = fb.batch_size
        pair = self.buckets(fb)
        assert pair is not None, "replay of a step no graph covers"
        graph_bs, kv_len = pair
        b = self.buffers
        b.input_ids[:bs].copy_(fb.input_ids)
        b.positions[:bs].copy_(fb.positions)
        b.seq_lens[:bs].copy_(fb.seq_lens)
        b.out_cache_loc[:bs].copy_(fb.out_cache_loc)
        width = min(fb.kv_rows.shape[1], kv_len)
        b.kv_rows[:bs, :width].copy_(fb.kv_rows[:, :width])
        if graph_bs > bs:  # padding rows (their kv_rows are never read past column 0)
            b.input_ids[bs:graph_bs].zero_()
            b.positions[bs:graph_bs].zero_()
            b.seq_lens[bs:graph_bs].fill_(1)
            b.out_cache_loc[bs:graph_bs].zero_()
        if self.captured:
            self.graphs[(graph_bs, kv_len)].replay()
        else:
            self._step(graph_bs, kv_len)
        # A copy: the next replay rewrites the buffer while this step's sampling may wait.
        return b.logits[:bs].clone()


def _skipped_note(skipped: int) -> str:
    if not skipped:
        return ""
    return f" ({skipped} larger pairs run eagerly: their padded KV gather exceeds the memory left)"
