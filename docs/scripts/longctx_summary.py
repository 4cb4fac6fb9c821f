"""The long-context records gathered into the tables of docs/long-context-decoding.md.

``clusterformer longctx`` writes one record per run (results/long-context/*.json): per task, length and method the
exact answers, and against dense on the same prompts the answers kept and gained and the exact McNemar p-value. A
question the page asks ("what does each cache reader keep of dense's answers at each budget and length?") spans
several runs, and passkey and multi-key NIAH at 8k ran as separate processes. This script reads those records, names
every entry by its options in the library as it is (an entry recorded as ``cluster-retrieval`` before ``rerank=4``
became the default is ``cluster-retrieval:rerank=1`` here), adds each entry's budget as the library counts it (keys
read: every logit a decoding query computes, centroids and re-ranked candidates included; keys mixed: the keys whose
values reach its output; ``keys_read`` / ``keys_mixed`` of the mechanism's options at the nominal length), and
writes one file of rows that ``clusterformer report --docs`` renders (``records ... --path kept``):

- ``kept``: a row per (grid, length, budget, entry): answers kept (+ gained) of dense's per task and both, p-values;
- ``recall``: the attention-recall sweep (``docs/scripts/longctx_attention_recall.py``), a row per selection rule;
- ``decoding``: the decoding step's bench (``clusterformer bench retrieval``) over three idle runs, a row per
  (context, method): amortized ms per token and the ratio to dense SDPA in each run.

Run from the checkout: ``python docs/scripts/longctx_summary.py [--out results/long-context/summary.json]``.
"""
from __future__ import annotations

import argparse
import json
from math import comb
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "results" / "long-context"
TASKS = ("passkey", "niah-multikey")

# (grid, length, record stems (one per task where the tasks ran apart), the method as recorded, the entry as the
# library names it now, the budget's label, samples per task (None: all))
KEPT = [
    ("uniform", 2048, ["yardsticks-2k"], "oracle", "oracle", "10%", None),
    ("uniform", 2048, ["yardsticks-2k"], "cluster-retrieval", "cluster-retrieval:rerank=1", "10%", None),
    ("uniform", 2048, ["yardsticks-2k"], "quest", "quest", "10%", None),
    ("uniform", 2048, ["yardsticks-2k"], "sink-window", "sink-window", "10%", None),
    ("uniform", 4096, ["yardsticks-4k"], "oracle", "oracle", "10%", None),
    ("uniform", 4096, ["variants-4k"], "cluster-retrieval:rerank=4", "cluster-retrieval", "10%", None),
    ("uniform", 4096, ["rerank23-4k"], "cluster-retrieval:rerank=3", "cluster-retrieval:rerank=3", "10%", None),
    ("uniform", 4096, ["rerank23-4k"], "cluster-retrieval:rerank=2", "cluster-retrieval:rerank=2", "10%", None),
    ("uniform", 4096, ["yardsticks-4k"], "cluster-retrieval", "cluster-retrieval:rerank=1", "10%", None),
    ("uniform", 4096, ["variants-4k"], "cluster-retrieval:selection=head,rerank=4",
     "cluster-retrieval:selection=head", "10%", None),
    ("uniform", 4096, ["variants-4k"], "cluster-retrieval:num_clusters=512",
     "cluster-retrieval:num_clusters=512,rerank=1", "10%", None),
    ("uniform", 4096, ["yardsticks-4k"], "quest", "quest", "10%", None),
    ("uniform", 4096, ["yardsticks-4k"], "sink-window", "sink-window", "10%", None),
    ("uniform", 4096, ["budget20-4k"], "oracle:budget=0.2", "oracle:budget=0.2", "20%", None),
    ("uniform", 4096, ["budget20-4k"], "cluster-retrieval:budget=0.2,rerank=4", "cluster-retrieval:budget=0.2",
     "20%", None),
    ("uniform", 4096, ["budget20-4k"], "cluster-retrieval:budget=0.2", "cluster-retrieval:budget=0.2,rerank=1",
     "20%", None),
    ("uniform", 8192, ["rerank-8k-passkey", "rerank-8k-niah-multikey"], "oracle", "oracle", "10%", None),
    ("uniform", 8192, ["rerank-8k-passkey", "rerank-8k-niah-multikey"], "cluster-retrieval", "cluster-retrieval",
     "10%", None),
    ("uniform", 8192, ["rerank-8k-passkey", "rerank-8k-niah-multikey"], "cluster-retrieval:rerank=1",
     "cluster-retrieval:rerank=1", "10%", None),
    ("uniform", 8192, ["budget20-8k-passkey", "budget20-8k-niah-multikey"], "oracle:budget=0.2", "oracle:budget=0.2",
     "20%", None),
    ("uniform", 8192, ["budget20-8k-passkey", "budget20-8k-niah-multikey"], "cluster-retrieval:budget=0.2",
     "cluster-retrieval:budget=0.2", "20%", None),
    ("uniform", 8192, ["budget30-8k-passkey", "budget30-8k-niah-multikey"], "oracle:budget=0.3", "oracle:budget=0.3",
     "30%", None),
    ("uniform", 8192, ["budget30-8k-passkey", "budget30-8k-niah-multikey"], "cluster-retrieval:budget=0.3",
     "cluster-retrieval:budget=0.3", "30%", None),
    # the budget spread over the layers at the same mean (10% of the keys over the 30 layers)
    ("layers", 4096, ["yardsticks-4k"], "oracle", "oracle", "10% in every layer", None),
    ("layers", 4096, ["variants-4k"], "cluster-retrieval:rerank=4", "cluster-retrieval", "10% in every layer", None),
]
for _name in ("oracle", "cluster-retrieval"):
    for _split, _label, _stem in (("budget=0.0533,lower_layers=12,lower_budget=0.17", "17% in 0-11, 5.33% in 12-29",
                                   "lower-layers-4k"),
                                  ("budget=0.0714,lower_layers=2,lower_budget=0.5", "50% in 0-1, 7.14% in 2-29",
                                   "lower-layers-4k"),
                                  ("budget=0.1311,lower_layers=12,lower_budget=0.0533", "5.33% in 0-11, 13.1% in 12-29",
                                   "upper-layers-4k")):
        KEPT.append(("layers", 4096, [f"{_stem}-passkey", f"{_stem}-niah-multikey"], f"{_name}:{_split}",
                     f"{_name}:{_split}", _label, None))
KEPT += [
    # the sparse prefill: decoding at 10% after a dense and after a sparse prefill, the same prompts
    ("prefill", 4096, ["sparse-prefill-4k"], "cluster-retrieval:rerank=4", "cluster-retrieval", "10%", None),
    ("prefill", 4096, ["sparse-prefill-4k"], "cluster-retrieval:rerank=4,prefill_block=256",
     "cluster-retrieval:prefill_block=256", "10%", None),
    ("prefill-15", 4096, ["sparse-prefill-4k"], "cluster-retrieval:rerank=4", "cluster-retrieval", "10%", 15),
    ("prefill-15", 4096, ["sparse-prefill-4k"], "cluster-retrieval:rerank=4,prefill_block=256",
     "cluster-retrieval:prefill_block=256", "10%", 15),
    ("prefill-15", 4096, ["prefill-budget30-4k"], "cluster-retrieval:prefill_block=256,prefill_budget=0.3",
     "cluster-retrieval:prefill_block=256,prefill_budget=0.3", "10%", 15),
]

RULES = {"group": "clusters ranked per key/value group", "head": "clusters ranked per query head",
         "group-rerank": "per group, rerank=4 (the default)", "head-rerank": "per query head, rerank=4",
         "oracle": "token oracle", "quest": "Quest (pages of 16)", "page-oracle": "page oracle (pages of 16)"}
SWEEP = ["rerank-sweep-run1", "rerank-sweep-run2", "rerank-sweep-run3"]


def mcnemar(kept_only_dense: int, gained: int) -> float:
    """Exact two-sided McNemar p-value of the discordant pairs (as ``clusterformer longctx`` reports it)."""
    n = kept_only_dense + gained
    if n == 0:
        return 1.0
    tail = sum(comb(n, i) for i in range(min(kept_only_dense, gained) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def paired(record: dict, task: str, names: tuple[str, ...], limit: int | None) -> dict:
    """Dense's exact answers on ``task`` and, of those, the ones the method keeps, the ones it gains, and p; the
    method is found under the first of ``names`` that a sample holds (as recorded, or as the library names it, for
    a record written again by the page's command)."""
    dense = kept = gained = samples = 0
    for key, sample in record["samples"].items():
        name, _, index = key.split("/")
        method = next((n for n in names if n in sample["methods"]), None)
        if name != task or method is None or (limit is not None and int(index) >= limit):
            continue
        samples += 1
        d, m = sample["methods"]["dense"]["score"] >= 1, sample["methods"][method]["score"] >= 1
        dense += d
        kept += d and m
        gained += m and not d
    return {"dense": dense, "kept": kept, "gained": gained, "p": mcnemar(dense - kept, gained), "n": samples}


def budget_counts(entry: str, length: int) -> tuple[int, int]:
    """(keys read, keys mixed) of a decoding query over ``length`` cached keys, as the library counts them."""
    from clusterformer._specs import parse_spec
    from clusterformer.attention.registry import build_inner

    name, options = parse_spec(entry)
    options = {"budget": 0.1, **options}
    inner = build_inner(name, dim=576, heads=9, **options)
    return inner.options.keys_read(length, causal=True), inner.options.keys_mixed(length, causal=True)


def cell(counts: dict) -> str:
    gained = f" + {counts['gained']}" if counts["gained"] else ""
    p = f" (p {counts['p']:.2g})" if counts.get("p") is not None else ""
    return f"{counts['kept']}{gained} of {counts['dense']}{p}"


def kept_rows() -> list[dict]:
    rows = []
    for grid, length, stems, recorded, entry, budget, limit in KEPT:
        records = [json.loads((RECORDS / f"{stem}.json").read_text()) for stem in stems]
        per_task = {}
        for task in TASKS:
            found = [paired(r, task, (recorded, entry), limit) for r in records]
            found = [f for f in found if f["n"]]
            if len(found) != 1:
                raise ValueError(f"{entry} ({stems}): {len(found)} records hold {task}; expected one")
            per_task[task] = found[0]
        both = {k: sum(per_task[t][k] for t in TASKS) for k in ("dense", "kept", "gained")}
        read, mixed = budget_counts(entry, length)
        rows.append({"grid": grid, "length": length, "budget": budget, "entry": entry,
                     "samples": per_task["passkey"]["n"], "keys_read": read, "keys_mixed": mixed,
                     "passkey": cell(per_task["passkey"]), "niah": cell(per_task["niah-multikey"]),
                     "kept": both["kept"], "gained": both["gained"], "dense": both["dense"],
                     "both": cell({**both, "p": None}).split(" (")[0],
                     "share": both["kept"] / both["dense"], "records": ", ".join(f"{s}.json" for s in stems)})
    return rows


def recall_rows() -> list[dict]:
    data = json.loads((RECORDS / "attention-recall-budget-2k.json").read_text())["summary"]
    rows = []
    for rule, label in RULES.items():
        row = {"rule": label}
        for budget in ("0.02", "0.05", "0.1", "0.2", "0.3"):
            point = data[rule][budget]
            tag = str(round(100 * float(budget)))
            row[f"needle_{tag}"] = 100 * point["needle"]
            row[f"mass_{tag}"] = 100 * point["mass"]
            row[f"keys_{tag}"] = point["keys"]
        rows.append(row)
    return rows


def decoding_rows() -> list[dict]:
    runs = [json.loads((RECORDS / "decoding-step" / f"{stem}.json").read_text()) for stem in SWEEP]
    rows = []
    for first in runs[0]:
        same = [next(r for r in run if r["context"] == first["context"] and r["method"] == first["method"])
                for run in runs]
        rows.append({"context": first["context"], "method": first["method"],
                     "amortized_ms": " / ".join(f"{r['amortized_ms']:.3f}" for r in same),
                     "vs_dense": " / ".join(f"{r['speedup_vs_dense']:.2f}x" for r in same)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RECORDS / "summary.json"))
    args = parser.parse_args()
    summary = {"kept": kept_rows(), "recall": recall_rows(), "decoding": decoding_rows()}
    Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {args.out}: {len(summary['kept'])} answer rows, {len(summary['recall'])} recall rows, "
          f"{len(summary['decoding'])} decoding rows")


if __name__ == "__main__":
    main()
