"""The recall ceiling that neural-clustering's grouping allows on MQAR, from the curriculum's committed runs.

A query can answer only if the key it needs (the value token after its key's earlier occurrence) is among the keys
it reads. For neural-clustering that is its own cluster's chunks and their look-back; for cluster-select its
window, sink and selected groups' members. Every curriculum run at N = 1,024 measured this on 16 test sequences
(``recall_sequences``): ``key_recall``, the share of queries whose needed key a layer reads (the weight on it is
non-zero), per layer, at each evaluation. The larger of the two layers' shares bounds the accuracy that reading
the key allows (a query whose key no layer reads can only guess); ``key_argmax``, the share whose needed key
gets the row's largest weight, is what a recalling layer does.

This script gathers those numbers, without training, for the entries that continue full attention's stage-1
weights at 256 keys per query: neural-clustering in the paper's form and with its contiguous and random
controls, full attention, and cluster-select with content clusters, pages and random groups (Quest's bound ranking).
(``cluster_on="query-key"`` has its own grid, whose summary gives the same measure.) Writes
``results/recall/nca-recall-ceiling.json``: ``rows`` (one per run and evaluation) and ``entries`` (per entry:
seeds, accuracy and the layer-best key recall at the last evaluation, each seed and the mean).

Run from the checkout: ``python docs/scripts/nca_recall_ceiling.py [--out results/recall/nca-recall-ceiling.json]``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import mean
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# the curriculum grids of the paper's form and its controls, then cluster-select's; a seed in two records (full's
# seeds 0 and 2 are in the first and fourth, continued from the same stage-1 runs) is taken from the first
RECORDS = ("mqar-curriculum-1024-k256", "mqar-curriculum-1024-k256-seeds34", "mqar-fused-1024-k256",
           "mqar-fused-1024-k256-seeds34")
# the entries' names in those records -> the name this table gives them
ENTRIES = {"neural-clustering": "neural-clustering (paper)",
           "neural-clustering--grouping-contiguous": "neural-clustering, contiguous groups",
           "neural-clustering--grouping-random": "neural-clustering, random groups",
           "full": "full",
           "cluster-select--num_clusters-64--select-4--summaries-false--selection-bound": "cluster-select, content",
           "cluster-select-64x4-bound": "cluster-select, content",
           "pages-64x4-bound": "cluster-select, pages",
           "random-64x4-bound": "cluster-select, random groups"}


def _row(record: str, entry: str, seed: str, evaluation: dict[str, Any]) -> dict[str, Any]:
    layers = evaluation.get("key_recall", {})
    return {"record": f"results/recall/{record}", "entry": ENTRIES[entry], "seed": int(seed.removeprefix("seed")),
            "step": evaluation["step"], "accuracy": evaluation["accuracy"],
            "key_recall": {name: values["key_recall"] for name, values in layers.items()},
            "key_argmax": {name: values["key_argmax"] for name, values in layers.items()},
            "best_layer_recall": max((values["key_recall"] for values in layers.values()), default=None)}


def gather() -> dict[str, Any]:
    rows = []
    for record in RECORDS:
        for metrics in sorted((ROOT / "results" / "recall" / record / "mqar").glob("*/seed*/metrics.json")):
            entry, seed = metrics.parent.parent.name, metrics.parent.name
            if entry not in ENTRIES:
                continue
            run = json.loads(metrics.read_text())
            evaluations = [e for e in run["evaluations"] if "key_recall" in e]
            if all(e["step"] != run["steps"] for e in evaluations):  # the final metrics: the last step's
                evaluations.append({"step": run["steps"], **run["metrics"]})
            rows += [_row(record, entry, seed, e) for e in evaluations]
    entries: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(ENTRIES.values()):
        last: dict[int, dict[str, Any]] = {}  # seed -> the last evaluation of that seed's run in the first record
        for row in rows:
            if row["entry"] != name:
                continue
            held = last.get(row["seed"])
            if held is None or (held["record"] == row["record"] and row["step"] >= held["step"]):
                last[row["seed"]] = row
        if not last:
            continue
        seeds = sorted(last)
        entries[name] = {"seeds": seeds, "step": max(r["step"] for r in last.values()),
                         "accuracy": {s: last[s]["accuracy"] for s in seeds},
                         "best_layer_recall": {s: last[s]["best_layer_recall"] for s in seeds},
                         "accuracy_mean": mean(last[s]["accuracy"] for s in seeds),
                         "best_layer_recall_mean": mean(last[s]["best_layer_recall"] for s in seeds)}
    return {"what": __doc__.split("\n\n")[0], "command": "python docs/scripts/nca_recall_ceiling.py",
            "task": "causal MQAR, N = 1,024, 256 keys per query, each run continuing full attention's stage-1 "
                    "weights for 200 steps (docs/recall-and-aggregation.md, the length curriculum)",
            "entries": entries, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "results" / "recall" / "nca-recall-ceiling.json"))
    args = parser.parse_args()
    table = gather()
    Path(args.out).write_text(json.dumps(table, indent=1) + "\n")
    for name, entry in table["entries"].items():
        print(f"{name:45s} seeds {entry['seeds']}  accuracy {entry['accuracy_mean']:.3f}  "
              f"needed key read (best layer) {entry['best_layer_recall_mean']:.3f}")


if __name__ == "__main__":
    main()
