"""``clusterformer demo``: a benchmark and a short training of full, neural-clustering and cluster-select (CPU,
minutes)."""

from __future__ import annotations

import argparse

from ._args import int_list, log


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="benchmark + short training of full, neural-clustering and cluster-select "
                                    "(CPU, minutes)")
    p.add_argument("--out", default="out/demo", help="output directory")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--bench-lengths", type=int_list, default=[1024, 2048, 4096])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--with", dest="also", type=_names, default=None, metavar="NAMES",
                   help="comma-separated mechanisms trained beside full and neural-clustering, each with its "
                        "defaults: any that trains a model (not the cache readers); default: cluster-select; '' for "
                        "none")
    p.set_defaults(func=run)


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def run(args: argparse.Namespace) -> int:
    from ..apps.demo import DemoConfig, run_demo

    try:
        also = {} if args.also is None else {"also": args.also}
        config = DemoConfig(train_steps=args.steps, length=args.length, seed=args.seed,
                            bench_lengths=tuple(args.bench_lengths), **also)
    except ValueError as exc:
        raise SystemExit(f"clusterformer demo: error: --with: {exc}") from None
    run_demo(args.out, config, log=log)
    return 0
