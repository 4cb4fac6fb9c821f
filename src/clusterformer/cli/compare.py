"""``clusterformer compare``: the papers' comparison across the family -- every mechanism on every task, several
seeds (or CV folds), equal budgets, resumable, several runs at once -- summarised in ``OUT/summary.{json,md}``
(docs/results.md)."""

from __future__ import annotations

import argparse

from .._specs import split_specs
from ._args import json_object, log, name_list


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="every mechanism on every task over seeds/folds (resumable) + summary",
                       description="Run `clusterformer train` for each task x entry x seed (or fold) into "
                                   "OUT/TASK/LABEL/seedS, skipping finished runs and resuming interrupted ones, "
                                   "then write OUT/summary.json and OUT/summary.md. Flags after `--` go to every "
                                   "train run, e.g. -- --epochs 5 --dim 128.")
    p.add_argument("--tasks", required=True, type=lambda t: [v.strip() for v in t.split(",") if v.strip()],
                   help="comma-separated tasks, e.g. mr,cr,wikiqa,listops")
    p.add_argument("--attention", type=_labels, default=_labels("full,neural-clustering"),
                   help="comma-separated mechanisms, or 'all' (every registered one and cluster-former-stack); an "
                        "entry may carry options, NAME:key=value,... (e.g. neural-clustering:grouping=random; use ';' "
                        "between entries when options hold commas), or be a label defined by --variants; "
                        "cluster-former-stack is the paper's stack (sliding-window layers, the last Cluster-Former)")
    p.add_argument("--seeds", type=lambda t: [int(v) for v in t.split(",") if v.strip()], default=[0, 1, 2])
    p.add_argument("--folds", type=int, default=None,
                   help="sentence tasks (mr, cr, subj, mpqa): run these CV folds instead of the seeds")
    p.add_argument("--options", default=None, help='attention options per entry as JSON, e.g. '
                                                   '{"lsh": {"chunk_size": 32}}')
    p.add_argument("--variants", default=None,
                   help='labelled variants as JSON: {"LABEL": {"attention": NAME, "options": {...}, "train_args": '
                        '[...]}}, e.g. {"nc-no-losses": {"attention": "neural-clustering", "train_args": '
                        '["--clustering-weight", "0", "--centroid-sorting-weight", "0"]}}; name LABEL in --attention')
    p.add_argument("--jobs", type=int, default=1,
                   help="trainings at once (default 1); with more than one, each gets cpu_count/jobs threads "
                        "unless OMP_NUM_THREADS is set")
    p.add_argument("--keys-per-query", type=int, default=None,
                   help="one budget for every entry: the options that let each query see at most this many keys "
                        "at the runs' --max-len (full, clustered and improved-clustered read every key and run as "
                        "they are); use a new --out per budget")
    p.add_argument("--out", required=True, help="comparison directory")
    p.add_argument("--plot", default=None, help="also draw the speed-accuracy picture here (PNG)")
    p.add_argument("--summary-only", action="store_true",
                   help="train nothing: write OUT/summary.json and summary.md from the runs of the named entries "
                        "and seeds that have finished (e.g. a grid whose entries ran with different seeds)")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then flags for every train run")
    p.set_defaults(func=run)


def _labels(text: str) -> list[str]:
    from ..apps.compare import STACK

    if text.strip() == "all":
        return [*name_list("all"), STACK]
    labels = split_specs(text)
    if not labels:
        raise argparse.ArgumentTypeError(f"expected mechanism names, got {text!r}")
    return labels


def run(args: argparse.Namespace) -> int:
    from ..apps.compare import CompareConfig, plot_comparison, run_comparison

    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    options = json_object("--options", args.options, '{"lsh": {"chunk_size": 32}}')
    variants = json_object("--variants", args.variants,
                           '{"nc-no-losses": {"attention": "neural-clustering", "train_args": [...]}}')
    config = CompareConfig(tasks=args.tasks, attention=args.attention, out=args.out, seeds=args.seeds,
                           folds=args.folds, options=options, variants=variants, train_args=train_args,
                           jobs=args.jobs, keys_per_query=args.keys_per_query, summary_only=args.summary_only)
    summary = run_comparison(config, log=log)
    if args.plot:
        log(f"wrote {plot_comparison(summary, args.plot)}")
    return 0
