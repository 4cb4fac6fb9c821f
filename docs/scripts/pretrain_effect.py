"""The main paper's Table 8 analogue (docs/pretraining.md): fine-tuned from a masked-LM checkpoint against from scratch.

Reads the fine-tuning grids' records (each run's ``metrics.json``, committed under ``results/compare``) and
prints, per task and mechanism, the score (accuracy; WikiQA: MAP) of each starting point over the seeds, and the
paired differences that decide the claim: pretrained minus scratch with the task's own tokenizer (as every other
grid trains), and pretrained minus scratch with the pretraining's vocabulary (``train --tokenizer-from``: the same
ids, fresh weights -- what the pretrained weights themselves add). p: the exact two-sided sign-flip test over
the seeds (0.25 is its floor with 3 seeds).

    python docs/scripts/pretrain_effect.py results/compare/table8-sentence results/compare/table8-wikiqa ...

``--tag wp`` reads the WordPiece pretraining's entries instead (``{m}-wp-pretrained``, ``{m}-wp-mlm-vocab``) and adds
from scratch with the task's own WordPiece vocabulary (``{m}-wp``, ``train --tokenizer wordpiece``) beside the
grids' word-level baseline (``{m}``); ``--pretrained wp8k-pretrained`` sets a longer pretraining's fine-tuned
entries (``{m}-wp8k-pretrained``) against the same scratch runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from clusterformer.apps.compare import sign_flip_p_value

STARTS = {"scratch": "{m}", "scratch, MLM vocabulary": "{m}-mlm-vocab", "pretrained": "{m}-pretrained"}


def starts(tag: str | None, pretrained: str | None = None) -> dict[str, str]:
    """The starting points compared and their entry labels; ``tag`` names a pretraining's entries, ``pretrained``
    another pretraining's fine-tuned entries (``{m}-PRETRAINED``) to set against the same scratch runs."""
    compared = dict(STARTS) if tag is None else {
        "scratch": "{m}", "scratch, own WordPiece": "{m}-" + tag,
        "scratch, MLM vocabulary": "{m}-" + tag + "-mlm-vocab", "pretrained": "{m}-" + tag + "-pretrained"}
    if pretrained is not None:
        compared["pretrained"] = "{m}-" + pretrained
    return compared


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
    parser.add_argument("--tag", default=None, help="the pretraining's entries: {m}-TAG-pretrained, {m}-TAG, ...")
    parser.add_argument("--pretrained", default=None, metavar="SUFFIX",
                        help="read the fine-tuned entries {m}-SUFFIX (another pretraining) as 'pretrained'")
    args = parser.parse_args()
    found = scores(args.grids)
    compared = starts(args.tag, args.pretrained)
    tasks = sorted({task for task, _ in found} - {"mlm"})  # the pretraining runs themselves, if a grid holds them
    bases = [start for start in compared if start != "pretrained"]
    print("| task | mechanism | " + " | ".join(compared) + " | "
          + " | ".join(f"pretrained - {base} (p, pairs)" for base in bases) + " |")
    print("|---|---|" + "---|" * (len(compared) + len(bases)))
    for task in tasks:
        for mechanism in args.mechanisms.split(","):
            runs = {start: found.get((task, label.format(m=mechanism)), {}) for start, label in compared.items()}
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
