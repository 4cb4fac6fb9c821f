"""``clusterformer report``: markdown table (and plot) of training runs, one table across the summaries of
several ``clusterformer compare`` grids (``--grids``, the Long Range Arena paper's layout), or every generated block
of the docs rewritten (``--docs``) or checked (``--docs --check``) from its records (:mod:`..apps.docs_report`)."""

from __future__ import annotations

import argparse

from ._args import log


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="markdown table (and plot) of training runs")
    p.add_argument("runs", nargs="*", help="run directories (or metrics.json files)")
    p.add_argument("--grids", nargs="+", default=None, metavar="DIR",
                   help="instead of runs: comparison directories (or their summary.json); one table, entries as "
                        "rows, a column per grid and task, the average accuracy, times relative to full")
    p.add_argument("--plot", default=None, help="accuracy against seconds per epoch (PNG)")
    p.add_argument("--docs", nargs="*", default=None, metavar="PATH",
                   help="instead of runs: rewrite every <!-- report: ... --> block (tables and figures) of these "
                        "markdown files or folders (default: README.md and docs/**/*.md) from its records")
    p.add_argument("--check", action="store_true",
                   help="with --docs: write nothing; print a diff of each block that differs from its records "
                        "and exit 1 if any does")
    p.add_argument("--root", default=".", help="with --docs: the folder the markers' paths are relative to "
                                                "(default: the current one, the repository's root)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..train.report import load_runs, plot_metric_vs_time, results_table

    if args.docs is not None:
        if args.runs or args.plot or args.grids is not None:
            raise ValueError("--docs takes markdown files or folders only: give no run directories, --grids or "
                             "--plot")
        return _docs(args)
    if args.check:
        raise ValueError("--check goes with --docs")
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
    from ..apps.docs_report import load_summary

    grids = []
    for text in paths:
        try:
            grids.append(load_summary(text))
        except ValueError as exc:
            raise ValueError(f"--grids: {exc}") from None
    return grids_table(grids)


def _docs(args: argparse.Namespace) -> int:
    """Rewrite (or with --check compare) every generated block; 1 when a block differs or cannot be rendered."""
    from ..apps.docs_report import update_docs

    result = update_docs(args.docs or None, args.root, check=args.check, log=log)
    for diff in result.diffs if args.check else []:
        print(diff)
    for error in result.errors:
        log(f"error: {error}")
    if args.check:
        log(f"{result.blocks - len(result.diffs) - len(result.errors)} of {result.blocks} generated block(s) match "
            f"their records, {len(result.diffs)} differ" + (f", {len(result.errors)} cannot be rendered"
                                                           if result.errors else ""))
        if result.diffs:
            log("run `clusterformer report --docs` to rewrite them")
    else:
        log(f"{result.blocks} generated block(s), {len(result.written)} file(s) rewritten"
            + (f"; {len(result.errors)} error(s)" if result.errors else ""))
    return 1 if result.errors or (args.check and result.diffs) else 0
