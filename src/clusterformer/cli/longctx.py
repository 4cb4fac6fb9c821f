"""``clusterformer longctx``: RULER-style long-context tasks and perplexity of a pretrained decoder LLM, dense
vs clustered key retrieval and its baselines (:mod:`clusterformer.apps.longctx`)."""

from __future__ import annotations

import argparse

from .._specs import split_specs
from ._args import int_list


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("longctx", help="long-context tasks of a pretrained decoder: dense vs cluster retrieval",
                       description=__doc__)
    p.add_argument("--model", default="smollm2", help="pretrained decoder (clusterformer.hf.PRETRAINED)")
    p.add_argument("--attention", default="sink-window,cluster-retrieval,cluster-retrieval:estimate_remainder=true",
                   help="comma-separated methods NAME[:key=value,...] (';' between methods when options hold "
                        "commas); dense is always run as the reference")
    p.add_argument("--budget", type=float, default=0.1,
                   help="keys per query for budgeted methods: a fraction (<= 1) or a count (> 1)")
    p.add_argument("--lengths", type=int_list, default=[1024, 2048, 4096, 8192])
    p.add_argument("--tasks", default="passkey,niah-multikey,variable-tracking")
    p.add_argument("--samples", type=int, default=3, help="samples per task and length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ppl-lengths", type=int_list, default=[], help="WikiText-2 test windows, e.g. 2048,4096")
    p.add_argument("--ppl-windows", type=int, default=2, help="windows per perplexity length")
    p.add_argument("--data-dir", default="../shared/data")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="results file; a rerun skips the samples it holds")
    p.add_argument("--plot", default=None, help="PNG: accuracy vs length per task, one line per method")
    p.set_defaults(func=run)


def _methods(text: str) -> list[str]:
    from ..attention.registry import DENSE

    return [DENSE, *[m for m in split_specs(text) if m != DENSE]]


def run(args: argparse.Namespace) -> int:
    from ..apps.longctx import LongContextConfig, markdown, run_longctx

    budget = args.budget if args.budget <= 1 else int(args.budget)
    config = LongContextConfig(model=args.model, methods=_methods(args.attention), budget=budget,
                               lengths=args.lengths, tasks=[t.strip() for t in args.tasks.split(",") if t.strip()],
                               samples=args.samples, seed=args.seed, ppl_lengths=args.ppl_lengths,
                               ppl_windows=args.ppl_windows, data_dir=args.data_dir, json=args.json,
                               threads=args.threads)
    results = run_longctx(config)
    print(markdown(results["summary"], config.methods))
    if args.plot:
        from ..apps.longctx import plot

        plot(results, config.methods, args.plot)
        print(f"wrote {args.plot}")
    return 0
