"""The README's "Which attention should I use?" table, one row per registered mechanism, written to
``results/choosing.json`` from the library and the committed records alone:

* what each mechanism can do, from the registry (causal semantics, cached decoding, the ``transformers`` interface);
* keys read and keys mixed per query at the default options and N = 4,096 (``keys_read`` / ``keys_mixed`` of the
  mechanism's options: summaries, re-ranking and members scored count as read);
* the layer's forward+backward time against full attention's at 4,096 and 16,384 tokens (CPU), from the layer
  benchmark's record;
* one cell per task family, each the mean over the seeds of one entry of committed comparison grids, beside full
  attention's on the same grids and seeds (``SOURCES``: which grid, task and entry each cell reads).

A cell with no source reads "not measured". The README and docs/choosing.md render the JSON with
``clusterformer report --docs``; ``tests/test_choosing.py`` checks that this script still writes the committed file.

    python docs/scripts/choosing_table.py            # rewrite results/choosing.json
    python docs/scripts/choosing_table.py --check    # exit 1 when the committed file differs
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "results" / "choosing.json"
BENCH = "results/speed/bench-cpu.json"
LENGTH = 4096  # the length the keys are counted at
NOT_MEASURED = "not measured"

# the table's rows: the reference, the main paper's mechanism, the other papers', the baselines, beyond the papers,
# then the readers of a pretrained decoder's cache
ORDER = ("full", "neural-clustering", "cluster-former", "sliding-window", "clustered", "improved-clustered", "kmeans",
         "lsh", "routing", "cluster-select", "cluster-retrieval", "quest", "sink-window", "oracle")

# what each mechanism is for, and the paper it comes from (docs/papers.md)
PURPOSE = {
    "full": ("exact attention; the reference", "Vaswani et al. (all four papers' baseline)"),
    "neural-clustering": ("learned clusters, sorted equal chunks: the cheapest layer at long N",
                          "ClusterFormer (main paper)"),
    "cluster-former": ("k-means over a memory bank, sorted windows", "Cluster-Former"),
    "sliding-window": ("local windows: cheap when local evidence suffices", "Cluster-Former (its local layer)"),
    "clustered": ("clustered queries attend to every key: approximates a pretrained model", "Vyas et al. 2020"),
    "improved-clustered": ("clustered queries + exact top-k keys: the closest approximation",
                           "Vyas et al. 2020"),
    "lsh": ("shared-QK hashing into sorted chunks", "Reformer (baseline)"),
    "routing": ("online k-means on shared QK, sorted chunks", "Routing Transformer (baseline)"),
    "kmeans": ("learned k-means buckets of shared QK", "Reformer k-means study"),
    "cluster-select": ("keys clustered; a query reads the best-ranked groups and a window: trained recall",
                       "beyond the papers (ClusterKV/Quest selection, trained)"),
    "cluster-retrieval": ("a pretrained decoder's cache read by key clusters", "beyond the papers (ClusterKV)"),
    "quest": ("a pretrained decoder's cache read by pages ranked by a bound", "Quest (baseline)"),
    "oracle": ("the best any selection of the cache can do (every score computed)", "upper bound"),
    "sink-window": ("a pretrained decoder's cache: first tokens + recent window", "StreamingLLM (baseline)"),
}

# family -> mechanism -> (kind, [(grid, task, entry), ...]): the seeds of every listed (grid, task, entry) are pooled,
# and full attention's seeds on the same grids are the yardstick ("points": accuracy differences in points,
# averaged over the listed tasks; "score": the entry's mean and full's; "bpc": bits per character)
SENTENCE = [("results/papers/sentence", task) for task in ("mr", "cr", "subj", "mpqa")]
LONG = [("results/long-documents/imdb-4k", "imdb"), ("results/long-documents/20news-1500", "20news")]
MQAR = ["results/recall/mqar-curriculum-1024-k256", "results/recall/mqar-curriculum-1024-k256-seeds34",
        "results/recall/mqar-curriculum-1024-k256-seed0-shared-qk"]
MQAR_SELECT = ["results/recall/mqar-fused-1024-k256", "results/recall/mqar-fused-1024-k256-seeds34"]
BIDIRECTIONAL = "results/recall/mqar-bidirectional-1024-k256"
# aggregation from scratch at 128 tokens and 31-32 keys read: the histogram, multivalue and maxvalue (one token a pair)
AGGREGATION = [("results/recall/aggregation-histogram-128-k32", "histogram"),
               ("results/recall/aggregation-pairs-128-k32", "multivalue"),
               ("results/recall/aggregation-pairs-128-k32", "maxvalue")]
# causal sliding-window through the same curriculum at the window that reads 256 keys (the MQAR grids' window read at
# most 170); its full runs continue the same stage-1 runs in the query-key grid
TRUE_WINDOW = "results/recall/mqar-curriculum-1024-k256-true-window"
# cluster-select at 255 keys read with the current defaults' ranking, own group and sink (64 clusters, 4 selected;
# summaries and group bounds included), beside full attention on the same stage-1 runs
STACK_TRUE_BUDGET = "results/recall/mqar-stack-1024-k256-true-budget"
QUERY_KEY = "results/recall/mqar-curriculum-1024-k256-query-key"  # full's runs on those stage-1 runs
# neural-clustering with queries and keys assigned apart, and full attention's stage 2 on each of its seeds
QUERY_KEY_FILL = ("results/recall/mqar-curriculum-1024-k256-query-key-kmeans", "mqar",
                  "window-then-neural-clustering-query-key-ema-3-runs-fill")
QUERY_KEY_FULL = [QUERY_KEY, "results/recall/mqar-curriculum-1024-k256-seed4",
                  "results/recall/mqar-curriculum-1024-k256-seed0-query-key"]
# cluster-select at the window's keys read on the long documents; IMDB-4K's grid holds no full attention, whose
# seeds 0 and 1 are in the family grid of the same recipe
TRUE_BUDGET_LONG = {"20news": "results/long-documents/20news-1500-k126-true-budget",
                    "imdb": "results/long-documents/imdb-4k-k126-true-budget"}
# grids without full attention, and the grids of the same task and setting whose full runs are their yardstick
FULL_ELSEWHERE = {**{grid: MQAR_SELECT for grid in MQAR},
                  TRUE_WINDOW: [QUERY_KEY],
                  QUERY_KEY_FILL[0]: QUERY_KEY_FULL,
                  TRUE_BUDGET_LONG["imdb"]: [grid for grid, task in LONG if task == "imdb"]}
TRAINABLE_GRID = ("full", "neural-clustering", "cluster-former", "sliding-window", "clustered", "improved-clustered",
                  "lsh", "routing", "kmeans")


def _sources() -> dict[str, dict[str, tuple]]:
    """family -> mechanism -> (kind, sources, note), or with the paper's form's own (kind, sources, note) after
    them where the sources are an option beyond the paper."""
    local = {m: ("points", [(g, t, m) for g, t in SENTENCE], "") for m in TRAINABLE_GRID}
    long = {m: ("points", [(g, t, m) for g, t in LONG], "") for m in TRAINABLE_GRID}
    long["cluster-select"] = ("points", [(TRUE_BUDGET_LONG[task], task, "cluster-select") for task in TRUE_BUDGET_LONG],
                              "125 keys read")
    recall = {m: ("score", [(g, "mqar", m) for g in MQAR], "") for m in ("neural-clustering", "cluster-former")}
    recall["neural-clustering"] = ("score", [QUERY_KEY_FILL], "cluster_on=query-key, 3 clusters per query, "
                                   "reach_split=fill, a window layer below; 256 keys read", recall["neural-clustering"])
    recall["sliding-window"] = ("score", [(TRUE_WINDOW, "mqar", "sliding-window")], "its true 256 keys")
    recall.update({m: ("score", [(g, "mqar", f"{m}+fresh-qk") for g in MQAR], "fresh shared QK")
                   for m in ("lsh", "routing", "kmeans")})
    recall["full"] = ("score", [(g, "mqar", "full") for g in MQAR_SELECT], "")
    recall["cluster-select"] = ("score", [(STACK_TRUE_BUDGET, "mqar", "cluster-select-64x4-own-group-sink")],
                                "64 clusters, 4 selected, own group, sink; 255 keys read")
    recall.update({m: ("score", [(BIDIRECTIONAL, "mqar", m)], "encoder form") for m in
                   ("clustered", "improved-clustered")})
    aggregation = {m: ("score", [(g, t, m) for g, t in AGGREGATION], "") for m in
                   ("full", "neural-clustering", "sliding-window")}
    aggregation["cluster-select"] = ("score", [(g, t, "content-clusters") for g, t in AGGREGATION],
                                     "16 content clusters, own group, sink")
    lm = {m: ("bpc", [("results/papers/shakespeare-char", "shakespeare-char", m)], "") for m in
          ("full", "neural-clustering", "sliding-window", "lsh", "routing", "kmeans")}
    return {"local": local, "recall": recall, "aggregation": aggregation, "long_documents": long, "lm": lm}


def _scores(grid: str, task: str, entry: str) -> dict[str, float]:
    """seed -> score of one entry of a comparison grid ({} when the grid has no such entry)."""
    summary = json.loads((ROOT / grid / "summary.json").read_text())
    row = summary["tasks"][task]["mechanisms"].get(entry)
    return dict(row["scores"]) if row else {}


def _cell(kind: str, sources: list[tuple[str, str, str]], note: str,
          paper_form: tuple[str, list[tuple[str, str, str]], str] | None = None, *, name: str) -> str:
    """The mechanism's mean over its seeds and full attention's over the same seeds, per task; tasks averaged.
    ``paper_form``: where the cell's sources are an option beyond the paper, the paper's form's own cell after it."""
    if paper_form is not None:
        return f"{_cell(kind, sources, note, name=name)}; the paper's form {_cell(*paper_form, name=name)}"
    by_task: dict[str, tuple[dict[str, float], dict[str, float]]] = {}
    for grid, task, entry in sources:
        mine, full = by_task.setdefault(task, ({}, {}))
        mine.update(_scores(grid, task, entry))
        for yardstick in (grid, *FULL_ELSEWHERE.get(grid, ())):
            full.update({s: v for s, v in _scores(yardstick, task, "full").items() if s not in full})
    means, full_means, deltas, seeds = [], [], [], set()
    for mine, full in by_task.values():
        shared = sorted(set(mine) & set(full))
        if not shared:
            raise ValueError(f"{name}: no seed shared with full attention in {sources}")
        seeds.add(len(shared))
        means.append(statistics.mean(mine[s] for s in shared))
        full_means.append(statistics.mean(full[s] for s in shared))
        deltas.append(means[-1] - full_means[-1])
    if len(seeds) > 1:  # e.g. 2 seeds on one task, 3 on another
        n = f"{min(seeds)}-{max(seeds)} seeds a task"
    else:
        n = f"{min(seeds)} seed" + ("" if seeds == {1} else "s")
    suffix = f"; {note}" if note else ""
    if kind == "points":
        return (f"reference ({n}{suffix})" if name == "full" else
                f"{100 * statistics.mean(deltas):+.1f} pts ({n}{suffix})")
    unit = " bpc" if kind == "bpc" else ""
    mean, full_mean = statistics.mean(means), statistics.mean(full_means)
    if name == "full":
        return f"{mean:.3f}{unit} ({n}{suffix})"
    return f"{mean:.3f}{unit} (full {full_mean:.3f}; {n}{suffix})"


def _speed() -> dict[str, dict[int, float]]:
    """mechanism -> N -> forward+backward time / full's at that N (the bench record's medians)."""
    times: dict[str, dict[int, float]] = {}
    for row in json.loads((ROOT / BENCH).read_text()):  # one record per mechanism and length
        if row.get("fwd_bwd_ms"):
            times.setdefault(row["name"], {})[row["length"]] = row["fwd_bwd_ms"]
    return {name: {n: t / times["full"][n] for n, t in by_n.items() if n in times["full"]}
            for name, by_n in times.items()}


def _long_context() -> dict[str, str]:
    """Cache readers: the answers each keeps of dense's at 4,096 tokens and a 10% budget (SmolLM2-135M)."""
    kept = json.loads((ROOT / "results/long-context/summary.json").read_text())["kept"]
    cells = {}
    for row in kept:
        if row["length"] == 4096 and row["budget"] == "10%" and row["grid"] == "uniform":
            name = row["entry"].split(":")[0]
            if name not in cells or row["entry"] == name:  # the default options first
                cells[name] = f"{row['both']} of dense's answers"
    return cells


def build_table() -> list[dict[str, str]]:
    from clusterformer.attention.registry import can_decode, causal_semantics, get, make_options, names

    sources, speed, long_context = _sources(), _speed(), _long_context()
    rows = []
    if sorted(ORDER) != sorted(names()):
        raise ValueError(f"ORDER lists {sorted(ORDER)}; the registry has {sorted(names())}")
    for name in ORDER:
        mechanism, options = get(name), make_options(name, {})
        causal = causal_semantics(name, {})
        read, mixed = options.keys_read(LENGTH), options.keys_mixed(LENGTH)
        row = {
            "mechanism": name,
            "for": PURPOSE[name][0],
            "paper": PURPOSE[name][1],
            "keys_read": str(read) if read == mixed else f"{read} ({mixed} mixed)",
            "causal": {"strict": "yes", "paper": "paper's (not strict)", "refused": "no"}[causal],
            "decoding": "yes" if can_decode(name, {}) or mechanism.kind == "cache" else "no",
            "transformers": "yes" if mechanism.interface_mode is not None else "no",
        }
        for n in (4096, 16384):
            ratio = speed.get(name, {}).get(n)
            row[f"speed_{n}"] = (f"{ratio:.2f}" if ratio is not None else
                                 "cache reader" if mechanism.kind == "cache" else NOT_MEASURED)
        for family, by_name in sources.items():
            row[family] = _cell(*by_name[name], name=name) if name in by_name else NOT_MEASURED
        row["long_context"] = long_context.get(name, NOT_MEASURED)
        rows.append(row)
    return rows


def main(argv: list[str]) -> int:
    text = json.dumps(build_table(), indent=1, ensure_ascii=False) + "\n"
    if "--check" in argv:
        same = OUT.exists() and OUT.read_text() == text
        print("results/choosing.json is up to date" if same else "results/choosing.json differs: rerun the script")
        return 0 if same else 1
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
