"""``clusterformer report``: markdown table (and plot) of training runs, or one table across the summaries of
several ``clusterformer compare`` grids (``--grids``, the Long Range Arena paper's layout)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ._args import log


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="markdown table (and plot) of training runs")
    p.add_argument("runs", nargs="*", help="run directories (or metrics.json files)")
    p.add_argument("--grids", nargs="+", default=None, metavar="DIR",
                   help="instead of runs: comparison directories (or their summary.json); one table, entries as "
                        "rows, a column per grid and task, the average accuracy, times relative to full")
    p.add_argument("--plot", default=None, help="accuracy against seconds per epoch (PNG)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..train.report import load_runs, plot_metric_vs_time, results_table

    if args.grids is not None:
        if args.runs or args.plot:
            raise ValueError("--grids takes comparison directories only: give no run directories and no --plot "
                             "(each grid draws its own with `compare --plot`)")
        print(_grids_table(args.grids))
        return 0
    if not args.runs:
        raise ValueError("give run directories (or metrics.json files), or --grids with comparison directories")
    runs = load_runs(args.runs)
    print(results_table(runs))
    if args.plot:
        log(f"wrote {plot_metric_vs_time(runs, args.plot)}")
    return 0


def _grids_table(paths: list[str]) -> str:
    from ..apps.compare import grids_table

    grids = []
    for text in paths:
        path = Path(text)
        summary = path / "summary.json" if path.is_dir() else path
        if not summary.is_file():
            raise ValueError(f"--grids: {text!r} is neither a comparison directory with summary.json nor a "
                             "summary.json file")
        name = (path if path.is_dir() else path.parent).name
        grids.append((name, json.loads(summary.read_text())))
    return grids_table(grids)
