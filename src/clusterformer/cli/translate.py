"""``clusterformer translate``: translate stdin (one sentence per line) with a trained translation model."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("translate", help="translate stdin line by line with a --task multi30k checkpoint")
    p.add_argument("--checkpoint", required=True, help="run directory or checkpoint of --task multi30k")
    p.add_argument("--beam", type=int, default=5, help="beam size (1 = greedy)")
    p.add_argument("--length-penalty", type=float, default=1.0, help="alpha of ((5 + L) / 6) ** alpha")
    p.add_argument("--batch-size", type=int, default=64, help="sentences per batch")
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-cache", action="store_true", help="recompute the decoder per token (the slow reference)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..apps.translate import load_translator

    if args.beam < 1:
        raise ValueError(f"--beam must be >= 1, got {args.beam}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    translator = load_translator(args.checkpoint, device=args.device)
    lines = sys.stdin.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    outputs = translator.translate(lines, beam=args.beam, length_penalty=args.length_penalty,
                                   batch_size=args.batch_size, use_cache=not args.no_cache)
    sys.stdout.write("".join(line + "\n" for line in outputs))
    return 0
