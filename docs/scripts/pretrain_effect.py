"""The main paper's Table 8 analogue (issue #34): fine-tuned from a masked-LM checkpoint against from scratch.

Reads the fine-tuning grids' records (each run's ``metrics.json``, committed under ``results/compare``) and
prints, per task and mechanism, the score (accuracy; WikiQA: MAP) of each starting point over the seeds, and the
paired differences that decide the claim: pretrained minus scratch with the task's own tokenizer (as every other
grid trains), and pretrained minus scratch with the pretraining's vocabulary (``train --tokenizer-from``: the same
ids, fresh weights -- what the pretrained weights themselves add). p: the exact two-sided sign-flip test over
the seeds (0.25 is its floor with 3 seeds).

    python docs/scripts/pretrain_effect.py results/compare/table8-sentence results/compare/table8-wikiqa ...
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from clusterformer.apps.compare import sign_flip_p_value

STARTS = {"scratch": "{m}", "scratch, MLM vocabulary": "{m}-mlm-vocab", "pretrained": "{m}-pretrained"}


def scores(grids: list[Path]) -> dict[tuple[str, str], dict[int, float]]:
    """{(task, label): {seed: score}} over every finished run of the grids."""
    found: dict[tuple[str, str], dict[int, float]] = {}
    for grid in grids:
        for record in sorted(grid.glob("*/*/seed*/metrics.json")):
            data = json.loads(record.read_text())
            metrics = data["metrics"]
            score = metrics.get("map", metrics.get("accuracy"))  # WikiQA ranks answers: its score is MAP
            task, label, seed = record.parts[-4], record.parts[-3], int(record.parts[-2].removeprefix("seed"))
            found.setdefault((task, label), {})[seed] = float(score)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grids", nargs="+", type=Path, help="compare output directories")
    parser.add_argument("--mechanisms", default="full,neural-clustering")
    args = parser.parse_args()
    found = scores(args.grids)
    tasks = sorted({task for task, _ in found} - {"mlm"})  # the pretraining runs themselves, if a grid holds them
    bases = [start for start in STARTS if start != "pretrained"]
    print("| task | mechanism | " + " | ".join(STARTS) + " | "
          + " | ".join(f"pretrained - {base} (p, pairs)" for base in bases) + " |")
    print("|---|---|" + "---|" * (len(STARTS) + len(bases)))
    for task in tasks:
        for mechanism in args.mechanisms.split(","):
            runs = {start: found.get((task, label.format(m=mechanism)), {}) for start, label in STARTS.items()}
            cells = [f"{100 * statistics.mean(r.values()):.2f} ± {100 * statistics.stdev(r.values()):.2f}"
                     if len(r) > 1 else "--" for r in runs.values()]
            for base in bases:
                seeds = sorted(set(runs["pretrained"]) & set(runs[base]))
                diffs = [runs["pretrained"][s] - runs[base][s] for s in seeds]
                cells.append(f"{100 * statistics.mean(diffs):+.2f} ({sign_flip_p_value(diffs):.2f}, {len(diffs)})"
                             if diffs else "--")
            print(f"| {task} | {mechanism} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
