"""ModelRunner: owns the model, the KV pools, the attention backend and the sampler.

Called by TpModelWorker with a ForwardBatch; returns next-token logits for the sampled rows.
Pool sizing: --max-total-tokens, else a fraction of free memory (RAM on CPU, HBM on CUDA).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.args import ServerArgs, physical_core_count
from radixserve.distributed.parallel_state import TpGroup, local_head_counts
from radixserve.layers.attention.base import AttentionBackend
from radixserve.layers.attention.cpu_paged_backend import CpuPagedAttnBackend
from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend
from radixserve.layers.decode_step import CpuDecodeStep
from radixserve.layers.fused_ops import set_fused_ops
from radixserve.layers.linear import packed_form, prepack_linears
from radixserve.layers.quantization import W8A8, quantize_model, smooth_model
from radixserve.layers.sampler import SampleOutput, Sampler, SamplingBatchInfo
from radixserve.lora.manager import LoRAManager
from radixserve.mem_cache.memory_pool import (
    MHATokenToKVPool,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
)
from radixserve.model_executor.cuda_graph_runner import CudaGraphRunner
from radixserve.model_executor.forward_batch import ForwardBatch
from radixserve.model_loader.loader import (
    detect_load_format,
    load_model,
    load_model_config,
    resolve_model_path,
    to_torch_dtype,
)
from radixserve.model_loader.model_config import ModelConfig

logger = logging.getLogger(__name__)

DEFAULT_MAX_RUNNING_REQUESTS = 256


# Rows of prompt logprobs computed per block: a block's logits are [rows, vocab] fp32.
INPUT_LOGPROB_BLOCK = 256


@dataclass
class InputLogprobs:
    """Logprobs of prompt tokens (`logprob_start_len`): for each requested position, the
    logprob of the next prompt token, and the top-k (values, ids) when asked for."""

    token_logprobs: torch.Tensor  # [N] fp32
    top: tuple[torch.Tensor, torch.Tensor] | None = None  # ([N, k], [N, k])


@dataclass
class LogitsOutput:
    next_token_logits: torch.Tensor  # [B, V] fp32, one row per request (its last token)
    input_logprobs: InputLogprobs | None = None


class ModelRunner:
    """`draft_of`: this runner is the speculative draft model of that (target) runner. It loads
    --speculative-draft-model-path and keeps KV of its own, indexed by the target's slots: it
    shares the target's req_to_token rows and slot allocator, so a slot holds both models' KV
    of the same token and the radix cache serves both.

    `tokenizer`: the caller's, if it has loaded one (only w8a8_int8's calibration reads it; a
    GGUF's takes seconds to load); else loaded when needed."""

    def __init__(
        self,
        server_args: ServerArgs,
        draft_of: ModelRunner | None = None,
        tp: TpGroup | None = None,
        tokenizer: Any = None,
    ) -> None:
        self.server_args = server_args
        self.tokenizer = (
            tokenizer if tokenizer is not None else getattr(draft_of, "tokenizer", None)
        )
        self.device = server_args.device
        self.is_draft = draft_of is not None
        self.lora_manager: LoRAManager | None = None  # --lora-paths (set once the model is)
        self.tp = tp or TpGroup.single()
        # The TP ranks on this machine share its cores and its memory.
        self.local_ranks = len(server_args.local_tp_ranks)
        if self.device == "cpu" and not self.is_draft:
            threads = server_args.num_threads or max(1, physical_core_count() // self.local_ranks)
            torch.set_num_threads(threads)
        # The intra-op threads the forward and sampling run with (torch_threads): the served
        # scheduler runs its own work on one thread.
        self.num_threads = torch.get_num_threads()
        torch.manual_seed(server_args.random_seed)
        if draft_of is None:
            self.model_path = resolve_model_path(server_args.model_path)
        else:
            draft = server_args.speculative_draft_model_path
            self.model_path = resolve_model_path(draft, "--speculative-draft-model-path")
        self.load_format = detect_load_format(self.model_path, server_args.load_format)
        self.dtype = to_torch_dtype(server_args.dtype)
        self.model, self.model_config = load_model(
            self.model_path,
            self.load_format,
            server_args.dtype,
            self.device,
            server_args.random_seed,
            server_args.context_length,
            # w8a8_int8 quantizes after a calibration pass (_quantize_w8a8), below.
            None if server_args.quantization == W8A8 else server_args.quantization,
            tp=self.tp if self.tp.world_size > 1 else None,
        )
        if draft_of is not None:
            self.share_target_pools(draft_of)
        else:
            self._check_tokenizer_fits()
            self.context_len = (
                server_args.context_length or self.model_config.max_position_embeddings
            )
            self.init_memory_pool()
        self.attn_backend = create_attention_backend(server_args.attention_backend, self.device)
        # The cpu_paged backend's library also holds the layers' fused element-wise kernels.
        self.fused_ops = self.attn_backend.uses_cpu_kernels
        set_fused_ops(self.model, self.fused_ops)
        if server_args.quantization == W8A8:
            self._quantize_w8a8()
        if self.fused_ops:  # the CPU fast path: bf16 weights packed once (linear.py)
            packed = prepack_linears(self.model)
            if packed:
                logger.info("prepacked %d bf16 weights (%s)", packed, packed_form(self.model))
            if isinstance(self.attn_backend, CpuPagedAttnBackend):
                where = self.attn_backend.tile_kernels_run_on(
                    self.dtype, self.token_to_kv_pool.dtype, self.model_config.head_dim
                )
                if where:
                    logger.info("prompts and shared prefixes attend on %s (bf16 tiles)", where)
        if self.fused_ops and not server_args.disable_cpu_decode_step:
            decode_step = CpuDecodeStep.build(self.model)
            if decode_step is not None:
                self.model.model.decode_step = decode_step
        # After the decode step and the packing, which steps with adapters use as they are.
        if (server_args.lora_paths or server_args.enable_lora) and not self.is_draft:
            self.lora_manager = LoRAManager(
                self.model,
                server_args.lora_paths,
                server_args.max_lora_rank,
                self.dtype,
                self.device,
            )
        self.cuda_graph_runner: CudaGraphRunner | None = None
        if self.device == "cuda" and not server_args.disable_cuda_graph:
            self.cuda_graph_runner = self._init_cuda_graphs()
        self.sampler = Sampler(cpu_kernels=self.fused_ops)

    def _init_cuda_graphs(self) -> CudaGraphRunner | None:
        if not isinstance(self.attn_backend, TorchNativeAttnBackend):
            logger.info("decode steps run eagerly: the %s backend", self.attn_backend.name)
            return None
        if self.tp.world_size > 1:
            logger.info("decode steps run eagerly: tensor parallelism")
            return None
        return CudaGraphRunner(self)

    # -- w8a8_int8 --------------------------------------------------------------------------------
    CALIBRATION_TOKENS = 512

    def _quantize_w8a8(self) -> None:
        """--quantization w8a8_int8: measure the input range of each RMSNorm-fed linear layer
        on one calibration prefill, fold SmoothQuant's factors into the weights
        (quantization.smooth_model), then quantize every linear layer but the head."""
        start = time.perf_counter()
        layers = getattr(getattr(self.model, "model", None), "layers", [])
        targets = [
            m for layer in layers for m in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj)
        ]
        amax: dict[torch.nn.Module, torch.Tensor] = {}

        def record(module: torch.nn.Module, args: tuple) -> None:
            x = args[0]
            seen = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
            prev = amax.get(module)
            amax[module] = seen if prev is None else torch.maximum(prev, seen)

        hooks = [m.register_forward_pre_hook(record) for m in targets]
        try:
            ids = self._calibration_ids()
            self.prefill_hidden(ids)
        finally:
            for hook in hooks:
                hook.remove()
        # (measured under inference mode: clone to ordinary tensors)
        smoothed = smooth_model(self.model, {m: a.clone() for m, a in amax.items()})
        quantize_model(self.model, W8A8)
        logger.info(
            "w8a8_int8: calibrated on %d tokens, smoothed %d norm/linear pairs (%.1f s)",
            len(ids),
            smoothed,
            time.perf_counter() - start,
        )

    def _calibration_ids(self) -> list[int]:
        """Tokens from the end of Python's reference documentation (bench perplexity's default
        text, shipped with Python; that benchmark scores its beginning), or fixed pseudo-random
        ids where the tokenizer cannot be loaded or does not fit the model."""
        # As many whatever the flags: the quantized weights follow from them, and two servers
        # of one model (replicas, a P/D pair) sized their pools or contexts apart ran two
        # models (a pool of one token calibrated on none: a traceback after the load).
        n = min(self.CALIBRATION_TOKENS, self.model_config.max_position_embeddings)
        if n > min(self.max_total_num_tokens - 1, self.context_len):
            raise ValueError(
                f"--quantization w8a8_int8 calibrates on {n} tokens, more than the context "
                f"length ({self.context_len}) or the KV pool ({self.max_total_num_tokens} "
                "tokens) holds: raise --context-length or --max-total-tokens"
            )
        vocab = self.model_config.vocab_size
        try:
            from radixserve.bench.perplexity import default_text
            from radixserve.managers.tokenizer_utils import load_tokenizer_for

            tokenizer = self.tokenizer
            if tokenizer is None:
                tokenizer = load_tokenizer_for(self.server_args)
            ids = tokenizer(default_text()[-8 * n :], add_special_tokens=False)["input_ids"][-n:]
            if len(ids) == n and max(ids) < vocab:
                return ids
        except Exception as exc:  # noqa: BLE001 - any tokenizer failure: fall back, say so
            logger.info("w8a8_int8 calibrates on fixed token ids (no tokenizer: %s)", exc)
        gen = torch.Generator().manual_seed(0)
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    def prefill_hidden(self, ids: list[int]) -> torch.Tensor:
        """Prefill `ids` as one request outside any scheduler (calibration, `bench
        perplexity`): the final hidden state of every token; its KV slots are freed again."""
        from radixserve.managers.schedule_batch import Req, ScheduleBatch
        from radixserve.mem_cache.chunk_cache import ChunkCache
        from radixserve.sampling_params import SamplingParams

        cache = ChunkCache(self.req_to_token_pool, self.token_to_kv_pool_allocator)
        req = Req("prefill", ids, SamplingParams(max_new_tokens=1, temperature=0.0))
        req.init_next_round_input(cache)
        batch = ScheduleBatch([req], self.req_to_token_pool, self.token_to_kv_pool_allocator, cache)
        batch.prepare_for_extend()
        with torch.inference_mode():
            hidden = self.forward_hidden(batch.get_forward_batch(self.device))
        cache.cache_finished_req(req)
        return hidden

    # -- memory ---------------------------------------------------------------------------------
    def init_memory_pool(self) -> None:
        cfg: ModelConfig = self.model_config
        sa = self.server_args
        kv_dtype = to_torch_dtype(sa.kv_cache_dtype)
        # With TP each rank's pool holds only its own KV heads.
        _, kv_heads = local_head_counts(
            cfg.num_attention_heads, cfg.num_key_value_heads, self.tp.world_size
        )
        per_token = MHATokenToKVPool.bytes_per_token(
            cfg.num_hidden_layers, kv_heads, cfg.head_dim, kv_dtype
        )
        draft_per_token, draft_weights = self._draft_footprint(kv_dtype)
        total = sa.max_total_tokens or self._profile_max_num_tokens(
            per_token + draft_per_token, reserved=draft_weights
        )
        if self.tp.world_size > 1:  # every rank schedules the same slots: the smallest pool
            total = self.tp.min_int(total)
        total = max(sa.page_size, total // sa.page_size * sa.page_size)
        self.max_total_num_tokens = total
        rows = sa.max_running_requests or min(DEFAULT_MAX_RUNNING_REQUESTS, max(1, total // 2))
        if rows > total:  # each running request holds at least one of the pool's tokens
            logger.warning(
                "--max-running-requests %d: the KV pool holds %d tokens; running at most %d",
                rows,
                total,
                total,
            )
            rows = total
        self.max_running_requests = rows
        if sa.max_total_tokens or sa.max_running_requests:
            self._check_pool_fits(total, per_token + draft_per_token, draft_weights)
        # The scheduler's tables stay in host memory on every device: a step copies the rows
        # it reads to the device (ModelWorkerBatch.kv_rows); only the KV itself lives there.
        self.req_to_token_pool = ReqToTokenPool(
            self.max_running_requests, self.context_len + 8, "cpu"
        )
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(total, sa.page_size, "cpu")
        self.token_to_kv_pool = MHATokenToKVPool(
            total,
            cfg.num_hidden_layers,
            kv_heads,
            cfg.head_dim,
            kv_dtype,
            self.device,
            sa.page_size,
        )
        logger.info(
            "KV pool: %d tokens (%.1f MiB, %s), %d request rows",
            total,
            total * per_token / 2**20,
            sa.kv_cache_dtype,
            self.max_running_requests,
        )

    def _check_tokenizer_fits(self) -> None:
        """Refuse a tokenizer whose vocabulary (without added tokens: a pad token past the
        embedding is never produced from text) is larger than the model's: a --tokenizer-path
        of another model's served every request a 400 blaming the client's input_ids."""
        words = getattr(self.tokenizer, "vocab_size", None)
        vocab = self.model_config.vocab_size
        if isinstance(words, int) and words > vocab:
            raise ValueError(
                f"the tokenizer's vocabulary ({words} tokens) is larger than the model's "
                f"({vocab}): it is not this model's tokenizer (--tokenizer-path)"
            )

    def share_target_pools(self, target: ModelRunner) -> None:
        cfg = self.model_config
        sizes = cfg.vocab_size, target.model_config.vocab_size
        # Embedding tables padded past one tokenizer (Qwen2.5-0.5B's 151936 rows, 7B's 152064)
        # differ only in rows no token uses: the draft's logits take the target's width.
        words = len(self.tokenizer) if self.tokenizer is not None else None
        if sizes[0] != sizes[1] and (words is None or min(sizes) < words):
            raise ValueError(
                f"the draft model's vocabulary ({sizes[0]} tokens) differs from the target's "
                f"({sizes[1]}){'' if words is None else f', and the tokenizer has {words}'}: "
                "they must share a tokenizer"
            )
        if cfg.max_position_embeddings < target.context_len:
            raise ValueError(
                f"the draft model's context ({cfg.max_position_embeddings}) is shorter than the "
                f"target's ({target.context_len}); pass --context-length to serve less"
            )
        self.context_len = target.context_len
        self.max_total_num_tokens = target.max_total_num_tokens
        self.max_running_requests = target.max_running_requests
        self.req_to_token_pool = target.req_to_token_pool
        self.token_to_kv_pool_allocator = target.token_to_kv_pool_allocator
        self.token_to_kv_pool = MHATokenToKVPool(
            self.max_total_num_tokens,
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            cfg.head_dim,
            to_torch_dtype(self.server_args.kv_cache_dtype),
            self.device,
            self.server_args.page_size,
        )

    def _draft_footprint(self, kv_dtype: torch.dtype) -> tuple[int, int]:
        """(KV bytes per token, weight bytes) of a STANDALONE draft model: it is loaded after
        this pool is sized and gets a pool of as many tokens, so both come out of the same
        --mem-fraction-static budget (they were allocated past it: a draft's KV as large as
        the target's went on top). Its weights are estimated from its shapes."""
        sa = self.server_args
        if sa.speculative_algorithm != "STANDALONE" or not sa.speculative_draft_model_path:
            return 0, 0
        path = resolve_model_path(sa.speculative_draft_model_path, "--speculative-draft-model-path")
        cfg = load_model_config(path, detect_load_format(path, sa.load_format))
        per_token = MHATokenToKVPool.bytes_per_token(
            cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, kv_dtype
        )
        return per_token, _param_count(cfg) * self.dtype.itemsize

    def _check_pool_fits(self, total: int, per_token: int, reserved: int) -> None:
        """Refuse at start a --max-total-tokens / --max-running-requests whose pool and request
        table cannot fit in the free memory: allocated lazily, they were an out-of-memory kill
        minutes later (the profiled default always fits)."""
        row_bytes = (self.context_len + 8) * 4  # ReqToTokenPool: int32, in host memory
        table = (self.max_running_requests + 1) * row_bytes
        kv = total * per_token + reserved
        host = _mem_available_bytes() // self.local_ranks  # this rank's share
        if self.device == "cuda":
            device_free, _ = torch.cuda.mem_get_info()
            checks = [(kv, device_free, "GPU "), (table, host, "")]
        else:
            checks = [(kv + table, host, "")]
        shared = (
            f" (a share for each of {self.local_ranks} TP ranks)" if self.local_ranks > 1 else ""
        )
        for need, free, where in checks:
            if need > free:
                fit_tokens = max(0, (free - reserved - (0 if where else table)) // per_token)
                raise ValueError(
                    f"--max-total-tokens {total} and --max-running-requests "
                    f"{self.max_running_requests} need {need / 2**30:.1f} GiB for the KV cache "
                    f"and request table, but only {free / 2**30:.1f} GiB of {where}memory is "
                    f"free{'' if where else shared} (about {fit_tokens} tokens of KV fit beside "
                    "the table); ask for less"
                )

    def _profile_max_num_tokens(self, per_token: int, reserved: int = 0) -> int:
        """KV slots in --mem-fraction-static of the free memory, less `reserved` bytes. On a
        CPU the TP ranks of this machine share its memory, and so the fraction (each took all
        of it: --tp-size 4 asked for 80% of the free memory at the default 0.2)."""
        fraction = self.server_args.mem_fraction_static or 0.2
        if self.device == "cuda":
            free, _ = torch.cuda.mem_get_info()
        else:
            free = _mem_available_bytes() // self.local_ranks
        return max(1024, (int(free * fraction) - reserved) // per_token)

    # -- forward --------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> LogitsOutput:
        if (
            self.cuda_graph_runner is not None
            and not fb.uses_lora
            and self.cuda_graph_runner.can_run(fb)
        ):
            return LogitsOutput(self.cuda_graph_runner.replay(fb))
        hidden = self.forward_hidden(fb)
        last = hidden if fb.forward_mode.is_decode() else hidden[fb.last_token_indices()]
        logits = self.model.compute_logits(last).float()
        input_logprobs = None
        if fb.input_logprob_indices is not None:
            input_logprobs = self._input_logprobs(hidden, fb)
        return LogitsOutput(logits, input_logprobs)

    def _input_logprobs(self, hidden: torch.Tensor, fb: ForwardBatch) -> InputLogprobs:
        """Prompt logprobs at fb.input_logprob_indices, in blocks of rows so a long prompt
        never holds [tokens, vocab] logits at once."""
        assert fb.input_logprob_targets is not None
        idx, targets, k = fb.input_logprob_indices, fb.input_logprob_targets, fb.top_logprobs_num
        vals, tops_v, tops_i = [], [], []
        for lo in range(0, len(idx), INPUT_LOGPROB_BLOCK):
            rows = idx[lo : lo + INPUT_LOGPROB_BLOCK]
            lp = torch.log_softmax(self.model.compute_logits(hidden[rows]).float(), dim=-1)
            vals.append(lp.gather(1, targets[lo : lo + INPUT_LOGPROB_BLOCK].view(-1, 1)).view(-1))
            if k > 0:
                v, i = lp.topk(k, dim=-1)
                tops_v.append(v)
                tops_i.append(i)
        top = (torch.cat(tops_v), torch.cat(tops_i)) if k > 0 else None
        return InputLogprobs(torch.cat(vals), top)

    @torch.inference_mode()
    def forward_hidden(self, fb: ForwardBatch) -> torch.Tensor:
        """The final hidden state of every packed token ([T, hidden]); writes the step's KV."""
        fb.req_to_token_pool = self.req_to_token_pool
        fb.token_to_kv_pool = self.token_to_kv_pool
        fb.attn_backend = self.attn_backend
        self.attn_backend.init_forward_metadata(fb)
        if self.lora_manager is None:
            return self.model(fb)
        fb.lora = self.lora_manager.prepare(fb)
        return self.lora_manager.run(fb.lora, lambda: self.model(fb))

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
    ) -> SampleOutput:
        return self.sampler(logits, info, return_logprob, top_logprobs_num)


def create_attention_backend(name: str, device: str) -> AttentionBackend:
    """`--attention-backend`: auto is cpu_paged on CPU (torch_native, with a warning, where its
    kernel cannot be built) and torch_native elsewhere."""
    if name == "auto" and device != "cpu":
        name = "torch_native"
    if name in ("auto", "cpu_paged"):
        from radixserve.layers.attention.cpu_paged_backend import CpuPagedAttnBackend
        from radixserve.layers.cpu_kernels import KernelBuildError

        try:
            return CpuPagedAttnBackend(device)
        except KernelBuildError as exc:
            if name == "cpu_paged":
                raise
            logger.warning("attention backend: torch_native, since %s", exc)
    return TorchNativeAttnBackend(device)


def _param_count(cfg: ModelConfig) -> int:
    """A model's parameters, from its shapes (embeddings, attention, MLP; norms are noise)."""
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    q = cfg.num_attention_heads * cfg.head_dim
    layer = h * (2 * q + 2 * kv) + 3 * h * cfg.intermediate_size
    return (
        cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2) + cfg.num_hidden_layers * layer
    )


def _mem_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
