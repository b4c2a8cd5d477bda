"""`python -m radixserve bench perplexity`: mean token log-likelihood of a fixed text.

The quality check for `--quantization` (and any other change to the model path): the text is
cut into windows of `--window` tokens, each window is prefilled through ModelRunner like a
request (same attention backend, same KV pool, same quantized layers), and the negative
log-likelihood of every token after the first is averaged. Run it once per configuration and
compare the perplexities (exp of the mean NLL).

The default text is Python's own reference documentation (`pydoc_data.topics`, topics in
sorted order), which ships with every Python, so the number is reproducible on a given Python
version without downloading anything; `--text-file` scores any other text.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from radixserve.args import ServerArgs
from radixserve.bench import OUTPUT_FILE, int_at_least, kv_pool_tokens
from radixserve.bench.metrics import json_line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve bench perplexity", description=__doc__)
    p.add_argument("--text-file", default=None, help="Score this UTF-8 file instead.")
    p.add_argument(
        "--window", type=int_at_least(2), default=512, help="Tokens per prefilled window."
    )
    p.add_argument(
        "--max-tokens", type=int_at_least(2), default=4096, help="Tokens of the text to score."
    )
    p.add_argument(
        "--output-file", type=OUTPUT_FILE, default=None, help="Append the result as one JSON line."
    )
    ServerArgs.add_cli_args(p)
    return p


def default_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def score(runner, token_ids: list[int], window: int) -> tuple[float, int]:
    """(sum of NLL, number of scored tokens) of `token_ids`, window by window."""
    total, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        ids = token_ids[start : start + window]
        if len(ids) < 2:
            break
        hidden = runner.prefill_hidden(ids)
        with torch.inference_mode():
            logits = runner.model.compute_logits(hidden[:-1]).float()
            target = torch.tensor(ids[1:], device=logits.device)
            nll = torch.nn.functional.cross_entropy(logits, target, reduction="sum")
        total += float(nll)
        count += len(ids) - 1
    return total, count


def main(argv: list[str] | None = None) -> dict:
    ns = build_parser().parse_args(argv)
    import dataclasses

    from radixserve.managers.tokenizer_utils import load_tokenizer_for
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.model_loader.loader import check_model_files
    from radixserve.utils import configure_logging

    configure_logging(ns.log_level)
    if ns.window < 2:
        raise SystemExit("--window must be at least 2")
    args = ServerArgs.from_cli_args(ns)
    check_model_files(args)  # (a directory without config.json was a tokenizer error)
    need = kv_pool_tokens(1, ns.window + 8, args.page_size)  # one window, in whole pages
    if args.max_total_tokens is None or args.max_total_tokens < need:
        args = dataclasses.replace(args, max_total_tokens=need)
    if args.chunked_prefill_size is None or args.chunked_prefill_size < ns.window:
        args = dataclasses.replace(args, chunked_prefill_size=ns.window)
    if ns.text_file:
        with open(ns.text_file, encoding="utf-8") as f:
            text, source = f.read(), ns.text_file
    else:
        text, source = default_text(), "pydoc_data.topics"
    tokenizer = load_tokenizer_for(args)
    text = text[: ns.max_tokens * 16]  # plenty of characters for max_tokens tokens
    token_ids = tokenizer(text, add_special_tokens=False)["input_ids"][: ns.max_tokens]
    if len(token_ids) < 2:
        raise ValueError(f"{source} has {len(token_ids)} token(s); perplexity needs at least 2")
    runner = ModelRunner(args, tokenizer=tokenizer)
    if ns.window > runner.context_len:  # (past it: a RuntimeError deep in the KV pool)
        raise ValueError(
            f"--window {ns.window} exceeds the model's context length {runner.context_len}"
        )
    t0 = time.perf_counter()
    total, count = score(runner, token_ids, ns.window)
    mean = total / count
    result = {
        "text": source,
        "tokens": count,
        "window": ns.window,
        "dtype": runner.server_args.dtype,
        "quantization": args.quantization,
        "mean_nll": mean,
        "perplexity": math.inf if mean > 709 else math.exp(mean),  # (exp: OverflowError)
        "seconds": time.perf_counter() - t0,
    }
    print(
        f"text={source} tokens={count} window={ns.window} dtype={result['dtype']} "
        f"quantization={args.quantization}: mean NLL {mean:.4f}, "
        f"perplexity {result['perplexity']:.3f}"
    )
    if ns.output_file:  # a NaN NLL (a broken model) is null there
        with open(ns.output_file, "a") as f:
            f.write(json_line(result) + "\n")
    return result
