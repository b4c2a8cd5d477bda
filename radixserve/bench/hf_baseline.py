"""`python -m radixserve bench hf-baseline`: the Hugging Face transformers reference throughput.

Loads the model with transformers (a `.gguf` file through `gguf_file=`, or a HF directory), runs
the same `random` workload as `bench.serving` (same generator, seed and lengths) as static
batches of `--batch-size` prompts, left-padded, with greedy `generate` and
`min_new_tokens = max_new_tokens` (ignore_eos), and reports the same throughput figures plus the
mean per-batch latency. Each batch generates the longest output length it holds; only the
requested tokens of each row are counted. Torch uses one thread per physical core.

Example:
    python -m radixserve bench hf-baseline --num-prompts 32 --batch-size 32 \\
        --random-input-len 200 --random-output-len 128 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from typing import Any

from radixserve.bench import FRACTION, NON_NEGATIVE, OUTPUT_FILE, POSITIVE, datasets
from radixserve.bench.datasets import BenchRequest
from radixserve.bench.metrics import append_jsonl, print_metrics

WARMUP_NEW_TOKENS = 4


@dataclass(frozen=True)
class BatchResult:
    num_requests: int
    input_tokens: int
    output_tokens: int
    latency: float  # seconds for the whole `generate` call


def physical_cores() -> int:
    """Distinct (physical id, core id) pairs in /proc/cpuinfo; os.cpu_count() elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return os.cpu_count() or 1
    cores, physical = set(), "0"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "physical id":
            physical = value.strip()
        elif key.strip() == "core id":
            cores.add((physical, value.strip()))
    return len(cores) or os.cpu_count() or 1


def load_model(path: str, dtype: str, device: str) -> tuple[Any, Any]:
    """(model, tokenizer) from a HF directory or a GGUF file (dequantized by transformers); the
    tokenizer is the one radixserve's server loads, so both see the same prompts."""
    import torch
    from transformers import AutoModelForCausalLM

    directory, kwargs = datasets.model_source(path)
    tokenizer = datasets.load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype), **kwargs)
    return model.to(device).eval(), tokenizer


def left_pad(rows: list[list[int]], pad_id: int, device: str) -> tuple[Any, Any]:
    """(input_ids, attention_mask) with every row right-aligned, as decoder-only generate needs."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return ids.to(device), mask.to(device)


def _prompt_ids(tokenizer: Any, req: BenchRequest) -> list[int]:
    return req.prompt if isinstance(req.prompt, list) else tokenizer.encode(req.prompt)


def generate_batch(model: Any, tokenizer: Any, batch: list[BenchRequest], device: str) -> float:
    """Greedy-generate one static batch; returns its wall time in seconds."""
    import torch
    from transformers import GenerationConfig

    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    ids, mask = left_pad([_prompt_ids(tokenizer, r) for r in batch], pad_id, device)
    max_new = max(r.output_len for r in batch)
    config = GenerationConfig(
        max_new_tokens=max_new,
        min_new_tokens=max_new,  # ignore_eos: every row runs to the full length
        do_sample=False,
        pad_token_id=pad_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    latency = time.perf_counter() - start
    assert out.shape[1] - ids.shape[1] == max_new, "generate stopped before max_new_tokens"
    return latency


def run_batches(
    model: Any, tokenizer: Any, requests: list[BenchRequest], batch_size: int, device: str
) -> list[BatchResult]:
    results = []
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        latency = generate_batch(model, tokenizer, batch, device)
        results.append(
            BatchResult(
                num_requests=len(batch),
                input_tokens=sum(r.prompt_len for r in batch),
                output_tokens=sum(r.output_len for r in batch),
                latency=latency,
            )
        )
    return results


def summarize_batches(results: list[BatchResult]) -> dict[str, Any]:
    """Throughputs over the summed batch time (the batches run back to back)."""
    duration = sum(r.latency for r in results)
    total_input = sum(r.input_tokens for r in results)
    total_output = sum(r.output_tokens for r in results)
    completed = sum(r.num_requests for r in results)
    return {
        "duration": duration,
        "completed": completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration,
        "input_throughput": total_input / duration,
        "output_throughput": total_output / duration,
        "total_throughput": (total_input + total_output) / duration,
        "num_batches": len(results),
        "mean_batch_latency_ms": 1000.0 * duration / len(results),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m radixserve bench hf-baseline",
        description="Throughput of transformers' generate on the benchmark's random workload.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model-path", default=None, help="HF dir or .gguf; default: default model.")
    p.add_argument("--num-prompts", type=POSITIVE, default=32)
    p.add_argument("--random-input-len", type=POSITIVE, default=200)
    p.add_argument("--random-output-len", type=POSITIVE, default=128)
    p.add_argument("--random-range-ratio", type=FRACTION, default=1.0)
    p.add_argument("--batch-size", type=POSITIVE, default=8, help="Prompts per static batch.")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--threads", type=POSITIVE, default=None, help="Default: physical cores.")
    p.add_argument("--seed", type=NON_NEGATIVE, default=1)
    p.add_argument("--tokenize-prompt", action="store_true", help="Use token ids, not text.")
    p.add_argument("--warmup", type=NON_NEGATIVE, default=1, help="Untimed warmup batches.")
    p.add_argument(
        "--output-file", type=OUTPUT_FILE, default=None, help="Append the result as a JSON line."
    )
    return p


def _resolve_model_path(path: str | None) -> str:
    if path is not None:
        return path
    from radixserve.model_loader.default_model import ensure_default_model

    return str(ensure_default_model())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """CLI body of the transformers baseline; returns the result dict."""
    args = build_parser().parse_args(argv)
    import torch

    threads = args.threads or physical_cores()
    torch.set_num_threads(threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model_path = _resolve_model_path(args.model_path)
    model, tokenizer = load_model(model_path, args.dtype, device)
    requests = datasets.sample_random_requests(
        tokenizer,
        args.num_prompts,
        args.random_input_len,
        args.random_output_len,
        args.random_range_ratio,
        seed=args.seed,
        return_text=not args.tokenize_prompt,
    )
    print(datasets.summarize(requests), flush=True)
    for _ in range(args.warmup):
        batch = requests[: args.batch_size]
        warm = [BenchRequest(r.prompt, r.prompt_len, WARMUP_NEW_TOKENS) for r in batch]
        generate_batch(model, tokenizer, warm, device)
    metrics = summarize_batches(run_batches(model, tokenizer, requests, args.batch_size, device))
    header = {
        "Model": model_path,
        "Dtype": args.dtype,
        "Device": device,
        "Torch threads": threads,
        "Batch size": args.batch_size,
    }
    print_metrics(metrics, header, title="HF Transformers Baseline")
    result = {**vars(args), "model_path": model_path, "device": device, "threads": threads}
    result.update(backend="hf-transformers", timestamp=time.time(), **metrics)
    if args.output_file:
        append_jsonl(args.output_file, result)
    return result
