"""Results tables and the accuracy-against-time plot from run directories (``out/metrics.json``)."""

from __future__ import annotations

from pathlib import Path

from .._io import read_json

__all__ = ["load_runs", "plot_metric_vs_time", "results_table"]

_METRIC = {"map_mrr": "map", "bpc": "bpc"}


def load_runs(paths: list[str | Path]) -> list[dict]:
    """metrics.json of each run directory (or file), with ``run_dir`` (where it was read) added; a missing or
    unreadable one raises ValueError naming it."""
    runs = []
    for path in paths:
        path = Path(path)
        file = path / "metrics.json" if path.is_dir() else path
        run = read_json(file, f"no metrics.json in {str(path)!r} (did the run finish?)")
        run["run_dir"] = str(file.parent)
        runs.append(run)
    return runs


def _headline(run: dict) -> tuple[str, float]:
    m = run["metrics"]
    if "bpc" in m:
        return "bpc", m["bpc"]
    if "perplexity" in m:
        return "masked perplexity", m["perplexity"]
    if "map" in m:
        return "MAP / MRR", m["map"]
    return "accuracy", m["accuracy"]


def results_table(runs: list[dict]) -> str:
    """One row per run: run directory, task, attention (with any non-default options), seed, metric, epochs,
    seconds per epoch, training and wall time, device."""
    lines = ["| run | task | attention | seed | metric | value | epochs | s / epoch | train s | wall s | device |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        name, _ = _headline(run)
        m = run["metrics"]
        if name == "bpc":
            value = f"{m['bpc']:.3f}"
        elif name == "MAP / MRR":
            value = f"{m['map']:.4f} / {m['mrr']:.4f}"
        else:
            value = f"{100 * m['accuracy']:.2f}" + (f" ± {100 * m['accuracy_std']:.2f}" if "accuracy_std" in m else "")
        config = run.get("config", {})
        options = ", ".join(f"{k}={v}" for k, v in (config.get("attention_options") or {}).items())
        attention = run["attention"] + (f" ({options})" if options else "")
        run_name = Path(run.get("run_dir") or config.get("out", "?")).name
        lines.append(
            f"| {run_name} | {run['task']} | {attention} | {config.get('seed', '?')} | "
            f"{name} | {value} | {run.get('epochs', 0):.2f} | "
            f"{run['seconds_per_epoch']:.1f} | {run.get('train_seconds', 0):.0f} | {run.get('wall_seconds', 0):.0f} | "
            f"{run.get('device', '?')} |"
        )
    return "\n".join(lines)


def plot_metric_vs_time(runs: list[dict], path: str | Path) -> Path:
    """Headline metric against training seconds per epoch, one point per run, one colour per attention."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in runs))
    attentions = list(dict.fromkeys(r["attention"] for r in runs))
    cols = min(4, len(tasks))
    rows = (len(tasks) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 3.0 * rows), squeeze=False)
    for ax, task in zip(axes.flat, tasks, strict=False):
        for run in (r for r in runs if r["task"] == task):
            name, value = _headline(run)
            color = f"C{attentions.index(run['attention']) % 10}"
            ax.scatter(run["seconds_per_epoch"], value if name == "bpc" else 100 * value, color=color, s=40,
                       label=run["attention"])
        ax.set_title(task, fontsize=10)
        ax.set_xlabel("seconds per epoch", fontsize=8)
        ax.set_ylabel({"bpc": "bits per char (lower is better)", "MAP / MRR": "MAP (%)"}.get(name, "accuracy (%)"),
                      fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    handles = [plt.Line2D([], [], marker="o", linestyle="", color=f"C{i % 10}", label=a)
               for i, a in enumerate(attentions)]
    fig.legend(handles=handles, loc="upper center", ncol=len(attentions), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
