"""Multi-turn benchmark for the hierarchical cache (after SGLang's benchmark/hicache multi-turn).

`--num-clients` clients each hold a conversation of `--num-rounds` rounds. Round r's prompt is
the whole conversation so far (every earlier user turn and answer) plus a new user turn of
`--request-length` random tokens; the answer is `--output-length` tokens (EOS ignored). Every
conversation's round r is served (at most `--max-parallel` requests in flight) before any round
r + 1, so a conversation's prefix comes back after all the other clients have pushed it out of
the device pool.
With a small `--max-total-tokens` the conversations' total length is several times the pool.

One run serves the same workload on a fresh offline Engine per configuration — the plain radix
cache, then the same flags plus --enable-hierarchical-cache — and prints, for each, the
cached-token ratio (prompt tokens served from the cache / prompt tokens), TTFT (client side,
streaming) and the wall time. Usage:

    python -m radixserve bench multiturn --max-total-tokens 1280 --num-clients 8 --num-rounds 4 \
        --request-length 150 --output-length 8 --max-parallel 2 \
        --hicache-args '{"enable_hierarchical_cache": true, "hicache_ratio": 4}'
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from radixserve.bench import NON_NEGATIVE, OUTPUT_FILE, POSITIVE, json_object
from radixserve.bench.metrics import json_line, percentile


@dataclass
class RunResult:
    name: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    outputs: dict[str, list[int]] = field(default_factory=dict)
    server_info: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        t = sorted(self.ttft_s)
        return {
            "config": self.name,
            "requests": len(t),
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "cache_hit_ratio": round(self.cached_tokens / max(1, self.prompt_tokens), 4),
            "mean_ttft_ms": round(1000 * statistics.fmean(t), 1) if t else None,
            "p50_ttft_ms": round(1000 * percentile(t, 50), 1) if t else None,
            "p90_ttft_ms": round(1000 * percentile(t, 90), 1) if t else None,
            "wall_s": round(self.wall_s, 2),
            **{k: v for k, v in self.server_info.items() if k.startswith("hicache_")},
        }


def make_turns(args: argparse.Namespace, vocab_size: int) -> list[list[list[int]]]:
    """User turns: [client][round] → token ids (random, away from the special tokens)."""
    rng = random.Random(args.seed)
    lo, hi = 100, max(101, vocab_size - 100)
    return [
        [
            [rng.randrange(lo, hi) for _ in range(args.request_length)]
            for _ in range(args.num_rounds)
        ]
        for _ in range(args.num_clients)
    ]


def _one_request(engine: Any, prompt: list[int], params: dict[str, Any]) -> tuple[float, dict]:
    """(TTFT, final output) of one streamed request."""
    start = time.perf_counter()
    first, last = None, None
    for chunk in engine.generate(input_ids=prompt, sampling_params=params, stream=True):
        if first is None:
            first = time.perf_counter() - start
        last = chunk
    assert first is not None and last is not None
    return first, last


def run_config(name: str, engine_kwargs: dict[str, Any], args: argparse.Namespace) -> RunResult:
    """Round r of every conversation, then round r + 1 (at most --max-parallel in flight), so
    a conversation comes back after all the others have run."""
    from radixserve import Engine

    res = RunResult(name)
    params = {"max_new_tokens": args.output_length, "temperature": 0, "ignore_eos": True}
    with Engine(**engine_kwargs) as engine:
        turns = make_turns(args, engine.tokenizer_manager.vocab_size)
        warm = {"max_new_tokens": 2, "temperature": 0}
        engine.generate(input_ids=[101, 102, 103], sampling_params=warm)
        engine.flush_cache()
        history: list[list[int]] = [[] for _ in range(args.num_clients)]
        start = time.perf_counter()
        with ThreadPoolExecutor(args.max_parallel or args.num_clients) as pool:
            for r in range(args.num_rounds):
                prompts = [history[c] + turns[c][r] for c in range(args.num_clients)]
                done = pool.map(lambda p: _one_request(engine, p, params), prompts)
                for c, (prompt, (ttft, out)) in enumerate(zip(prompts, done, strict=True)):
                    res.ttft_s.append(ttft)
                    res.prompt_tokens += len(prompt)
                    res.cached_tokens += out["meta_info"]["cached_tokens"]
                    res.outputs[f"c{c}r{r}"] = list(out["output_ids"])
                    history[c] = prompt + list(out["output_ids"])
        res.wall_s = time.perf_counter() - start
        res.server_info = engine.get_server_info()
    return res


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m radixserve bench multiturn", description=__doc__)
    p.add_argument("--model-path", default=None, help="Default: SmolLM2-135M-Instruct.")
    p.add_argument("--max-total-tokens", type=POSITIVE, default=2048, help="The device KV pool.")
    p.add_argument("--num-clients", type=POSITIVE, default=8)
    p.add_argument("--num-rounds", type=POSITIVE, default=5)
    p.add_argument("--request-length", type=POSITIVE, default=200, help="Tokens per user turn.")
    p.add_argument("--output-length", type=POSITIVE, default=16, help="Tokens per answer.")
    p.add_argument("--seed", type=NON_NEGATIVE, default=1)
    p.add_argument(
        "--max-parallel", type=POSITIVE, default=None, help="Requests in flight (default: clients)."
    )
    p.add_argument("--repeats", type=POSITIVE, default=1, help="Runs of each config, alternating.")
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--hicache-args",
        type=json_object,
        default={"enable_hierarchical_cache": True},
        help="JSON of the ServerArgs the hierarchical run adds (e.g. a write policy, a ratio).",
    )
    p.add_argument("--only", choices=("radix", "hicache"), default=None, help="Run one config.")
    p.add_argument("--check-outputs", action="store_true", help="Greedy outputs must agree.")
    p.add_argument(
        "--output-file", type=OUTPUT_FILE, default=None, help="Append the results as JSON lines."
    )
    return p


def check_configs(parser: argparse.ArgumentParser, configs: dict[str, dict[str, Any]]) -> None:
    """Refuse (argparse's usage and one line, exit 2) a --hicache-args key that is no ServerArgs
    field, or a value ServerArgs rejects, before any run: the Engine would raise only after the
    runs before it."""
    from radixserve.args import ServerArgs

    fields = [f.name for f in dataclasses.fields(ServerArgs)]
    for name, kwargs in configs.items():
        for key in kwargs:
            if key not in fields:
                close = difflib.get_close_matches(key, fields, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                parser.error(f"--hicache-args: {key!r} is not a ServerArgs field{hint}")
        try:
            ServerArgs(**kwargs)
        except (ValueError, TypeError) as e:
            parser.error(f"the {name} config: {e}")


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    base = {"model_path": args.model_path, "max_total_tokens": args.max_total_tokens}
    base["dtype"] = args.dtype
    configs = {"radix": base, "hicache": {**base, **args.hicache_args}}
    check_configs(parser, configs)
    if args.only:
        configs = {args.only: configs[args.only]}
    final = args.num_rounds * (args.request_length + args.output_length)
    print(
        f"{args.num_clients} clients × {args.num_rounds} rounds; conversations total "
        f"{args.num_clients * final} tokens = {args.num_clients * final / args.max_total_tokens:.1f}"
        f"× the device pool ({args.max_total_tokens})",
        flush=True,
    )
    results = []
    for _ in range(args.repeats):  # alternate: a shared machine's load drifts during a run
        for name, kwargs in configs.items():
            res = run_config(name, kwargs, args)
            results.append(res)
            print(json_line(res.summary()), flush=True)
            if args.output_file:
                with open(args.output_file, "a") as f:
                    f.write(json_line({**res.summary(), "args": vars(args)}) + "\n")
    if args.check_outputs and len(results) >= 2:
        same = all(r.outputs == results[0].outputs for r in results)
        print(f"greedy outputs identical across runs: {same}")


if __name__ == "__main__":
    main()
