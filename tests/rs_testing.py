"""Test helpers: run the Scheduler in-process, compute transformers references."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import os
import sys
from typing import Any

import torch

from radixserve.args import ServerArgs
from radixserve.io_struct import TokenizedGenerateReqInput
from radixserve.managers.scheduler import Scheduler
from radixserve.sampling_params import SamplingParams

PARAGRAPH = (
    "The history of the city begins with a small settlement on the river, where traders met to "
    "exchange grain, salt and cloth. Over the centuries the market grew into a town, the town "
    "built walls, and the walls were later torn down to make room for wide avenues, parks and "
    "a railway station. Today the city is known for its museums, its universities and its "
    "bakeries, which open before dawn and sell bread that is still made by hand. Visitors often "
    "ask how the old quarter survived the fires of the eighteenth century; the answer lies in "
    "the stone that the builders carried from the hills to the north. "
)


def make_prompts(tokenizer: Any, lengths: list[int]) -> list[list[int]]:
    """Natural-text prompts cut to the given token lengths, each starting at a different word."""
    words = (PARAGRAPH * 8).split()
    prompts = []
    for i, n in enumerate(lengths):
        text = " ".join(words[(i * 7) % 50 :])
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) >= n
        prompts.append(ids[:n])
    return prompts


class SchedulerHarness:
    """A Scheduler driven step by step in this process; collects its outputs per rid."""

    def __init__(self, tokenizer: Any = None, **kwargs: Any) -> None:
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("enable_integrity_checks", True)
        self.args = ServerArgs(**kwargs).resolve()
        self.outputs: list[Any] = []
        self.scheduler = Scheduler(self.args, self.outputs.append, tokenizer)
        # The overlap loop even where this machine's CPUs would make it choose the normal one.
        self.scheduler.enable_overlap = not self.args.disable_overlap_schedule
        self._n = 0

    def submit(self, input_ids: list[int], rid: str | None = None, **params: Any) -> str:
        self._n += 1
        rid = rid or f"r{self._n}"
        sp = SamplingParams(**params)
        self.scheduler.process_input_requests(
            [TokenizedGenerateReqInput(rid, None, list(input_ids), sp)]
        )
        return rid

    def step(self) -> Any:
        return self.scheduler.step()

    def run_until_idle(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_work():
                return
            self.step()
        raise AssertionError("scheduler did not drain")

    def results(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for msg in self.outputs:
            for rid, ids in zip(msg.rids, msg.output_ids, strict=True):
                out.setdefault(rid, []).extend(ids)
        return out

    def finish_reasons(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for msg in self.outputs:
            for rid, reason in zip(msg.rids, msg.finished_reasons, strict=True):
                if reason is not None:
                    out[rid] = reason
        return out


@contextlib.contextmanager
def shared_model_loads() -> Any:
    """While open, a ModelRunner whose load_model call repeats an earlier one (same path,
    format, dtype, device, seed, context length, quantization; no TP) gets that call's model
    instead of building and loading it again: for modules that build many in-process
    Schedulers over one real model (seconds of dequantizing each). Sharing is sound because a
    forward pass keeps no state in the model: the attention backend, the KV pool and the rows
    are the runner's."""
    import pytest

    from radixserve.model_executor import model_runner

    load = model_runner.load_model
    loaded: dict[tuple, Any] = {}

    def load_once(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("tp") is not None:
            return load(*args, **kwargs)
        key = (args, tuple(sorted(kwargs.items())))
        if key not in loaded:
            loaded[key] = load(*args, **kwargs)
        return loaded[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model_runner, "load_model", load_once)
        yield


def hf_greedy(model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time (no padding), EOS ignored."""
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


def load_hf_reference(model_path: str) -> Any:
    """The transformers model of `model_path` (a HF directory or a .gguf), in eval mode; loaded
    once per process and shared, so callers must not modify it (transformers' GGUF conversion
    takes tens of seconds on two cores)."""
    return _load_hf_reference(os.path.abspath(model_path), _model_digest(model_path))


@functools.cache
def _load_hf_reference(model_path: str, digest: str) -> Any:
    import transformers

    if model_path.endswith(".gguf"):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=torch.float32
        )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return model.eval()


def _model_files(model_path: str) -> list[str]:
    if os.path.isfile(model_path):
        return [model_path]
    names = sorted(os.listdir(model_path))
    return [
        os.path.join(model_path, n) for n in names if n.endswith((".json", ".safetensors", ".bin"))
    ]


@functools.cache
def _digest_of_files(files: tuple[tuple[str, int, int], ...]) -> str:
    h = hashlib.sha256()
    for path, _, _ in files:
        h.update(os.path.basename(path).encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def _model_digest(model_path: str) -> str:
    """sha256 over the model's files (config, tokenizer, weights); hashed once per process per
    (path, size, mtime), so a model rewritten in place gets a new digest."""
    files = tuple((f, os.path.getsize(f), os.stat(f).st_mtime_ns) for f in _model_files(model_path))
    return _digest_of_files(files)


def _reference_cache_dir() -> str | None:
    """Where greedy references are kept between runs: RADIXSERVE_TEST_REF_CACHE, else
    ~/.cache/radixserve/test-refs; "0" or "off" turns the disk cache off."""
    path = os.environ.get("RADIXSERVE_TEST_REF_CACHE")
    if path in ("0", "off"):
        return None
    return path or os.path.join(os.path.expanduser("~"), ".cache", "radixserve", "test-refs")


def reference_greedy(
    model_path: str, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """`hf_greedy` of the transformers model at `model_path`, kept on disk under a key of
    everything that decides it: the model files' digest, the prompts, the token count, the
    versions of transformers and torch, and the source of `hf_greedy` and of the loader. A hit
    is the very output transformers gave for those inputs; a miss computes and stores it."""
    import transformers

    key_parts = {
        "model": _model_digest(model_path),
        "gguf": model_path.endswith(".gguf"),
        "prompts": prompts,
        "max_new_tokens": max_new_tokens,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "code": inspect.getsource(hf_greedy) + inspect.getsource(_load_hf_reference),
    }
    key = hashlib.sha256(json.dumps(key_parts, sort_keys=True).encode()).hexdigest()
    cache_dir = _reference_cache_dir()
    path = os.path.join(cache_dir, f"greedy-{key}.json") if cache_dir else None
    if path and os.path.isfile(path):
        with open(path) as f:
            return json.load(f)["outputs"]
    outputs = hf_greedy(load_hf_reference(model_path), prompts, max_new_tokens)
    if path:
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"outputs": outputs}, f)
        os.replace(tmp, path)  # atomic: a concurrent run never reads half a file
    return outputs


def prefill_batch(runner: Any, prompts: list[list[int]]) -> Any:
    """A ScheduleBatch of `prompts` on the ModelRunner's pools (a ChunkCache), prepared for
    its prefill."""
    from radixserve.managers.schedule_batch import Req, ScheduleBatch
    from radixserve.mem_cache.chunk_cache import ChunkCache

    pool, alloc = runner.req_to_token_pool, runner.token_to_kv_pool_allocator
    cache = ChunkCache(pool, alloc)
    reqs = [Req(f"r{i}", p, SamplingParams()) for i, p in enumerate(prompts)]
    for r in reqs:
        r.init_next_round_input(cache)
    batch = ScheduleBatch(reqs, pool, alloc, cache)
    batch.prepare_for_extend()
    return batch


def greedy_step_logits(
    runner: Any, prompts: list[list[int]], steps: int, loras: list[str | None] | None = None
) -> list[torch.Tensor]:
    """Logits of the prefill of `prompts` and of `steps` greedy decode steps, straight
    through the ModelRunner (each request with its LoRA adapter in `loras`, if given); every
    slot is freed after, and the pool checked whole."""
    batch = prefill_batch(runner, prompts)
    for r, lora in zip(batch.reqs, loras or [None] * len(prompts), strict=True):
        r.lora_id = lora
    out = []
    for step in range(steps + 1):
        if step:
            batch.prepare_for_decode()
        logits = runner.forward(batch.get_forward_batch(runner.device)).next_token_logits
        out.append(logits)
        for r, t in zip(batch.reqs, logits.argmax(-1).tolist(), strict=True):
            r.output_ids.append(t)
    for r in batch.reqs:
        batch.tree_cache.cache_finished_req(r)
    alloc = runner.token_to_kv_pool_allocator
    assert alloc.available_size() == runner.max_total_num_tokens
    return out


def make_tiny_model_dir(path: str, arch: str = "llama", seed: int = 0, **overrides: Any) -> str:
    """Save a small random transformers model of `arch` (llama | mistral | qwen2 | qwen3) to
    `path`; `overrides` are config fields (a variant: biases, RoPE parameters, ...)."""
    import transformers

    common = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "llama":
        cfg = transformers.LlamaConfig(**{**common, "rope_theta": 10000.0, **overrides})
        cls = transformers.LlamaForCausalLM
    elif arch == "mistral":
        cfg = transformers.MistralConfig(
            **{**common, "rope_theta": 1000000.0, "sliding_window": None, **overrides}
        )
        cls = transformers.MistralForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**{**common, "rope_theta": 1000000.0, **overrides})
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(
            **{**common, "head_dim": 32, "rope_theta": 1000000.0, **overrides}
        )
        cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():  # larger weights than the default init, so greedy paths differ
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    return path


# A byte-level tokenizer for the tiny models, so that a real server can serve them.
SPECIALS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _byte_alphabet() -> list[str]:
    """The byte-level BPE stand-ins of the 256 bytes in byte order (GPT-2's bytes_to_unicode:
    printable bytes stand for themselves, the others for 256 + their rank), so that every
    process gives byte b the same id (ByteLevel.alphabet() comes in a per-process set order:
    two tokenizers saved by two processes once differed)."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    out, shifted = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + shifted))
            shifted += 1
    return out


def save_byte_tokenizer(path: str, vocab_size: int) -> None:
    """A byte-level tokenizer with exactly `vocab_size` ids: the specials (ids 0-2 match the
    tiny model's bos/eos), the 256 bytes, then fillers that decode to plain text."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    tokens = SPECIALS + _byte_alphabet()
    tokens += [f"<x{i}>" for i in range(vocab_size - len(tokens))]
    tok = Tokenizer(BPE({t: i for i, t in enumerate(tokens)}, [], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def make_sentencepiece_tokenizer() -> Any:
    """A Llama-2-style tokenizer (SentencePiece BPE, ▁ for spaces, byte fallback: a character
    out of the vocabulary is its UTF-8 bytes as <0xXX> tokens; decoding strips the text's
    leading space), built here."""
    from tokenizers import Tokenizer, decoders, normalizers, trainers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(["abc ghi the quick brown fox"] * 20, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
    )


def file_storage_flags(directory: Any) -> dict[str, Any]:
    """The flags of a hierarchical cache with a file storage tier in `directory`, 32-token
    blocks."""
    return dict(
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(directory),
        hicache_storage_block_size=32,
    )


def make_tiny_served_model(path: str, context: int | None = None) -> str:
    """A tiny random Llama with a byte-level tokenizer and a chat template: a model directory
    that `python -m radixserve serve --model-path` and the Engine load in seconds. `context`
    sets max_position_embeddings (rotary room for requests that run long)."""
    make_tiny_model_dir(path, "llama")
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    save_byte_tokenizer(path, config["vocab_size"])
    if context is not None:
        config["max_position_embeddings"] = context
        with open(config_path, "w") as f:
            json.dump(config, f)
    return path


def sglang_router_command() -> list[str]:
    """The command that starts SGLang's router (the sglang-router dev extra). Skips the test
    when it is not installed, except where RADIXSERVE_REQUIRE_ROUTER=1 (CI) makes that fail."""
    import pytest

    try:
        import sglang_router  # noqa: F401
    except ImportError:
        if os.environ.get("RADIXSERVE_REQUIRE_ROUTER") == "1":
            pytest.fail("sglang-router is not installed (pip install -e '.[dev]')")
        pytest.skip("sglang-router is not installed (pip install sglang-router)")
    return [sys.executable, "-m", "sglang_router.launch_router"]


class SglangRouter:
    """SGLang's router (`python -m sglang_router.launch_router`) on a free port; `args` are its
    worker flags, e.g. `--worker-urls A B --policy cache_aware` or `--pd-disaggregation
    --prefill A 8998 --decode B`. `name` names its log file."""

    def __init__(self, log_dir: str, name: str, *args: str) -> None:
        self.log_path = os.path.join(log_dir, f"router-{name}.log")
        self.args = args
        self.starts = 0
        self._start()

    def _start(self) -> None:
        """Launch on two free ports (the router's, its metrics'). A port found free can be
        taken before the router binds it (another test's process, or a socket of a server
        just stopped); wait_ready then starts it again on new ports."""
        import subprocess

        from radixserve.utils import free_port

        self.starts += 1
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [*sglang_router_command(), *self.args]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warn"]
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-3000:]

    def wait_ready(self, timeout: float = 60.0) -> str:
        """The model id, once the router lists it (every worker registered)."""
        import time

        import httpx

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                busy = "Address already in use" in self.log()
                assert busy and self.starts < 3, self.log()
                self._start()  # a port was taken before the router bound it: new ports
                continue
            try:
                models = httpx.get(self.url + "/v1/models", timeout=5).json()
                if models.get("data"):
                    return models["data"][0]["id"]
            except (httpx.HTTPError, ValueError):
                pass
            assert time.monotonic() < deadline, self.log()
            time.sleep(0.3)

    def stop(self) -> None:
        import subprocess

        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
