"""The keys read and keys mixed of every entry of the committed grids that compare "at equal budget".

A grid compared at equal budget labelled each entry with one number, the keys per query its options gave then
(``keys_per_query`` in each run's ``metrics.json``, from ``compare --keys-per-query B``). That number counted what
each mechanism then counted: a causal sliding window the union of two windows that no causal query sees, a
cluster-select summary as one key though all its members' values flow in, cluster retrieval's retrieved keys
without the centroids and candidates it scores. This script recounts, without training, every entry as the library
counts now (:meth:`clusterformer.attention.AttentionOptions.keys_read`: every logit a query computes, summaries,
bounds, centroids and re-ranked candidates included; ``keys_mixed``: the keys whose values reach its output), from
the options each run recorded, under the defaults it ran with (``defaults_versions``; cluster-select's
``summaries``, whose default changed without a version, from the count it recorded), at its ``--max-len`` and
causal form, the most over the model's layers (the Cluster-Former stack's sliding-window layers included). The
``options`` of a row are those options resolved so (the defaults they pin written out):

- every compare grid (a ``summary.json`` with ``entries``, found anywhere under ``results/``) run with
  ``--keys-per-query`` (or named ``-kB``): one row per (grid, task, entry) from its runs' ``metrics.json``;
- the long-context cache readers compared at one budget (``results/long-context/summary.json``'s ``kept`` rows,
  entries named as the library names them): the label is the budget's keys, a decoding query over the nominal
  length.

Writes ``results/budgets/recorded-grids.json``: a list of {grid, entry, options, length, causal, label_keys,
keys_read, keys_mixed} (and task, mechanism, layers: [[mechanism, options], ...] of every layer kind, runs), and
prints the comparisons whose entries' keys read differ.

Run from the checkout: ``python docs/scripts/recorded_budgets.py [--out results/budgets/recorded-grids.json]``.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from clusterformer._specs import parse_spec
from clusterformer.attention.registry import make_options, pin_defaults
from clusterformer.data.recall import RECALL_TASKS
from clusterformer.ops.retrieval import keys_allowed_count

ROOT = Path(__file__).resolve().parents[2]
BUDGET_NAME = re.compile(r"-k\d+")


def causal_task(task: str, task_options: dict[str, Any] | None) -> bool:
    """Whether the task's model is causal (as ``compare`` decides: shakespeare-char, a recall task's causal form)."""
    return task == "shakespeare-char" or (task in RECALL_TASKS and (task_options or {}).get("form", "causal")
                                          == "causal")


def layer_mechanisms(config: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(mechanism, options) of every attention layer kind of a run: ``attention`` and ``layer_attention``; the
    Cluster-Former stack (``cluster_layers``) has sliding-window layers of the same window and stride beside its
    Cluster-Former layers."""
    layers = [(config["attention"], dict(config.get("attention_options") or {}))]
    layers += [(name, dict(options)) for name, options in (config.get("layer_attention") or {}).values()]
    if config.get("cluster_layers") is not None:
        options = layers[0][1]
        window = {key: options[key] for key in ("window", "stride") if key in options}
        layers.append(("sliding-window", window))
    return layers


def as_run(name: str, options: dict[str, Any], versions: dict[str, int] | None, label: int | None,
           length: int) -> dict[str, Any]:
    """A layer's options as the run meant them: pinned to its recorded defaults (``defaults_versions``). One default
    differs between records without a version: cluster-select's ``summaries``, off in the oldest records. A record
    without it then takes the value whose count at the time -- window + sink + select x cluster_keys, plus one key
    per summary -- gives the ``keys_per_query`` the run recorded."""
    pinned = pin_defaults(name, options, versions)
    if name != "cluster-select" or "summaries" in options or label is None:
        return pinned
    for summaries in (True, False):
        try:
            made = make_options(name, pin_defaults(name, {**options, "summaries": summaries}, versions))
        except ValueError:  # the other options rule this value out (selection="summaries" needs the summaries)
            continue
        then = made.window + made.sink + made.select * made.cluster_keys + (made.num_groups if summaries else 0)
        if min(length, then) == label:
            return pin_defaults(name, {**options, "summaries": summaries}, versions)
    return pinned


def count(layers: list[tuple[str, dict[str, Any]]], length: int, causal: bool) -> tuple[int, int]:
    """(keys read, keys mixed): the most over the layers."""
    made = [make_options(name, options) for name, options in layers]
    return (max(o.keys_read(length, causal) for o in made), max(o.keys_mixed(length, causal) for o in made))


def budgeted(summary: dict[str, Any], grid: Path) -> bool:
    """Whether a compare grid's summary is of one budget for every entry: a ``keys_per_query``, or a name ``-kB``."""
    return "entries" in summary and (summary.get("keys_per_query") is not None or bool(BUDGET_NAME.search(grid.name)))


def grid_rows(summary_path: Path) -> list[dict[str, Any]]:
    """One row per (task, entry) of a compare grid at equal budget, from its runs' records."""
    summary = json.loads(summary_path.read_text())
    grid = summary_path.parent
    if not budgeted(summary, grid):
        return []
    rows: dict[tuple, dict[str, Any]] = {}
    for metrics_path in sorted(grid.rglob("metrics.json")):
        record = json.loads(metrics_path.read_text())
        config = record.get("config")
        if not config or "attention" not in config:
            continue
        task, entry = metrics_path.relative_to(grid).parts[:2]
        length = int(config["max_len"])
        causal = causal_task(task, config.get("task_options"))
        label = record.get("keys_per_query")
        layers = [(name, as_run(name, options, record.get("defaults_versions"), label, length))
                  for name, options in layer_mechanisms(config)]
        read, mixed = count(layers, length, causal)
        key = (task, entry, json.dumps(layers, sort_keys=True), length, causal)
        row = rows.setdefault(key, {
            "grid": str(grid.relative_to(ROOT / "results")), "task": task, "entry": entry,
            "options": layers[0][1] if len(layers) == 1 else {name: options for name, options in layers},
            "mechanism": layers[0][0], "layers": [list(layer) for layer in layers], "length": length, "causal": causal,
            "label_keys": label, "keys_read": read, "keys_mixed": mixed, "runs": 0})
        row["runs"] += 1
        if record.get("keys_per_query") is not None:  # the largest label any run of the entry recorded
            row["label_keys"] = max(row["label_keys"] or 0, record["keys_per_query"])
    return list(rows.values())


def long_context_rows(summary_path: Path) -> list[dict[str, Any]]:
    """One row per long-context entry compared at one budget: a decoding query over the nominal length."""
    if not summary_path.is_file():
        return []
    rows = []
    for kept in json.loads(summary_path.read_text()).get("kept", []):
        name, options = parse_spec(kept["entry"])
        made = make_options(name, options)  # the records' default budget is the library's, 10%
        length = int(kept["length"])
        # the label: the budget the row is compared at (a layer split's: its mean over the layers, 10%)
        nominal = 0.1 if kept["grid"] == "layers" else float(re.match(r"[\d.]+", kept["budget"]).group()) / 100
        rows.append({"grid": f"long-context/{kept['grid']}, {kept['budget']}", "task": "passkey, niah-multikey",
                     "records": kept["records"],
                     "entry": kept["entry"], "options": options, "mechanism": name, "layers": [[name, options]],
                     "length": length,
                     "causal": True, "label_keys": keys_allowed_count(nominal, length),
                     "keys_read": made.keys_read(length, True), "keys_mixed": made.keys_mixed(length, True),
                     "runs": kept["samples"]})
    return rows


def unequal(rows: list[dict[str, Any]]) -> list[tuple[str, str, dict[str, int]]]:
    """(grid and length, task, {entry: keys read}) of every comparison whose entries' keys read differ (full and
    the clustered mechanisms, which no option sets and the grids run as they are, left out; the oracle, which reads
    every key by design, kept)."""
    groups: dict[tuple[str, str], dict[str, int]] = {}
    for row in rows:
        if row["mechanism"] not in ("full", "clustered", "improved-clustered"):
            where = f"{row['grid']} at {row['length']}"
            groups.setdefault((where, row["task"]), {})[row["entry"]] = row["keys_read"]
    return [(grid, task, reads) for (grid, task), reads in groups.items() if len(set(reads.values())) > 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "results" / "budgets" / "recorded-grids.json"))
    args = parser.parse_args()
    rows = [row for path in sorted((ROOT / "results").rglob("summary.json")) for row in grid_rows(path)]
    rows += long_context_rows(ROOT / "results" / "long-context" / "summary.json")
    rows.sort(key=lambda r: (r["grid"], r["task"], r["entry"]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"{len(rows)} entries -> {out}")
    for grid, task, reads in unequal(rows):
        print(f"{grid} [{task}]: keys read " + ", ".join(f"{e} {n}" for e, n in sorted(reads.items(),
                                                                                     key=lambda kv: kv[1])))


if __name__ == "__main__":
    main()
