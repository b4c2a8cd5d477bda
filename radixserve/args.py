"""ServerArgs: the one frozen configuration object.

The CLI is generated from the dataclass fields (their defaults and `help` metadata), and every
"auto" value is resolved while parsing (`ServerArgs.resolve`), never by mutating later.
Every component receives the resolved ServerArgs (or the fields it needs) in its constructor.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
from dataclasses import dataclass, field
from typing import Any

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# fp8 KV caches (SGLang's names): one byte per K/V element, no scales (e4m3 saturates at ±448,
# e5m2 at ±57344); the CPU kernels widen them to bf16 (exactly) or fp32 as they read them.
KV_CACHE_DTYPES = (*DTYPES, "fp8_e5m2", "fp8_e4m3")
ATTENTION_BACKENDS = ("auto", "torch_native", "cpu_paged")
DEVICES = ("auto", "cpu", "cuda")
SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random", "priority", "routing-key")
EVICTION_POLICIES = ("lru", "lfu", "fifo", "mru", "filo", "priority", "slru")
GRAMMAR_BACKENDS = ("xgrammar", "none")
# The parser package's registries (radixserve.parser) hold the same names; a test checks it.
TOOL_CALL_PARSERS = ("hermes", "qwen25", "qwen", "llama3", "pythonic")
REASONING_PARSERS = ("deepseek-r1", "qwen3", "qwen3-thinking")
SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE")
HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
HICACHE_STORAGE_BACKENDS = ("file",)
DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("mooncake", "fake")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOAD_BALANCE_METHODS = ("prefix_affinity", "round_robin", "shortest_queue")
MAX_THREADS_PER_CPU = 8  # --num-threads past this many per CPU is a typo, not a setting
# Extra option strings of a field's flag (SGLang's short forms and full names).
CLI_ALIASES = {
    "tp_size": ("--tp", "--tensor-parallel-size"),
    "dp_size": ("--dp", "--data-parallel-size"),
}


def _f(default: Any, help: str, choices: tuple | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class ServerArgs:
    # Model and tokenizer
    model_path: str | None = _f(
        None, "Path to a Hugging Face directory or a .gguf file. Default: SmolLM2-135M-Instruct."
    )
    tokenizer_path: str | None = _f(None, "Tokenizer path (default: the model path).")
    load_format: str = _f("auto", "Weight format.", LOAD_FORMATS)
    dtype: str = _f(
        "auto", "Model dtype; auto = bf16 on CUDA and on CPUs with AVX512-BF16/AMX.", DTYPES
    )
    kv_cache_dtype: str = _f(
        "auto",
        "KV cache dtype; auto = the model dtype. fp8_e4m3 / fp8_e5m2: one byte per element, "
        "no scales (half a bf16 cache; perplexity +1% / +5% on the default model, "
        "docs/performance.md).",
        KV_CACHE_DTYPES,
    )
    device: str = _f("auto", "Device; auto = cuda when available, else cpu.", DEVICES)
    context_length: int | None = _f(
        None,
        "Maximum context length (default: from the model); past the model's own positions "
        "only with RADIXSERVE_ALLOW_LONGER_CONTEXT=1.",
    )
    served_model_name: str | None = _f(None, "Model name reported by the API.")
    trust_remote_code: bool = _f(False, "Allow custom code in tokenizer/config.")
    # Memory and scheduling
    max_total_tokens: int | None = _f(None, "KV pool size in tokens (default: from free memory).")
    mem_fraction_static: float | None = _f(
        None, "Fraction of free memory for the KV pool (default 0.85 GPU, 0.2 CPU)."
    )
    max_running_requests: int | None = _f(None, "Maximum concurrently running requests.")
    max_prefill_tokens: int = _f(16384, "Maximum tokens in one prefill batch.")
    chunked_prefill_size: int | None = _f(
        None, "Chunk size for long prompts; -1 disables (default 8192 GPU, 512 CPU)."
    )
    page_size: int = _f(1, "Tokens per KV page.")
    schedule_policy: str = _f("fcfs", "Order of the waiting queue.", SCHEDULE_POLICIES)
    schedule_conservativeness: float = _f(1.0, "Larger reserves more KV for running requests.")
    radix_eviction_policy: str = _f("lru", "Radix cache eviction policy.", EVICTION_POLICIES)
    disable_radix_cache: bool = _f(False, "Disable prefix caching.")
    enable_mixed_chunk: bool = _f(False, "Run decode requests inside prefill batches.")
    disable_overlap_schedule: bool = _f(
        False,
        "Run each step's forward and its result processing one after the other (the normal "
        "loop) instead of overlapping the forward with the previous step's processing (the "
        "default on CUDA, and on CPU with two CPUs per --num-threads thread).",
    )
    enable_integrity_checks: bool = _f(False, "Check cache/pool integrity after every step.")
    random_seed: int = _f(0, "Seed for weights of the dummy format and for sampling.")
    num_threads: int | None = _f(
        None, "Torch threads on CPU per scheduler rank (default: physical cores / TP ranks)."
    )
    # Tensor parallelism (SGLang's flags)
    tp_size: int = _f(
        1,
        "Tensor parallelism (alias --tp): scheduler ranks that split the attention heads, the "
        "MLP and the vocabulary; torch.distributed over gloo on CPU, nccl on CUDA.",
    )
    dist_init_addr: str | None = _f(
        None,
        "host:port of the TP ranks' rendezvous (default with --tp-size > 1: a free loopback "
        "port; required with --nnodes > 1).",
    )
    nnodes: int = _f(
        1,
        "Machines the TP ranks span: each runs --tp-size / --nnodes ranks; node 0 serves HTTP, "
        "the others only run their schedulers.",
    )
    node_rank: int = _f(0, "This machine's index, 0 .. --nnodes - 1.")
    # Data parallelism (SGLang's flags)
    dp_size: int = _f(
        1,
        "Data parallelism (alias --dp): scheduler replicas, each with its own model, KV pool "
        "and radix cache, behind one HTTP server; on CPU each gets its share of the cores, on "
        "CUDA its own GPU.",
    )
    load_balance_method: str = _f(
        "prefix_affinity",
        "How --dp-size replicas share requests: prefix_affinity (to the replica that holds "
        "the longest part of the prompt, else the least-filled cache; the least loaded when "
        "the loads drift apart), round_robin, shortest_queue (fewest requests in flight).",
        LOAD_BALANCE_METHODS,
    )
    # Prefill/decode disaggregation (SGLang's flags)
    disaggregation_mode: str = _f(
        "null",
        "prefill: compute prompts and send their KV and first token to a decode server; "
        "decode: take requests whose KV a prefill server sends; null: both in one server. "
        "A P/D pair is driven by SGLang's router (--pd-disaggregation), which sends each "
        "request to both with a bootstrap room.",
        DISAGGREGATION_MODES,
    )
    disaggregation_bootstrap_port: int = _f(
        8998, "Prefill: the port of its bootstrap server (decode servers connect to it)."
    )
    disaggregation_transfer_backend: str = _f(
        "mooncake",
        "How KV bytes move: mooncake (Mooncake's transfer engine; TCP without RDMA) or fake "
        "(the bytes ride on the control channel; no extra package, for tests).",
        TRANSFER_BACKENDS,
    )
    disaggregation_timeout: float = _f(
        60.0,
        "Seconds a request may wait for its peer (pairing, then the KV) before it fails on "
        "both sides with an error.",
    )
    # Features
    grammar_backend: str = _f("xgrammar", "Structured output backend.", GRAMMAR_BACKENDS)
    chat_template: str | None = _f(
        None,
        "The chat template that replaces the tokenizer's own: a Jinja file, a name (chatml, "
        "qwen, llama-3-instruct, llama-2-chat, mistral), or an inline Jinja template.",
    )
    sampling_defaults: str = _f(
        "model",
        "Sampling fields an OpenAI request leaves unset (temperature, top_p, top_k, min_p, "
        "repetition_penalty): model = the model's recommended values from its "
        "generation_config.json, where it has one (SGLang's and vLLM's default); openai = "
        "OpenAI's (temperature 1, no top-k/top-p). The native /generate keeps its own.",
        ("model", "openai"),
    )
    tool_call_parser: str | None = _f(
        None,
        "How the model writes tool calls, to turn them into tool_calls with tool_choice auto: "
        'hermes / qwen25 / qwen (<tool_call>{"name": ..., "arguments": ...}</tool_call>), '
        "llama3 (JSON objects, after <|python_tag|> or at the start, ';'-separated), pythonic "
        "([f(a=1)]). Without it tool_choice auto answers in plain text; required and named "
        "tool_choice work either way (the grammar enforces a JSON array of calls).",
        TOOL_CALL_PARSERS,
    )
    reasoning_parser: str | None = _f(
        None,
        "Split <think>...</think> into reasoning_content: deepseek-r1 / qwen3-thinking (the "
        "output starts inside the reasoning) or qwen3 (when the output opens <think>).",
        REASONING_PARSERS,
    )
    attention_backend: str = _f(
        "auto",
        "Attention backend: torch_native (portable, the reference) or cpu_paged (decode reads "
        "the paged KV pool in place with a C++ kernel built on first use, and the layers' "
        "RMSNorm, rotary and SiLU·mul run fused C++ kernels; CPU only); auto = cpu_paged on "
        "CPU where the kernels build, else torch_native.",
        ATTENTION_BACKENDS,
    )
    disable_cpu_decode_step: bool = _f(
        False,
        "Run CPU decode steps layer by layer in Python instead of in one C++ call (the "
        "cpu_paged backend's captured step; it gives the same tokens, faster).",
    )
    disable_cuda_graph: bool = _f(
        False,
        "Run CUDA decode steps eagerly instead of replaying the CUDA graphs captured at "
        "start-up (one per batch-size bucket and KV-length bucket).",
    )
    cuda_graph_max_bs: int | None = _f(
        None,
        "Largest decode batch replayed from a CUDA graph (larger ones run eagerly); default "
        "min(128, --max-running-requests).",
    )
    quantization: str | None = _f(
        None,
        "Quantized linear layers, CPU only: weight-only int8 (groups of 32) or int4 (groups of "
        "32; GGUF Q4_0/Q4_1 codes are kept), both with the output head in int8; or w8a8_int8 "
        "(int8 weights with a scale per output channel, activations quantized per token, "
        "integer GEMMs; the output head unquantized).",
        ("int8", "int4", "w8a8_int8"),
    )
    # LoRA adapters (SGLang's flags)
    enable_lora: bool = _f(
        False,
        "Serve LoRA adapters (implied by --lora-paths); without paths, load them into the "
        "running server through /load_lora_adapter.",
    )
    lora_paths: tuple[str, ...] = _f(
        (),
        "LoRA adapters to serve over the base model (PEFT directories): name=path, or a path "
        "that is its own name. A request picks one by name: `lora_path` (/generate and the "
        "OpenAI endpoints), or the OpenAI `model` as `name` or `<served-model-name>:name`.",
    )
    max_loras_per_batch: int = _f(
        8, "Most distinct LoRA adapters in one batch (requests without one do not count)."
    )
    max_lora_rank: int | None = _f(None, "Refuse LoRA adapters of a higher rank (default: any).")
    # Speculative decoding (SGLang's flags)
    speculative_algorithm: str | None = _f(
        None,
        "Speculative decoding: NGRAM (drafts looked up in the request's own prompt and output) "
        "or STANDALONE (a small draft model, --speculative-draft-model-path).",
        SPECULATIVE_ALGORITHMS,
    )
    speculative_draft_model_path: str | None = _f(
        None, "STANDALONE: the draft model (it must use the target's tokenizer)."
    )
    speculative_num_steps: int | None = _f(
        None, "STANDALONE: draft tokens proposed per step (default 4)."
    )
    speculative_eagle_topk: int | None = _f(
        None, "Branches per draft step; STANDALONE drafts a chain (1), NGRAM sets its own."
    )
    speculative_num_draft_tokens: int | None = _f(
        None,
        "Tokens each request verifies per step, its last token included (default: NGRAM 8, "
        "STANDALONE num_steps + 1).",
    )
    speculative_ngram_min_match_window_size: int = _f(
        1, "NGRAM: shortest suffix of the text that must recur to propose its continuation."
    )
    speculative_ngram_max_match_window_size: int = _f(
        12, "NGRAM: longest suffix compared (longer matches rank first)."
    )
    speculative_ngram_max_bfs_breadth: int = _f(
        4, "NGRAM: continuations merged into one verify tree."
    )
    speculative_ngram_branch_length: int = _f(
        18, "NGRAM: tokens taken after each match (the tree is then cut to num_draft_tokens)."
    )
    speculative_disable_adaptive: bool = _f(
        False,
        "Always speculate. By default a step falls back to plain decode where the measured cost "
        "of verifying exceeds what the requests' acceptance history says it saves.",
    )
    # Hierarchical KV cache (HiCache; SGLang's flags): see docs/hicache.md
    enable_hierarchical_cache: bool = _f(
        False,
        "Keep KV evicted from the device pool in a host-memory tier (and, with "
        "--hicache-storage-backend, on disk) and load it back when a prefix is reused.",
    )
    hicache_ratio: float = _f(2.0, "Host tier size as a multiple of the device KV pool.")
    hicache_size: float = _f(0.0, "Host tier size in GB; overrides --hicache-ratio when > 0.")
    hicache_write_policy: str = _f(
        "write_through",
        "When a device node gets its host copy: write_through (on insert), "
        "write_through_selective (once hit twice), write_back (when evicted from the device).",
        HICACHE_WRITE_POLICIES,
    )
    hicache_storage_backend: str | None = _f(
        None,
        "Storage tier under the host tier: file (KV blocks on local disk, keyed by the "
        "prefix's chain hash, so they survive restarts).",
        HICACHE_STORAGE_BACKENDS,
    )
    hicache_storage_dir: str = _f(
        "~/.cache/radixserve/hicache", "Directory of the file storage tier."
    )
    hicache_storage_block_size: int = _f(
        64,
        "Tokens per storage block (a multiple of --page-size; the default is rounded up to "
        "whole pages); the key is per block.",
    )
    # Serving
    host: str = _f("127.0.0.1", "HTTP host.")
    port: int = _f(30000, "HTTP port.")
    api_key: str | None = _f(None, "Require this key as a Bearer token.")
    disable_dashboard: bool = _f(
        False, "Turn off the live dashboard (GET /dashboard and its /dashboard/events stream)."
    )
    enable_metrics: bool = _f(
        True,
        "Accepted as in SGLang's launch commands; GET /metrics (Prometheus, SGLang's names) "
        "is always on.",
    )
    stream_interval: int = _f(1, "Stream every N tokens.")
    max_queued_requests: int | None = _f(
        None,
        "New requests allowed to wait for admission (beyond --max-running-requests, or for "
        "KV cache room); past it the latest get HTTP 503 with Retry-After at once (default: "
        "no bound).",
    )
    log_level: str = _f("info", "Logging level.")
    watchdog_timeout: float = _f(300.0, "Seconds a child may stay silent before the server exits.")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value is not None and value not in choices:
                raise ValueError(f"--{_flag(f.name)} must be one of {choices}, got {value!r}")
        self._check_numbers()
        if self.log_level.upper() not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {LOG_LEVELS} (any case)")
        for name in ("api_key", "served_model_name"):
            value = getattr(self, name)
            if value is not None and not value.strip():  # (" ": no client could send it)
                raise ValueError(f"--{_flag(name)} is empty; leave it out for the default")
        if self.api_key is not None and self.api_key != self.api_key.strip():
            # (HTTP trims a header's value, and httpx or OpenAI's client refuse to send it)
            raise ValueError("--api-key starts or ends with whitespace, which no client can send")
        if self.api_key is not None and not all(" " <= c <= "~" for c in self.api_key):
            # (an HTTP header carries Latin-1 at most: httpx, OpenAI's client and browsers send
            # ASCII; every request was a 401)
            raise ValueError("--api-key must be printable ASCII, which any client can send")
        self._check_environment()
        if self.chat_template is not None:
            check_chat_template(self.chat_template)
        self._check_speculative()
        self._check_tensor_parallel()
        if self.dp_size < 1:
            raise ValueError(f"--dp-size must be >= 1, got {self.dp_size}")
        cpus = os.cpu_count() or 1
        if self.dp_size > MAX_THREADS_PER_CPU * cpus:  # (each replica is a process, with sockets)
            raise ValueError(
                f"--dp-size {self.dp_size} is more than {MAX_THREADS_PER_CPU} replicas per CPU "
                f"of this machine's {cpus}"
            )
        if self.dp_size > 1 and self.tp_size > 1:
            raise ValueError("--dp-size > 1 with --tp-size > 1 is not supported yet; use one")
        self._check_hierarchical_cache()
        self._check_disaggregation()
        self._check_lora()

    @staticmethod
    def _check_environment() -> None:
        """The RADIXSERVE_* variables the server reads (a bad one was read where it is used:
        every structured-output request a 500 with a traceback, the server up)."""
        grammar_timeout_s()

    def _check_numbers(self) -> None:
        """Every number a flag takes, in the range it means something (a value outside is
        refused here, at start, rather than read as "unset" or failing in a child process)."""
        at_least = {
            "page_size": 1,
            "max_total_tokens": 1,
            "max_running_requests": 1,
            "max_queued_requests": 0,
            "max_prefill_tokens": 1,
            "context_length": 1,
            "num_threads": 1,
            "cuda_graph_max_bs": 1,
            "stream_interval": 1,
            "random_seed": 0,
        }
        for name, low in at_least.items():
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"--{_flag(name)} must be >= {low}, got {value}")
        if self.random_seed >= 2**63:
            raise ValueError(f"--random-seed must be < 2**63, got {self.random_seed}")
        cpus = os.cpu_count() or 1
        if self.num_threads is not None and self.num_threads > MAX_THREADS_PER_CPU * cpus:
            # (OpenMP cannot start 100000 threads: the scheduler died of a segfault)
            raise ValueError(
                f"--num-threads {self.num_threads} is more than {MAX_THREADS_PER_CPU} per CPU "
                f"of this machine's {cpus}"
            )
        chunk = self.chunked_prefill_size
        if chunk is not None and chunk < 1 and chunk != -1:
            raise ValueError(f"--chunked-prefill-size must be >= 1, or -1 to disable, got {chunk}")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be a port (1-65535), got {self.port}")
        fraction = self.mem_fraction_static
        if fraction is not None and not 0 < fraction < 1:
            raise ValueError(f"--mem-fraction-static must be between 0 and 1, got {fraction}")
        # (a comparison with nan is false: each test below is written to refuse it)
        if not 0 <= self.schedule_conservativeness < math.inf:
            raise ValueError(
                "--schedule-conservativeness must be a finite number >= 0, got "
                f"{self.schedule_conservativeness}"
            )
        for name in ("watchdog_timeout", "disaggregation_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{_flag(name)} must be > 0 seconds, got {getattr(self, name)}")

    def _check_lora(self) -> None:
        if isinstance(self.lora_paths, str):  # Engine(lora_paths="dir")
            object.__setattr__(self, "lora_paths", (self.lora_paths,))
        elif not isinstance(self.lora_paths, tuple):
            object.__setattr__(self, "lora_paths", tuple(self.lora_paths or ()))
        if self.max_loras_per_batch < 1:
            raise ValueError("--max-loras-per-batch must be >= 1")
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError("--max-lora-rank must be >= 1")
        if not (self.lora_paths or self.enable_lora):
            return
        from radixserve.lora.adapter import LoRAError, check_adapter_config, parse_lora_paths

        try:  # (found by the scheduler, a bad config was a traceback after the model loaded)
            for name, path in parse_lora_paths(self.lora_paths).items():
                check_adapter_config(name, path, self.max_lora_rank)
        except LoRAError as e:
            raise ValueError(str(e)) from None

    def _check_hierarchical_cache(self) -> None:
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        storage_flags = [
            f"--{_flag(name)}"
            for name in ("hicache_storage_dir", "hicache_storage_block_size")
            if getattr(self, name) != defaults[name]
        ]
        if not (0 < self.hicache_ratio < math.inf and 0 <= self.hicache_size < math.inf):
            raise ValueError("--hicache-ratio must be > 0 and --hicache-size >= 0")
        if not self.enable_hierarchical_cache:
            if self.hicache_storage_backend is not None:
                raise ValueError("--hicache-storage-backend needs --enable-hierarchical-cache")
            if storage_flags:  # (they were ignored: no KV was ever written where they said)
                raise ValueError(
                    f"{', '.join(storage_flags)} configure the storage tier: they need "
                    "--enable-hierarchical-cache --hicache-storage-backend file"
                )
            return
        if self.hicache_storage_backend is None and storage_flags:
            raise ValueError(
                f"{', '.join(storage_flags)} configure the storage tier: add "
                "--hicache-storage-backend file"
            )
        if self.disable_radix_cache:
            raise ValueError(
                "--enable-hierarchical-cache extends the radix cache: drop --disable-radix-cache"
            )
        if self.hicache_size == 0 and self.hicache_ratio < 1:  # (found after the model loaded)
            raise ValueError(
                f"--hicache-ratio {self.hicache_ratio:g}: the host tier must hold at least the "
                "device KV pool (>= 1), or give --hicache-size"
            )
        block = self.hicache_storage_block_size
        if block == defaults["hicache_storage_block_size"] and block % self.page_size:
            block = -(-block // self.page_size) * self.page_size  # the default, in whole pages
            object.__setattr__(self, "hicache_storage_block_size", block)
        if block < 1 or block % self.page_size:
            raise ValueError(
                f"--hicache-storage-block-size {block} must be a positive multiple of "
                f"--page-size {self.page_size}"
            )
        if self.tp_size > 1:
            raise ValueError("--enable-hierarchical-cache with --tp-size > 1 is not supported yet")
        if self.speculative_draft_model_path:
            raise ValueError(
                "--enable-hierarchical-cache does not move the draft model's KV: drop "
                "--speculative-draft-model-path (NGRAM speculation works)"
            )
        if self.hicache_storage_backend == "file":
            self._check_hicache_storage_dir()

    def _check_hicache_storage_dir(self) -> None:
        """A directory, or one that can be made (found by the scheduler after the model
        loaded, a bad one was a raw OSError and a traceback; "" wrote into the working
        directory)."""
        import tempfile

        given = self.hicache_storage_dir
        if not given.strip():
            raise ValueError("--hicache-storage-dir is empty: give a directory")
        path = os.path.abspath(os.path.expanduser(given))
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"--hicache-storage-dir {given!r} is not a directory")
        parent = path
        while not os.path.exists(parent):  # (the tier makes the missing ones)
            parent = os.path.dirname(parent)
        try:  # (a write, not os.access: that says yes to root, even on /proc)
            os.rmdir(tempfile.mkdtemp(dir=parent))
        except OSError as e:
            raise ValueError(
                f"--hicache-storage-dir {given!r}: cannot write in {parent!r} ({e.strerror})"
            ) from None

    def _check_disaggregation(self) -> None:
        mode = self.disaggregation_mode
        if not 0 < self.disaggregation_bootstrap_port < 65536:
            raise ValueError(
                f"--disaggregation-bootstrap-port must be a port, got "
                f"{self.disaggregation_bootstrap_port}"
            )
        if mode == "null":
            return
        if self.disaggregation_timeout <= 0:
            raise ValueError("--disaggregation-timeout must be positive")
        for flag, value in (
            ("--tp-size", self.tp_size),
            ("--dp-size", self.dp_size),
        ):
            if value > 1:
                raise ValueError(
                    f"--disaggregation-mode {mode} runs one scheduler rank; {flag} > 1 is not "
                    "supported with it"
                )
        if self.speculative_algorithm:
            raise ValueError(
                f"--disaggregation-mode {mode} does not support speculative decoding; drop "
                "--speculative-algorithm"
            )
        if self.enable_hierarchical_cache:
            raise ValueError(
                f"--disaggregation-mode {mode} with --enable-hierarchical-cache is not "
                "supported yet; drop one"
            )

    def _check_tensor_parallel(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"--tp-size must be >= 1, got {self.tp_size}")
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"--node-rank {self.node_rank} needs --nnodes > {max(self.node_rank, 0)} "
                f"(got --nnodes {self.nnodes}); node ranks run from 0 to --nnodes - 1"
            )
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr host:port (node 0's address)")
        if self.tp_size % self.nnodes != 0:
            raise ValueError(
                f"--tp-size {self.tp_size} must be divisible by --nnodes {self.nnodes} "
                "(the same number of ranks on every machine)"
            )
        if self.dist_init_addr is not None:
            _, port = parse_dist_init_addr(self.dist_init_addr)
            if self.tp_size > 1 and self.node_rank == 0 and port == self.port:
                # (node 0's rank 0 listens on it for the rendezvous: the HTTP server failed
                # with "address already in use" once every rank had loaded the model)
                raise ValueError(
                    f"--port {port} is --dist-init-addr's port too, and node 0 listens on "
                    "both; give them different ports"
                )

    def _check_tp_support(self, device: str) -> None:
        """What the TP ranks do not serve (yet): refused at start-up with the reason."""
        if self.tp_size == 1:
            return
        if self.quantization:
            raise ValueError(
                "--quantization is not supported with --tp-size > 1 (the quantized layers "
                "are not sharded); drop one of them"
            )
        if self.speculative_algorithm:
            raise ValueError(
                "speculative decoding is not supported with --tp-size > 1 (the draft and "
                "verify steps are not sharded); drop --speculative-algorithm"
            )
        if device == "cuda":
            import torch

            per_node = self.tp_size // self.nnodes
            if torch.cuda.device_count() < per_node:
                raise ValueError(
                    f"--tp-size {self.tp_size} over {self.nnodes} machine(s) needs {per_node} "
                    f"GPUs here, this machine has {torch.cuda.device_count()}"
                )

    def _check_speculative(self) -> None:
        algo = self.speculative_algorithm
        spec_flags = (
            self.speculative_draft_model_path,
            self.speculative_num_steps,
            self.speculative_eagle_topk,
            self.speculative_num_draft_tokens,
        )
        # (the NGRAM values have defaults, so they are checked with or without the algorithm:
        # one out of range was accepted, and ignored, without it)
        lo = self.speculative_ngram_min_match_window_size
        hi = self.speculative_ngram_max_match_window_size
        if lo < 1 or hi < lo:
            raise ValueError(
                "NGRAM match windows need 1 <= --speculative-ngram-min-match-window-size <= "
                "--speculative-ngram-max-match-window-size"
            )
        if self.speculative_ngram_max_bfs_breadth < 1 or self.speculative_ngram_branch_length < 1:
            raise ValueError("NGRAM breadth and branch length must be >= 1")
        if algo is None:
            if any(v is not None for v in spec_flags):
                raise ValueError("the --speculative-* options need --speculative-algorithm")
            return
        for name in ("speculative_num_steps", "speculative_eagle_topk"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{_flag(name)} must be >= 1")
        if self.speculative_num_draft_tokens is not None and self.speculative_num_draft_tokens < 2:
            raise ValueError("--speculative-num-draft-tokens must be >= 2 (the last token + 1)")
        if algo == "STANDALONE":
            if not self.speculative_draft_model_path:
                raise ValueError(
                    "--speculative-algorithm STANDALONE needs --speculative-draft-model-path"
                )
            if (self.speculative_eagle_topk or 1) != 1:
                raise ValueError("STANDALONE drafts one chain: --speculative-eagle-topk must be 1")
            if self.enable_mixed_chunk:  # (SGLang turns it off for its draft models too)
                raise ValueError(
                    "--enable-mixed-chunk does not run with STANDALONE: the draft model's KV of "
                    "the decoding requests mixed into a prefill would be left behind"
                )
            steps = self.speculative_num_steps or 4
            if (
                self.speculative_num_draft_tokens is not None
                and self.speculative_num_draft_tokens != steps + 1
            ):
                raise ValueError(
                    "STANDALONE with topk 1 verifies num_steps + 1 tokens: "
                    f"--speculative-num-draft-tokens must be {steps + 1}"
                )
        elif self.speculative_draft_model_path or self.speculative_num_steps is not None:
            raise ValueError(
                "NGRAM uses no draft model and no draft steps: drop "
                "--speculative-draft-model-path / --speculative-num-steps"
            )

    @property
    def speculative_verify_tokens(self) -> int:
        """Tokens each request verifies per step, its last committed token included."""
        if self.speculative_algorithm == "STANDALONE":
            return (self.speculative_num_steps or 4) + 1
        return self.speculative_num_draft_tokens or 8

    # -- resolution of "auto" values -------------------------------------------------------------
    def resolve(self) -> ServerArgs:
        """Return a copy with device, dtype and size defaults that depend on the machine filled in."""
        device = resolve_device(self.device)
        self._check_tp_support(device)
        if self.quantization and device != "cpu":
            raise ValueError(
                f"--quantization {self.quantization} runs on ATen's CPU kernels; on {device} "
                "serve the unquantized model"
            )
        if self.attention_backend == "cpu_paged" and device != "cpu":
            raise ValueError(f"--attention-backend cpu_paged runs on CPU only, not on {device}")
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():  # (found by the scheduler: a traceback at 30 s)
                build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
                raise ValueError(
                    f"--device cuda: no CUDA device is available to this torch ({build})"
                )
        dtype = resolve_dtype(self.dtype, device)
        kv_dtype = dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
        chunk = self.chunked_prefill_size
        if chunk is None:
            chunk = 8192 if device == "cuda" else 512
        fraction = self.mem_fraction_static
        if fraction is None:
            fraction = 0.85 if device == "cuda" else 0.2
        dist_init_addr = self.dist_init_addr or _default_dist_init_addr(self.tp_size)
        if dist_init_addr is not None:
            check_dist_init_host(dist_init_addr)
        return dataclasses.replace(
            self,
            device=device,
            dtype=dtype,
            kv_cache_dtype=kv_dtype,
            chunked_prefill_size=chunk,
            mem_fraction_static=fraction,
            dist_init_addr=dist_init_addr,
        )

    @property
    def local_tp_ranks(self) -> range:
        """The TP ranks this machine runs (all of them unless --nnodes > 1)."""
        per_node = self.tp_size // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    @property
    def chunked_prefill_enabled(self) -> bool:
        return self.chunked_prefill_size is not None and self.chunked_prefill_size > 0

    # -- CLI ------------------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(cls):
            flag = "--" + _flag(f.name)
            # (argparse formats help with %: a literal one is %%)
            help_text = f.metadata.get("help", "").replace("%", "%%")
            if f.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", default=f.default, help=help_text)
                continue
            if str(f.type).startswith("tuple"):  # a list of values (--lora-paths a b)
                parser.add_argument(flag, nargs="*", default=f.default, help=help_text)
                continue
            parser.add_argument(
                flag,
                *CLI_ALIASES.get(f.name, ()),
                type=_arg_type(f.type),
                default=f.default,
                choices=f.metadata.get("choices"),
                help=f"{help_text} (default: {str(f.default).replace('%', '%%')})",
            )

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ServerArgs:
        kwargs = {
            f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)
        }
        for f in dataclasses.fields(cls):
            if isinstance(kwargs.get(f.name), list):
                kwargs[f.name] = tuple(kwargs[f.name])
        return cls(**kwargs).resolve()


GRAMMAR_TIMEOUT_ENV = "RADIXSERVE_GRAMMAR_TIMEOUT"


def grammar_timeout_s() -> float:
    """Seconds a grammar may take to compile (SGLang's SGLANG_GRAMMAR_TIMEOUT): the value of
    RADIXSERVE_GRAMMAR_TIMEOUT, 60 where it is not set; ValueError unless a number > 0."""
    text = os.environ.get(GRAMMAR_TIMEOUT_ENV, "60")
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise ValueError(f"{GRAMMAR_TIMEOUT_ENV} must be a number of seconds > 0, got {text!r}")
    return seconds


def _flag(name: str) -> str:
    return name.replace("_", "-")


def parse_dist_init_addr(addr: str) -> tuple[str, int]:
    """(host, port) of --dist-init-addr host:port (an IPv6 host may be in brackets)."""
    host, sep, port = addr.rpartition(":")
    if (
        not sep
        or not host
        or not port.isdigit()
        or not 0 < int(port) < 65536
        or "://" in host  # (tcp://h:p: torch's "port number missing" after the model loaded)
        or any(c.isspace() for c in addr)
    ):
        raise ValueError(f"--dist-init-addr must be host:port (no scheme), got {addr!r}")
    return host.strip("[]"), int(port)


def check_dist_init_host(addr: str) -> None:
    """Refuse a --dist-init-addr whose host does not resolve: every rank, node 0's too, waited
    for the rendezvous (minutes) while torch logged name-resolution errors."""
    import socket

    host, port = parse_dist_init_addr(addr)
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ValueError(f"--dist-init-addr: host {host!r} does not resolve ({e})") from None


def dist_init_method(addr: str) -> str:
    """torch.distributed's init_method for --dist-init-addr: tcp://host:port, an IPv6 host in
    brackets (parse_dist_init_addr takes them off)."""
    host, port = parse_dist_init_addr(addr)
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _default_dist_init_addr(tp_size: int) -> str | None:
    """A free loopback port for the TP ranks' rendezvous (one rank needs none)."""
    if tp_size == 1:
        return None
    from radixserve.utils import free_port

    return f"127.0.0.1:{free_port()}"


def _arg_type(type_str: Any):
    text = str(type_str)
    if "int" in text:
        return int
    if "float" in text:
        return float
    return str


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> str:
    """/proc/cpuinfo, read once ("" where there is none): the int4/int8 layers ask
    cpu_has_bf16 on every prefill-sized product."""
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def cpu_has_bf16() -> bool:
    """True when the CPU has native bf16 matrix instructions (AVX512-BF16 or AMX)."""
    flags = _cpuinfo()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_has_amx() -> bool:
    """True when the CPU has AMX's bf16 tile unit (layers/linear.py's bf16 tiles then run on
    it, and oneDNN's GEMMs where they cannot)."""
    return "amx_bf16" in _cpuinfo()


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype != "auto":
        return dtype
    if device == "cuda":
        return "bfloat16"
    return "bfloat16" if cpu_has_bf16() else "float32"


def physical_core_count() -> int:
    """Physical cores (not hyper-threads) available to this process."""
    try:
        avail = len(os.sched_getaffinity(0))
    except AttributeError:
        avail = os.cpu_count() or 1
    cores = set()
    try:
        with open("/proc/cpuinfo") as f:
            phys = core = None
            for line in f:
                if line.startswith("physical id"):
                    phys = line.split(":")[1].strip()
                elif line.startswith("core id"):
                    core = line.split(":")[1].strip()
                    cores.add((phys, core))
    except OSError:
        pass
    return max(1, min(avail, len(cores) or avail))


def check_chat_template(value: str) -> None:
    """--chat-template: a file of UTF-8 Jinja, a template name, or an inline template, that
    compiles (checked at start: a broken one answered every chat request with a 400 that blamed
    the client, or crashed the start-up after the model had loaded)."""
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from radixserve.entrypoints.chat_templates import chat_template_source

    source = chat_template_source(value)
    try:  # as transformers compiles it to render (its environment and extensions)
        _compile_jinja_template(source)
    except TemplateSyntaxError as e:
        raise ValueError(
            f"--chat-template {value!r} is not a valid Jinja template: line {e.lineno}: {e.message}"
        ) from None
