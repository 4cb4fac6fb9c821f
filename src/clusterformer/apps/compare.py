"""``clusterformer compare``: every mechanism on every task over several seeds (or CV folds), resumable, summarised.

The grid is tasks x mechanisms x units (a mechanism is a registered name, or ``cluster-former-stack``: the
Cluster-Former paper's stack of sliding-window layers whose last layer is a Cluster-Former layer), a unit being a
seed (or, with ``folds``, a fold of the sentence tasks' CV).
Each run is ``clusterformer train`` in a subprocess (one process per run: its peak resident memory is its own, and a
crash loses one run) with the same flags for every mechanism -- equal budgets, equal model size -- writing into
``OUT/TASK/MECHANISM/seedS`` (or ``foldF``). A run whose ``metrics.json`` exists is skipped; one with a checkpoint
but no metrics is resumed (``--resume``); so an interrupted comparison continues where it stopped.

The summary (``OUT/summary.json`` and ``OUT/summary.md``) gives, per task and mechanism, the mean and sample standard
deviation of the task's score over units, seconds per epoch, the largest peak resident memory of its runs, and for
each mechanism its difference to ``full`` and to ``neural-clustering``, paired by unit, with the two-sided p-value of
an exact sign-flip permutation test on the paired differences (no distributional assumption; with n units the
smallest attainable p is 2 / 2^n, e.g. 0.25 for 3 seeds -- say so before calling a difference significant).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._io import write_json

__all__ = ["CompareConfig", "run_comparison", "sign_flip_p_value", "summarise"]

SENTENCE_TASKS = ("mr", "cr", "subj", "mpqa")
STACK = "cluster-former-stack"  # the Cluster-Former paper's stack: sliding-window layers, the last a Cluster-Former
STACK_FLAGS = ["--attention", "cluster-former", "--cluster-layers", "-1"]
# the score of each task and which way is better (default: accuracy, higher)
SCORE = {"wikiqa": ("map", "higher"), "shakespeare-char": ("bpc", "lower"), "multi30k": ("bleu", "higher")}


@dataclass
class CompareConfig:
    tasks: list[str]
    attention: list[str]
    out: str
    seeds: list[int] = field(default_factory=lambda: [0])
    folds: int | None = None  # sentence tasks: run CV folds 0..folds-1 (seed = the first seed) instead of seeds
    options: dict[str, dict[str, Any]] = field(default_factory=dict)  # mechanism -> attention options
    train_args: list[str] = field(default_factory=list)  # passed to every `clusterformer train`

    def __post_init__(self) -> None:
        from ..attention import names
        from ..train.tasks import TASKS

        for task in self.tasks:
            if task not in TASKS:
                raise ValueError(f"--tasks: unknown task {task!r}; expected some of {', '.join(TASKS)}")
        for name in self.attention:
            if name not in names() and name != STACK:
                raise ValueError(f"--attention: unknown mechanism {name!r}; available: {', '.join(names())}, {STACK}")
        unknown = sorted(set(self.options) - set(self.attention))
        if unknown:
            raise ValueError(f"--options names mechanisms that are not compared: {', '.join(unknown)}")
        if not self.seeds:
            raise ValueError("--seeds must name at least one seed")
        if self.folds is not None and self.folds < 2:
            raise ValueError(f"--folds must be >= 2, got {self.folds}")
        reserved = {"--task", "--attention", "--attention-options", "--seed", "--out", "--fold", "--folds", "--cv",
                    "--resume", "--cluster-layers"}
        clash = sorted(reserved & {a.split("=")[0] for a in self.train_args})
        if clash:
            raise ValueError(f"train flags {', '.join(clash)} are set by compare itself; leave them out")


def _units(config: CompareConfig, task: str) -> list[tuple[str, list[str]]]:
    """(unit name, its train flags) per run of one task and mechanism."""
    if config.folds is not None and task in SENTENCE_TASKS:
        seed = config.seeds[0]
        return [(f"fold{f}", ["--seed", str(seed), "--fold", str(f), "--folds", str(config.folds)])
                for f in range(config.folds)]
    return [(f"seed{s}", ["--seed", str(s)]) for s in config.seeds]


def run_comparison(config: CompareConfig, log: Callable[[str], None] = print) -> dict:
    """Run (or resume) the grid, then write and return the summary."""
    grid = [(task, name, unit, flags) for task in config.tasks for name in config.attention
            for unit, flags in _units(config, task)]
    for i, (task, name, unit, flags) in enumerate(grid, start=1):
        run_dir = Path(config.out) / task / name / unit
        if (run_dir / "metrics.json").is_file():
            log(f"[{i}/{len(grid)}] {task} {name} {unit}: done, skipped")
            continue
        resume = (run_dir / "checkpoint.pt").is_file()
        mechanism = STACK_FLAGS if name == STACK else ["--attention", name]
        argv = [sys.executable, "-m", "clusterformer", "train", "--task", task, *mechanism,
                "--attention-options", json.dumps(config.options.get(name, {})), "--out", str(run_dir),
                "--no-progress", *flags, *config.train_args, *(["--resume"] if resume else [])]
        log(f"[{i}/{len(grid)}] {task} {name} {unit}: {'resuming' if resume else 'running'}")
        started = time.time()
        peak_mb = _run(argv, run_dir)
        log(f"[{i}/{len(grid)}] {task} {name} {unit}: finished in {time.time() - started:.0f} s")
        metrics = json.loads((run_dir / "metrics.json").read_text())
        metrics["peak_rss_mb"] = max(peak_mb, metrics.get("peak_rss_mb", 0.0))  # a resumed run keeps the larger
        write_json(run_dir / "metrics.json", metrics)
    summary = summarise(config)
    write_json(Path(config.out) / "summary.json", summary)
    (Path(config.out) / "summary.md").write_text(summary_markdown(summary))
    log(f"wrote {Path(config.out) / 'summary.json'} and summary.md")
    return summary


def _run(argv: list[str], run_dir: Path) -> float:
    """Run one training in a subprocess; its peak resident memory in MB (``os.wait4``: this child's alone)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "train.log", "a") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0 or not (run_dir / "metrics.json").is_file():
        raise RuntimeError(f"training failed (exit {proc.returncode}); see {run_dir / 'train.log'}; run the same "
                           "compare command again to resume")
    return usage.ru_maxrss / 1024  # kilobytes on Linux


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
    """Per task and mechanism: score mean / std over the units that finished, time, memory, paired differences."""
    tasks = {}
    for task in config.tasks:
        metric, better = SCORE.get(task, ("accuracy", "higher"))
        rows: dict[str, dict] = {}
        for name in config.attention:
            runs = {}
            for unit, _ in _units(config, task):
                path = Path(config.out) / task / name / unit / "metrics.json"
                if path.is_file():
                    runs[unit] = json.loads(path.read_text())
            if not runs:
                continue
            scores = {u: r["metrics"][metric] for u, r in runs.items()}
            mean, std = _mean_std(list(scores.values()))
            seconds, _ = _mean_std([r["seconds_per_epoch"] for r in runs.values()])
            rows[name] = {"metric": metric, "mean": mean, "std": std, "n": len(scores), "scores": scores,
                          "seconds_per_epoch": seconds, "peak_rss_mb": max(r.get("peak_rss_mb", math.nan)
                                                                             for r in runs.values())}
        for name, row in rows.items():
            for reference in ("full", "neural-clustering"):
                if reference == name or reference not in rows:
                    continue
                paired = sorted(set(row["scores"]) & set(rows[reference]["scores"]))
                diffs = [row["scores"][u] - rows[reference]["scores"][u] for u in paired]
                row[f"vs_{reference}"] = {"mean_difference": sum(diffs) / len(diffs) if diffs else math.nan,
                                          "pairs": len(diffs), "p_value": sign_flip_p_value(diffs)}
            if "full" in rows:
                row["time_vs_full"] = row["seconds_per_epoch"] / rows["full"]["seconds_per_epoch"]
        tasks[task] = {"metric": metric, "better": better, "mechanisms": rows}
    return {"tasks": tasks, "units": "folds" if config.folds else "seeds", "seeds": config.seeds,
            "folds": config.folds, "train_args": config.train_args, "options": config.options,
            "test": "exact two-sided sign-flip permutation test on paired differences"}


def summary_markdown(summary: dict) -> str:
    lines = [f"Units: {summary['units']}; paired test: {summary['test']}.", ""]
    for task, block in summary["tasks"].items():
        lines += [f"## {task} ({block['metric']}, {block['better']} is better)", "",
                  "| mechanism | score (mean ± std, n) | Δ vs full (p) | Δ vs neural-clustering (p) | s/epoch | "
                  "time vs full | peak RSS MB |", "|---|---|---|---|---|---|---|"]
        for name, row in block["mechanisms"].items():
            lines.append(f"| {name} | {row['mean']:.4f} ± {row['std']:.4f} ({row['n']}) | "
                         f"{_difference(row.get('vs_full'))} | {_difference(row.get('vs_neural-clustering'))} | "
                         f"{row['seconds_per_epoch']:.1f} | "
                         f"{row.get('time_vs_full', math.nan):.2f} | {row['peak_rss_mb']:.0f} |")
        lines.append("")
    return "\n".join(lines)


def _difference(d: dict | None) -> str:
    return "—" if d is None else f"{d['mean_difference']:+.4f} ({d['p_value']:.2f}, {d['pairs']} pairs)"


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
        memory = [r["peak_rss_mb"] for r in rows.values() if r["peak_rss_mb"] == r["peak_rss_mb"]]
        scale = 300 / max(memory) if memory else 1.0
        for name, row in rows.items():
            x = row.get("time_vs_full", math.nan)
            size = row["peak_rss_mb"] * scale if row["peak_rss_mb"] == row["peak_rss_mb"] else 30
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
