"""`python -m radixserve bench offline`: Engine throughput on a dataset, no HTTP in the way.

All requests are submitted at once to the offline Engine (the same scheduler and processes as
the server); reports request, input, output and total throughput and the cached-token ratio.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from radixserve.args import ServerArgs
from radixserve.bench import NON_NEGATIVE, OUTPUT_FILE, datasets, json_object
from radixserve.bench.metrics import json_line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve bench offline", description=__doc__)
    datasets.add_dataset_args(p)
    p.set_defaults(num_prompts=64, random_input_len=256, random_output_len=128)
    p.add_argument("--seed", type=NON_NEGATIVE, default=1)
    p.add_argument("--disable-ignore-eos", action="store_true")
    p.add_argument(
        "--extra-sampling-params",
        type=json_object,
        default={},
        help="JSON object merged into each request's sampling params.",
    )
    p.add_argument(
        "--output-file",
        type=OUTPUT_FILE,
        default=None,
        help="Append one JSON line with the result.",
    )
    ServerArgs.add_cli_args(p)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ns = build_parser().parse_args(argv)
    from radixserve.entrypoints.engine import Engine
    from radixserve.managers.tokenizer_utils import load_tokenizer_for
    from radixserve.model_loader.loader import check_model_files
    from radixserve.utils import configure_logging

    configure_logging(ns.log_level)
    extra = ns.extra_sampling_params
    args = ServerArgs.from_cli_args(ns)
    check_model_files(args)
    ns.tokenize_prompt = True  # the Engine takes token ids
    # (before the model loads: a bad --dataset-path was found a minute into the run)
    reqs = datasets.build_dataset(ns, load_tokenizer_for(args))
    with Engine(args) as engine:
        params = [
            {
                "max_new_tokens": r.output_len,
                "temperature": 0.0,
                "ignore_eos": not ns.disable_ignore_eos,
                **extra,
            }
            for r in reqs
        ]
        engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4})  # warm-up
        engine.flush_cache()
        start = time.perf_counter()
        outs = engine.generate(input_ids=[list(r.prompt) for r in reqs], sampling_params=params)
        duration = time.perf_counter() - start
    n_in = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    n_out = sum(o["meta_info"]["completion_tokens"] for o in outs)
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    result = {
        "dataset": ns.dataset_name,
        "num_prompts": len(outs),
        "duration_s": duration,
        "request_throughput": len(outs) / duration,
        "input_throughput": n_in / duration,
        "output_throughput": n_out / duration,
        "total_throughput": (n_in + n_out) / duration,
        "cached_token_ratio": cached / max(n_in, 1),
    }
    for k, v in result.items():
        print(f"{k:>22}: {v:.3f}" if isinstance(v, float) else f"{k:>22}: {v}")
    if ns.output_file:
        with open(ns.output_file, "a") as f:
            f.write(json_line(result) + "\n")
    return result
