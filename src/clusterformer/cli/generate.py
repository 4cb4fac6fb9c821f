"""``clusterformer generate``: continue a prompt with a trained character language model, streaming."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="continue a prompt with a trained character language model (streams)")
    p.add_argument("--checkpoint", required=True, help="run directory or checkpoint of --task shakespeare-char")
    p.add_argument("--prompt", required=True, help="text to continue (characters of the model's vocabulary)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0, help="seeds the sampling")
    p.add_argument("--no-cache", action="store_true",
                   help="recompute the whole causal forward per token instead of decoding with the cache")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..apps.generate import load_character_lm

    lm = load_character_lm(args.checkpoint)

    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    show(args.prompt)
    lm.generate(args.prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, seed=args.seed, use_cache=not args.no_cache, on_text=show)
    show("\n")
    return 0
