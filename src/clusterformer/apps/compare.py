"""``clusterformer compare``: every mechanism on every task over several seeds (or CV folds), resumable, summarised.

The grid is tasks x entries x units. An entry is what one column of the comparison runs, under a label:

* a registered mechanism name (``lsh``), with the options ``--options`` gives that label;
* a spec ``NAME:key=value,...`` (``neural-clustering:grouping=random``): the mechanism with those options on top;
* a variant, a label defined by ``--variants`` with its mechanism, options and extra train flags (the ablation
  without clustering losses is ``{"attention": "neural-clustering", "train_args": ["--clustering-weight", "0",
  "--centroid-sorting-weight", "0"]}``);
* ``cluster-former-stack``, a built-in variant: the Cluster-Former paper's stack of sliding-window layers whose last
  layer is a Cluster-Former layer (``--attention cluster-former --cluster-layers -1``).

A unit is a seed (or, with ``folds``, a fold of the sentence tasks' CV). Each run is ``clusterformer train`` in a
subprocess (its peak resident memory is its own, and a crash loses one run) with the same flags for every entry --
equal budgets, equal model size -- writing into ``OUT/TASK/DIRECTORY/seedS`` (or ``foldF``), DIRECTORY being the
label with ``:``, ``,`` and ``=`` made file-name friendly. A run whose ``metrics.json`` exists is skipped; one with a
checkpoint but no metrics is resumed (``--resume``); so an interrupted comparison continues where it stopped.
``jobs`` > 1 runs that many trainings at once, each with ``cpu_count // jobs`` threads (``OMP_NUM_THREADS``, unless
the caller set it; one job keeps torch's own choice): small models train faster as two one-thread runs than as
one two-thread run.

Budgets. ``keys_per_query`` (``--keys-per-query B``) gives every entry the same budget of *keys read*: the options
each mechanism's ``for_budget`` returns for B keys read per query at the runs' ``--max-len`` (and, for the causal tasks
-- shakespeare-char and the recall tasks' causal form -- its strict causal chunk) are merged over the entry's own.
Entries whose budget no option sets (full, clustered, improved-clustered: every query reads every key) run as they
are, and the log says so. Every run records the keys a query reads (``keys_per_query`` in its ``metrics.json``: the
logits it computes, summaries, bounds and scored candidates included) and the keys it mixes (``keys_mixed``: whose
values reach it, a summary mixing all its members); the summary shows both (``keys_read``, ``keys_mixed``; for runs
recorded before ``keys_mixed`` existed, both worked out from the entry's options at the runs' length).

Per-seed flags. ``{seed}`` in a train flag (the grid's or a variant's) becomes each run's seed: ``--init
stage1/mqar/full/seed{seed}`` continues every seed from its own checkpoint of an earlier grid (a length
curriculum, a dense model continued sparse).

The summary (``OUT/summary.json`` and ``OUT/summary.md``) gives, per task and entry, the mean and sample standard
deviation of the task's score over units, seconds per epoch, the largest peak resident memory of its runs, and for
each entry its difference to ``full`` and to ``neural-clustering``, paired by unit, with the two-sided p-value of
an exact sign-flip permutation test on the paired differences (no distributional assumption; with n units the
smallest attainable p is 2 / 2^n, e.g. 0.25 for 3 seeds -- say so before calling a difference significant).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._io import write_json
from .._specs import parse_spec
from ..attention.registry import STACK

__all__ = ["CompareConfig", "Entry", "run_comparison", "sign_flip_p_value", "summarise"]

SENTENCE_TASKS = ("mr", "cr", "subj", "mpqa")
# the Cluster-Former paper's stack (a label beside the registered names: attention.registry.STACK): sliding-window
# layers, the last a Cluster-Former layer
BUILT_IN_VARIANTS = {STACK: {"attention": "cluster-former", "train_args": ["--cluster-layers", "-1"]}}
# the entries every other is paired with in the summary (its columns "Δ vs full" and "Δ vs neural-clustering"); the
# first, full attention, also gives each entry's time_vs_full
REFERENCES = ("full", "neural-clustering")
# the score of each task and which way is better (default: accuracy, higher)
SCORE = {"wikiqa": ("map", "higher"), "shakespeare-char": ("bpc", "lower"), "multi30k": ("bleu", "higher"),
         "mlm": ("perplexity", "lower")}
# train flags that compare sets per run; a variant may add --cluster-layers, nothing else of these
RESERVED = {"--task", "--attention", "--attention-options", "--seed", "--out", "--fold", "--folds", "--cv",
            "--resume"}


@dataclass(frozen=True)
class Entry:
    """One column of the comparison: a label, the mechanism it trains, its options and its own train flags."""

    label: str
    mechanism: str
    options: dict[str, Any]
    train_args: tuple[str, ...] = ()

    @property
    def directory(self) -> str:
        """The label as a directory name: ``nc:k=4,look_back=2`` -> ``nc--k-4--look_back-2``."""
        return re.sub(r"[:,]", "--", self.label).replace("=", "-")


@dataclass
class CompareConfig:
    tasks: list[str]
    attention: list[str]  # labels: registered names, NAME:key=value specs, names defined in variants, STACK
    out: str
    seeds: list[int] = field(default_factory=lambda: [0])
    folds: int | None = None  # sentence tasks: run CV folds 0..folds-1 (seed = the first seed) instead of seeds
    options: dict[str, dict[str, Any]] = field(default_factory=dict)  # label -> attention options
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)  # label -> {attention, options, train_args}
    train_args: list[str] = field(default_factory=list)  # passed to every `clusterformer train`
    jobs: int = 1
    keys_per_query: int | None = None  # one budget for every entry whose budget an option sets
    summary_only: bool = False  # write the summary of the finished runs; train nothing
    entries: list[Entry] = field(init=False)  # one per label of `attention`, resolved and validated

    def __post_init__(self) -> None:
        from ..train.tasks import TASKS

        for task in self.tasks:
            if task not in TASKS:
                raise ValueError(f"--tasks: unknown task {task!r}; expected some of {', '.join(TASKS)}")
        if not self.attention:
            raise ValueError("--attention must name at least one mechanism")
        if len(set(self.attention)) != len(self.attention):
            raise ValueError(f"--attention names a label twice: {', '.join(self.attention)}")
        unknown = sorted(set(self.options) - set(self.attention))
        if unknown:
            raise ValueError(f"--options names mechanisms that are not compared: {', '.join(unknown)}")
        unused = sorted(set(self.variants) - set(self.attention))
        if unused:
            raise ValueError(f"--variants defines labels that --attention does not name: {', '.join(unused)}")
        if not self.seeds:
            raise ValueError("--seeds must name at least one seed")
        if self.folds is not None and self.folds < 2:
            raise ValueError(f"--folds must be >= 2, got {self.folds}")
        if isinstance(self.jobs, bool) or not isinstance(self.jobs, int) or self.jobs < 1:
            raise ValueError(f"--jobs must be a positive int, got {self.jobs!r}")
        _check_train_args("train flags", self.train_args, RESERVED | {"--cluster-layers"})
        if self.keys_per_query is not None and (isinstance(self.keys_per_query, bool) or
                                                not isinstance(self.keys_per_query, int) or self.keys_per_query < 1):
            raise ValueError(f"--keys-per-query must be a positive int, got {self.keys_per_query!r}")
        self.entries = [self._entry(label) for label in self.attention]
        for task in self.tasks:  # budgets that cannot be met fail now, not hours into the grid
            for entry in self.entries:
                self.options_for(task, entry)
        directories = [e.directory for e in self.entries]
        if len(set(directories)) != len(directories):
            raise ValueError(f"--attention: labels that differ only in punctuation share a directory: "
                             f"{', '.join(self.attention)}")

    def _entry(self, label: str) -> Entry:
        """Resolve a label to its mechanism, options (validated by the registry now, not hours into the grid) and
        train flags."""
        from ..attention.registry import make_options, names

        variant = self.variants.get(label, BUILT_IN_VARIANTS.get(label))
        if variant is not None:
            if not isinstance(variant, dict) or "attention" not in variant:
                raise ValueError(f"--variants: {label!r} must be an object with an 'attention' mechanism name")
            extra = sorted(set(variant) - {"attention", "options", "train_args"})
            if extra:
                raise ValueError(f"--variants: {label!r} has unknown fields {', '.join(extra)}; expected "
                                 "attention, options, train_args")
            mechanism, options = variant["attention"], dict(variant.get("options", {}))
            train_args = variant.get("train_args", [])
            if not isinstance(train_args, list) or not all(isinstance(a, str) for a in train_args):
                raise ValueError(f"--variants: {label!r} train_args must be a list of strings")
            _check_train_args(f"--variants {label!r} train_args", train_args, RESERVED)
        else:
            mechanism, options = parse_spec(label)
            train_args = []
        if mechanism not in names():
            raise ValueError(f"--attention: unknown mechanism {mechanism!r} in {label!r}; available: "
                             f"{', '.join(names())}, {STACK}, or a label defined by --variants")
        options.update(self.options.get(label, {}))
        try:
            make_options(mechanism, options)
        except ValueError as error:
            raise ValueError(f"--attention {label!r}: {error}") from None
        return Entry(label, mechanism, options, tuple(train_args))


    def options_for(self, task: str, entry: Entry) -> dict[str, Any]:
        """The attention options of ``entry``'s runs on ``task``: its own, with the budget's merged over them."""
        if self.keys_per_query is None:
            return dict(entry.options)
        from ..attention.registry import make_options

        length, causal = run_shape(task, [*self.train_args, *entry.train_args])
        try:
            budget = make_options(entry.mechanism, entry.options).for_budget(self.keys_per_query, length, causal)
        except ValueError as error:
            if "no option that sets" in str(error):
                return dict(entry.options)  # full, clustered: every query reads every key
            raise ValueError(f"--keys-per-query {self.keys_per_query} for {entry.label!r} on {task}: {error}") from None
        return {**entry.options, **budget}


def run_shape(task: str, train_args: list[str]) -> tuple[int, bool]:
    """The sequence length (``--max-len``, default 256) and whether the task's model is causal, from train flags."""
    length, task_options = 256, {}
    for i, arg in enumerate(train_args):
        name, _, value = arg.partition("=")
        if not value and i + 1 < len(train_args):
            value = train_args[i + 1]
        if name == "--max-len":
            length = int(value)
        elif name == "--task-options":
            task_options = json.loads(value)
    from ..data.recall import RECALL_TASKS

    causal = task == "shakespeare-char" or (task in RECALL_TASKS and task_options.get("form", "causal") == "causal")
    return length, causal


def _check_train_args(what: str, args: list[str], reserved: set[str]) -> None:
    clash = sorted(reserved & {a.split("=")[0] for a in args})
    if clash:
        raise ValueError(f"{what}: {', '.join(clash)} are set by compare itself; leave them out")


def _units(config: CompareConfig, task: str) -> list[tuple[str, list[str]]]:
    """(unit name, its train flags) per run of one task and entry."""
    if config.folds is not None and task in SENTENCE_TASKS:
        seed = config.seeds[0]
        return [(f"fold{f}", ["--seed", str(seed), "--fold", str(f), "--folds", str(config.folds)])
                for f in range(config.folds)]
    return [(f"seed{s}", ["--seed", str(s)]) for s in config.seeds]


def _per_seed(args: list[str], unit_flags: list[str]) -> list[str]:
    """``args`` with ``{seed}`` replaced by the unit's ``--seed`` (its flags hold it)."""
    seed = unit_flags[unit_flags.index("--seed") + 1]
    return [arg.replace("{seed}", seed) for arg in args]


@dataclass
class _Run:
    number: int
    task: str
    entry: Entry
    unit: str
    directory: Path
    argv: list[str]
    started: float = 0.0


def _check_defaults(config: CompareConfig, pending: list[_Run]) -> None:
    """Refuse to add runs to an entry whose finished runs were trained under older defaults of its mechanism
    (``DEFAULTS_VERSION``): one summary row would average two configurations under one label."""
    from ..attention.registry import defaults_versions

    current = defaults_versions()
    for (task, _label), entry in {(run.task, run.entry.label): run.entry for run in pending}.items():
        directory = Path(config.out) / task / entry.directory
        for metrics_file in sorted(directory.glob("*/metrics.json")):
            recorded = json.loads(metrics_file.read_text()).get("defaults_versions") or {}
            if recorded.get(entry.mechanism, 1) < current.get(entry.mechanism, 1):
                raise ValueError(f"{metrics_file.parent} ran {entry.mechanism} under its earlier defaults (version "
                                 f"{recorded.get(entry.mechanism, 1)}, now {current[entry.mechanism]}): new runs of "
                                 f"{entry.label!r} would not be the same configuration; use another --out, or name "
                                 f"the options those runs had (docs/ARCHITECTURE.md, \"Defaults that change\")")


def run_comparison(config: CompareConfig, log: Callable[[str], None] = print) -> dict:
    """Run (or resume) the grid, ``config.jobs`` trainings at a time, then write and return the summary."""
    grid = [(task, entry, unit, flags) for task in config.tasks for entry in config.entries
            for unit, flags in _units(config, task)]
    if config.keys_per_query is not None:
        for task in config.tasks:
            for entry in config.entries:
                options = config.options_for(task, entry)
                log(f"budget {config.keys_per_query} keys read per query, {task} {entry.label}: "
                    + (json.dumps(options) if options != entry.options else "no option sets it; runs as it is"))
    pending: list[_Run] = []
    for i, (task, entry, unit, flags) in enumerate(grid, start=1):
        run_dir = Path(config.out) / task / entry.directory / unit
        if (run_dir / "metrics.json").is_file():
            log(f"[{i}/{len(grid)}] {task} {entry.label} {unit}: done, skipped")
            continue
        if config.summary_only:
            log(f"[{i}/{len(grid)}] {task} {entry.label} {unit}: not finished, left out (--summary-only)")
            continue
        resume = ["--resume"] if (run_dir / "checkpoint.pt").is_file() else []
        argv = [sys.executable, "-m", "clusterformer", "train", "--task", task, "--attention", entry.mechanism,
                "--attention-options", json.dumps(config.options_for(task, entry)), "--out", str(run_dir),
                "--no-progress", *flags,
                *_per_seed([*config.train_args, *entry.train_args], flags), *resume]
        pending.append(_Run(i, task, entry, unit, run_dir, argv))
    _check_defaults(config, pending)
    _run_all(pending, len(grid), config.jobs, log)
    summary = summarise(config)
    write_json(Path(config.out) / "summary.json", summary)
    (Path(config.out) / "summary.md").write_text(summary_markdown(summary))
    log(f"wrote {Path(config.out) / 'summary.json'} and summary.md")
    return summary


def _run_all(runs: list[_Run], total: int, jobs: int, log: Callable[[str], None]) -> None:
    """Run the trainings ``jobs`` at a time; each finished run's peak resident memory (``os.wait4``: that child's
    alone) goes into its ``metrics.json``. A failure stops launching new runs, lets the running ones finish (they
    are kept), and raises."""
    env = dict(os.environ)
    if jobs > 1 and "OMP_NUM_THREADS" not in env:  # one run alone keeps torch's own choice of threads
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
    # running: pid -> (run, its Popen). The Popen objects are kept alive on purpose: one that is dropped while its
    # child runs goes to subprocess's list of orphans, which the next Popen() reaps -- and os.wait4 below would then
    # never see that child (ChildProcessError, or a run lost).
    queue, running, failed = list(runs), {}, []
    while queue or running:
        while queue and len(running) < jobs and not failed:
            run = queue.pop(0)
            run.directory.mkdir(parents=True, exist_ok=True)
            with open(run.directory / "train.log", "a") as out:
                proc = subprocess.Popen(run.argv, stdout=out, stderr=subprocess.STDOUT, env=env)
            run.started = time.time()
            running[proc.pid] = (run, proc)
            log(f"[{run.number}/{total}] {run.task} {run.entry.label} {run.unit}: "
                f"{'resuming' if '--resume' in run.argv else 'running'}")
        if not running:
            break
        pid, status, usage = os.wait4(-1, 0)
        if pid not in running:  # a child that is not one of our runs
            continue
        run, proc = running.pop(pid)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: the Popen must not wait for it again
        metrics_path = run.directory / "metrics.json"
        if proc.returncode != 0 or not metrics_path.is_file():
            failed.append(f"{run.task} {run.entry.label} {run.unit} (exit {proc.returncode}; "
                          f"see {run.directory / 'train.log'})")
            log(f"[{run.number}/{total}] {run.task} {run.entry.label} {run.unit}: FAILED")
            continue
        metrics = json.loads(metrics_path.read_text())
        peak_mb = usage.ru_maxrss / 1024  # kilobytes on Linux
        metrics["peak_rss_mb"] = max(peak_mb, metrics.get("peak_rss_mb", 0.0))  # a resumed run keeps the larger
        write_json(metrics_path, metrics)
        log(f"[{run.number}/{total}] {run.task} {run.entry.label} {run.unit}: finished in "
            f"{time.time() - run.started:.0f} s")
    if failed:
        raise RuntimeError(f"training failed: {'; '.join(failed)}; run the same compare command again to resume")


def sign_flip_p_value(differences: list[float]) -> float:
    """Two-sided p-value of the exact sign-flip permutation test of mean(differences) = 0 (paired units)."""
    n = len(differences)
    if n == 0:
        return math.nan
    observed = abs(sum(differences))
    count = sum(abs(sum(s * d for s, d in zip(signs, differences, strict=True))) >= observed - 1e-12
                for signs in itertools.product((1, -1), repeat=n))  # 2^n sign patterns: n is a few seeds
    return count / 2 ** n


def _mean_std(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return mean, std


def summarise(config: CompareConfig) -> dict:
    """Per task and mechanism: score mean / std over the units that finished, time, memory, paired differences;
    and where the runs ran (machine, torch, threads) and their summed wall time."""
    tasks, machines, wall, finished = {}, set(), 0.0, 0
    for task in config.tasks:
        metric, better = SCORE.get(task, ("accuracy", "higher"))
        rows: dict[str, dict] = {}
        for entry in config.entries:
            name = entry.label
            runs = {}
            for unit, _ in _units(config, task):
                path = Path(config.out) / task / entry.directory / unit / "metrics.json"
                if path.is_file():
                    runs[unit] = json.loads(path.read_text())
            if not runs:
                continue
            for r in runs.values():
                machines.add(f"{r.get('machine', '?')}, {r.get('device', '?')}, torch {r.get('torch', '?')}, "
                             f"{r.get('threads', '?')} thread(s)")
                wall += r.get("wall_seconds", 0.0)
                finished += 1
            scores = {u: r["metrics"][metric] for u, r in runs.items()}
            mean, std = _mean_std(list(scores.values()))
            seconds, _ = _mean_std([r["seconds_per_epoch"] for r in runs.values()])
            rows[name] = {"metric": metric, "mean": mean, "std": std, "n": len(scores), "scores": scores,
                          "seconds_per_epoch": seconds, "peak_rss_mb": max(r.get("peak_rss_mb", math.nan)
                                                                             for r in runs.values()),
                          **_keys(config, task, entry, runs)}
            recall = [r["metrics"]["key_recall"] for r in runs.values() if "key_recall" in r["metrics"]]
            if recall:  # the recall tasks: key recall per layer, mean over units
                rows[name]["key_recall"] = {layer: sum(u[layer]["key_recall"] for u in recall) / len(recall)
                                            for layer in recall[0]}
                if all("key_argmax" in u[layer] for u in recall for layer in u):  # older runs: recall only
                    rows[name]["key_argmax"] = {layer: sum(u[layer]["key_argmax"] for u in recall) / len(recall)
                                                for layer in recall[0]}
            device_peaks = [r["peak_device_mb"] for r in runs.values() if "peak_device_mb" in r]
            if device_peaks:  # GPU runs: the accelerator's peak, the memory that limits them
                rows[name]["peak_device_mb"] = max(device_peaks)
        for name, row in rows.items():
            for reference in REFERENCES:
                if reference == name or reference not in rows:
                    continue
                paired = sorted(set(row["scores"]) & set(rows[reference]["scores"]))
                diffs = [row["scores"][u] - rows[reference]["scores"][u] for u in paired]
                row[f"vs_{reference}"] = {"mean_difference": sum(diffs) / len(diffs) if diffs else math.nan,
                                          "pairs": len(diffs), "p_value": sign_flip_p_value(diffs)}
            full = REFERENCES[0]
            if full in rows:
                row["time_vs_full"] = row["seconds_per_epoch"] / rows[full]["seconds_per_epoch"]
        tasks[task] = {"metric": metric, "better": better, "mechanisms": rows}
    return {"tasks": tasks, "runs_finished": finished, "wall_seconds": wall, "machines": sorted(machines),
            "units": "folds" if config.folds else "seeds", "seeds": config.seeds,
            "folds": config.folds, "train_args": config.train_args, "keys_per_query": config.keys_per_query,
            "entries": {e.label: {"attention": e.mechanism, "options": e.options, "train_args": list(e.train_args)}
                        for e in config.entries},
            "test": "exact two-sided sign-flip permutation test on paired differences"}


def _or_zero(value: float | None) -> float:
    return 0 if value is None else value


def _keys(config: CompareConfig, task: str, entry: Entry, runs: dict[str, dict]) -> dict[str, int | None]:
    """An entry's budgets on ``task``: ``keys_read`` (also as ``keys_per_query``) and ``keys_mixed``, the largest of
    its runs' records; runs recorded before ``keys_mixed`` existed recorded an earlier count as ``keys_per_query``,
    so then both come from the entry's options at the runs' length (None where they cannot be worked out)."""
    if all("keys_mixed" in r for r in runs.values()):
        read = max((r.get("keys_per_query") for r in runs.values()), key=_or_zero)
        mixed = max((r.get("keys_mixed") for r in runs.values()), key=_or_zero)
    else:
        from ..attention.registry import make_options

        try:
            length, causal = run_shape(task, [*config.train_args, *entry.train_args])
            options = make_options(entry.mechanism, config.options_for(task, entry))
            read, mixed = options.keys_read(length, causal), options.keys_mixed(length, causal)
        except ValueError:
            read = mixed = None
    return {"keys_per_query": read, "keys_read": read, "keys_mixed": mixed}


def summary_markdown(summary: dict) -> str:
    lines = [f"Units: {summary['units']}; paired test: {summary['test']}.",
             f"Runs finished: {summary['runs_finished']}, {summary['wall_seconds'] / 3600:.2f} h of wall time in all, "
             f"on {'; '.join(summary['machines']) or '-'}.", "", *_overview(summary)]
    for task, block in summary["tasks"].items():
        gpu = any("peak_device_mb" in row for row in block["mechanisms"].values())
        recall = any("key_recall" in row for row in block["mechanisms"].values())
        lines += [f"## {task} ({block['metric']}, {block['better']} is better)", "",
                  "| mechanism | keys read | keys mixed | score (mean ± std, n) | Δ vs full (p) | "
                  "Δ vs neural-clustering (p) | s/epoch | time vs full | peak RSS MB |"
                  + (" peak GPU MB |" if gpu else "") + (" key recall (argmax) per layer |" if recall else ""),
                  "|---|---|---|---|---|---|---|---|---|" + ("---|" if gpu else "") + ("---|" if recall else "")]
        for name, row in block["mechanisms"].items():
            lines.append(f"| {name} | {row.get('keys_read', row.get('keys_per_query')) or '—'} | "
                         f"{row.get('keys_mixed') or '—'} | {row['mean']:.4f} ± {row['std']:.4f} "
                         f"({row['n']}) | "
                         f"{_difference(row.get('vs_full'))} | {_difference(row.get('vs_neural-clustering'))} | "
                         f"{row['seconds_per_epoch']:.1f} | "
                         f"{_ratio(row.get('time_vs_full'))} | {row['peak_rss_mb']:.0f} |"
                         + (f" {row.get('peak_device_mb', math.nan):.0f} |" if gpu else "")
                         + (f" {_recall_cell(row.get('key_recall'), row.get('key_argmax'))} |" if recall else ""))
        lines.append("")
    return "\n".join(lines)


def _overview(summary: dict) -> list[str]:
    """Entries as rows, tasks as columns (the papers' table layout): score mean ± std, then time per epoch
    relative to full's."""
    tasks = summary["tasks"]
    labels = _entry_labels(tasks.values())
    if not labels:
        return []
    head = [f"{task} ({block['metric']})" for task, block in tasks.items()]
    lines = ["## Overview: score mean ± std over units; time per epoch / full's", "",
             "| entry | " + " | ".join(head) + " | " + " | ".join(f"time {task}" for task in tasks) + " |",
             "|---" * (1 + 2 * len(tasks)) + "|"]
    for label in labels:
        scores, times, _ = _cells(label, tasks.values())
        lines.append(f"| {label} | " + " | ".join(scores) + " | " + " | ".join(times) + " |")
    return [*lines, ""]


def _entry_labels(blocks) -> list[str]:
    """Every entry of these task blocks, in first-seen order."""
    return list(dict.fromkeys(label for block in blocks for label in block["mechanisms"]))


def _cells(label: str, blocks) -> tuple[list[str], list[str], list[dict | None]]:
    """An entry's score cells (mean ± std) and time cells (time per epoch / full's) over task blocks, "—" where it
    has no runs, and its rows."""
    rows = [block["mechanisms"].get(label) for block in blocks]
    scores = [f"{r['mean']:.4f} ± {r['std']:.4f}" if r else "—" for r in rows]
    times = [_ratio(r.get("time_vs_full")) if r else "—" for r in rows]
    return scores, times, rows


def grids_table(grids: list[tuple[str, dict]]) -> str:
    """One table across several comparisons (the Long Range Arena paper's layout): entries as rows, one score
    column per (grid, task), the average of the accuracy columns (LRA's "Avg"; other metrics such as MAP or bits
    per character are shown but not averaged), then each column's time per epoch relative to full's in the same
    grid. ``grids``: (name, summary) pairs, e.g. the directory name and its ``summary.json``."""
    for name, summary in grids:
        if not isinstance(summary, dict) or not isinstance(summary.get("tasks"), dict):
            raise ValueError(f"grid {name!r}: not a comparison summary (no 'tasks')")
    counts: dict[str, int] = {}
    for _, summary in grids:
        for task in summary["tasks"]:
            counts[task] = counts.get(task, 0) + 1
    columns = [(f"{task} ({name})" if counts[task] > 1 else task, block)  # the grid's name where a task repeats
               for name, summary in grids for task, block in summary["tasks"].items()]
    blocks = [block for _, block in columns]
    averaged = [block.get("metric") == "accuracy" for block in blocks]
    lines = ["| entry | " + " | ".join(f"{h} {b['metric']}" for h, b in columns) + " | avg accuracy (" +
             f"{sum(averaged)} columns) | " + " | ".join(f"time {h}" for h, _ in columns) + " |",
             "|---" * (2 + 2 * len(columns)) + "|"]
    for label in _entry_labels(blocks):
        scores, times, rows = _cells(label, blocks)
        accuracies = [r["mean"] for r, a in zip(rows, averaged, strict=True) if a and r]
        average = (f"{sum(accuracies) / len(accuracies):.4f}" if len(accuracies) == sum(averaged) and accuracies
                   else "—")  # only over a full row: a missing task would bias the average
        lines.append(f"| {label} | " + " | ".join(scores) + f" | {average} | " + " | ".join(times) + " |")
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    """A time ratio to full's, or "—" in a grid without full (not "nan")."""
    return "—" if value is None else f"{value:.2f}"


def _recall_cell(recall: dict | None, argmax: dict | None = None) -> str:
    """Key recall per layer, in layer order, with the share where the needed key outweighs every other key in
    brackets when the runs measured it: "0.12 (0.05) / 0.98 (0.90)"."""
    if not recall:
        return "—"
    return " / ".join(f"{value:.2f}" + (f" ({argmax[layer]:.2f})" if argmax else "") for layer, value in recall.items())


def _difference(d: dict | None) -> str:
    """The paired difference to a reference; "—" without one, or without a unit both finished (no pair)."""
    if d is None or not d["pairs"]:
        return "—"
    return f"{d['mean_difference']:+.4f} ({d['p_value']:.2f}, {d['pairs']} pairs)"


def plot_comparison(summary: dict, path: str | Path) -> Path:
    """The speed-accuracy picture, one panel per task: x = time per epoch relative to full, y = score, marker area
    proportional to peak memory (in the style of the Long Range Arena paper's figure)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib (pip install matplotlib)") from None
    tasks = list(summary["tasks"].items())
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4), squeeze=False)
    for ax, (task, block) in zip(axes[0], tasks, strict=True):
        rows = block["mechanisms"]
        # marker size: the accelerator's peak for GPU grids, else the process's peak RSS
        key = "peak_device_mb" if any("peak_device_mb" in r for r in rows.values()) else "peak_rss_mb"
        memory = [r.get(key, math.nan) for r in rows.values() if r.get(key, math.nan) == r.get(key, math.nan)]
        scale = 300 / max(memory) if memory else 1.0
        for name, row in rows.items():
            x = row.get("time_vs_full", math.nan)
            size = row[key] * scale if row.get(key, math.nan) == row.get(key, math.nan) else 30
            ax.scatter([x], [row["mean"]], s=size, alpha=0.6)
            ax.errorbar([x], [row["mean"]], yerr=[row["std"]], fmt="none", ecolor="gray")
            ax.annotate(name, (x, row["mean"]), fontsize=8, xytext=(4, 4), textcoords="offset points")
        ax.set_title(task)
        ax.set_xlabel("time per epoch / full's")
        ax.set_ylabel(block["metric"])
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
