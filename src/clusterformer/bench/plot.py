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
