"""``clusterformer report``: markdown table (and plot) of training runs."""

from __future__ import annotations

import argparse

from ._args import log


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="markdown table (and plot) of training runs")
    p.add_argument("runs", nargs="+", help="run directories (or metrics.json files)")
    p.add_argument("--plot", default=None, help="accuracy against seconds per epoch (PNG)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..train.report import load_runs, plot_metric_vs_time, results_table

    runs = load_runs(args.runs)
    print(results_table(runs))
    if args.plot:
        log(f"wrote {plot_metric_vs_time(runs, args.plot)}")
    return 0
