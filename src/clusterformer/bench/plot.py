"""Log-log plots of time and memory against sequence length (in the style of the paper's Figs. 3-4)."""

from __future__ import annotations

from pathlib import Path


def plot_attention_benchmark(records: list[dict], path: str | Path, title: str | None = None) -> Path:
    """Two panels: forward+backward (solid) and forward (dashed) time, and peak memory, against N."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise RuntimeError("plotting needs matplotlib: pip install 'clusterformer[plot]'") from exc

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    records = [r for r in records if "error" not in r]  # failed configurations (e.g. out of memory)
    names = list(dict.fromkeys(r["name"] for r in records))
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.6))
    for i, name in enumerate(names):
        rows = sorted((r for r in records if r["name"] == name), key=lambda r: r["length"])
        n = [r["length"] for r in rows]
        color = f"C{i % 10}"
        ax_t.plot(n, [r["fwd_bwd_ms"] for r in rows], "o-", color=color, label=name)
        ax_t.plot(n, [r["fwd_ms"] for r in rows], "s--", color=color, alpha=0.5)
        ax_m.plot(n, [r["peak_mem_mb"] for r in rows], "o-", color=color, label=name)
    for ax, ylabel in ((ax_t, "time per step (ms, median)\nsolid: fwd+bwd, dashed: fwd"),
                       (ax_m, "peak memory of fwd+bwd (MB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_m.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))  # one legend, outside the data
    first = records[0] if records else {}
    fig.suptitle(title or (
        f"attention layer, B={first.get('batch')}, H={first.get('heads')}, D={first.get('head_dim')}, "
        f"{first.get('device')}, {first.get('dtype')}"
    ))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _pareto_front(points: list[tuple[float, float]], higher: bool) -> list[tuple[float, float]]:
    """The points no other point beats on both time (lower) and score (``higher`` or lower is better), by time."""
    front, best = [], None
    for x, y in sorted(points, key=lambda p: (p[0], -p[1] if higher else p[1])):
        if best is None or (y > best if higher else y < best):
            front.append((x, y))
            best = y
    return front


def plot_pareto(grids: list[tuple[str, dict]], path: str | Path, title: str | None = None) -> Path:
    """Score against training-step time relative to full attention's in the same grid (every entry of a grid runs
    the same steps per epoch, so the ratio of times per epoch is the ratio of step times), one panel per task over
    every grid that ran it: one colour per mechanism, one marker per grid, the seeds' scores as small dots and their
    mean ± std, and the Pareto front (no other entry both faster and better) as a dashed line, its entries named.
    Entries without a time relative to full's (a grid without full) are left out. ``grids``: (name, comparison
    summary) pairs."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib import ticker
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise RuntimeError("plotting needs matplotlib: pip install 'clusterformer[plot]'") from exc

    panels: dict[str, list[tuple[str, str, dict, dict]]] = {}  # task -> (grid, entry, row, block)
    for grid, summary in grids:
        for task, block in summary["tasks"].items():
            for label, row in block["mechanisms"].items():
                if row.get("time_vs_full") is not None:
                    panels.setdefault(task, []).append((grid, label, row, block))
    if not panels:
        raise ValueError("pareto: no entry with a time relative to full attention (grids without full?)")
    entries = {label: info for _, summary in grids for label, info in (summary.get("entries") or {}).items()}

    def mechanism(label: str) -> str:  # the entry's mechanism: its record, else the label's NAME of NAME:options
        return entries.get(label, {}).get("attention", label.split(":")[0])

    mechanisms = sorted({mechanism(label) for rows in panels.values() for _, label, _, _ in rows})
    colors = {m: f"C{i % 10}" for i, m in enumerate(mechanisms)}
    markers = {grid: "osD^v<>pPhX*"[i % 12] for i, (grid, _) in enumerate(grids)}
    cols = min(3, len(panels))
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 4.0 * nrows), squeeze=False)
    for ax, (task, rows) in zip(axes.flat, panels.items(), strict=False):
        higher = rows[0][3].get("better", "higher") == "higher"
        for grid, label, row, _ in rows:
            x, color = row["time_vs_full"], colors[mechanism(label)]
            scores = list((row.get("scores") or {}).values())
            ax.scatter([x] * len(scores), scores, s=8, color=color, alpha=0.4, linewidths=0)
            ax.errorbar([x], [row["mean"]], yerr=[row["std"]], fmt=markers[grid], color=color, ms=6, capsize=2)
        front = _pareto_front([(row["time_vs_full"], row["mean"]) for _, _, row, _ in rows], higher)
        ax.plot(*zip(*front, strict=True), "--", color="gray", lw=1, zorder=0)
        several = len({grid for grid, _, _, _ in rows}) > 1
        names: dict[tuple[float, float], list[str]] = {}  # the front's entries by name (several grids: the grid's)
        for grid, label, row, _ in rows:
            if (row["time_vs_full"], row["mean"]) in front:
                short = label if len(label) <= 32 else label[:31] + "…"
                names.setdefault((row["time_vs_full"], row["mean"]), []).append(
                    f"{short} ({grid})" if several else short)
        for point, labels in names.items():
            ax.annotate("\n".join(labels), point, fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_title(task, fontsize=10)
        ax.set_xlabel("training-step time / full attention's", fontsize=8)
        ax.set_ylabel(f"{rows[0][3]['metric']} ({'higher' if higher else 'lower'} is better)", fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles = [plt.Line2D([], [], marker="o", linestyle="", color=colors[m], label=m) for m in mechanisms]
    handles += [plt.Line2D([], [], marker=markers[g], linestyle="", color="black", label=g) for g, _ in grids]
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return path
