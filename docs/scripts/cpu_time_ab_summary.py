"""Median CPU ms per measurement and label over the interleaved rounds of a records.jsonl written by
``cpu_time_ab.py`` (labels ``before`` and ``after``), the ratio after / before, and whether the two sides' ranges over
the rounds overlap (within noise) -- printed as a Markdown table.

    python docs/scripts/cpu_time_ab_summary.py results/speed/guarantees-cost/typed-mask/records.jsonl
"""

import collections
import json
import statistics
import sys
from pathlib import Path


def main(path: str) -> None:
    records = [json.loads(line) for line in Path(path).read_text().splitlines()]
    times = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in records:
        times[r["what"]][r["label"]].append(r["cpu_ms"])
    rounds = len({r["round"] for r in records})
    print(f"| measurement ({rounds} interleaved rounds; CPU ms, median (min-max)) | before | after | after / before "
          "| ranges overlap |")
    print("|---|---|---|---|---|")
    for what, sides in times.items():
        b, a = sides["before"], sides["after"]
        overlap = min(a) <= max(b) and min(b) <= max(a)
        print(f"| {what} | {statistics.median(b):.2f} ({min(b):.1f}-{max(b):.1f}) | {statistics.median(a):.2f} "
              f"({min(a):.1f}-{max(a):.1f}) | {statistics.median(a) / statistics.median(b):.3f} | "
              f"{'yes' if overlap else 'no'} |")


if __name__ == "__main__":
    main(sys.argv[1])
