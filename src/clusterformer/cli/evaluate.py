"""``clusterformer eval``: evaluate a checkpoint on its task's test split."""

from __future__ import annotations

import argparse

from .._io import emit_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate a checkpoint on its task's test split")
    p.add_argument("--checkpoint", required=True, help="run directory or checkpoint file")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--device", default="auto")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..train import evaluate_checkpoint

    emit_json(evaluate_checkpoint(args.checkpoint, data_dir=args.data_dir, device=args.device), None)
    return 0
