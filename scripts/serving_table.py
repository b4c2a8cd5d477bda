"""The markdown table of a side-by-side `bench serving` run (scripts/overlap.sh,
scripts/cuda_checks.sh): rows tagged LOOP-cCONCURRENCY-rROUND, medians over the rounds.
Usage: python scripts/serving_table.py SERVING_JSONL"""

import json
import statistics
import sys
from collections import defaultdict

rows = defaultdict(list)
with open(sys.argv[1]) as f:
    for line in f:
        d = json.loads(line)
        loop, c, _ = d["tag"].split("-")
        rows[(int(c[1:]), loop)].append(d)
print("| concurrency | loop | output tok/s | median TPOT ms | median ITL ms | mean TTFT ms | runs |")
print("|---:|---|---:|---:|---:|---:|---:|")
for (c, loop), ds in sorted(rows.items()):

    def med(key: str, ds: list = ds) -> float:
        return statistics.median(d[key] for d in ds)

    print(
        f"| {c} | {loop} | {med('output_throughput'):.1f} | {med('median_tpot_ms'):.1f} | "
        f"{med('median_itl_ms'):.1f} | {med('mean_ttft_ms'):.0f} | {len(ds)} |"
    )
