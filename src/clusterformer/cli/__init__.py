"""Command line: ``clusterformer COMMAND`` (also ``python -m clusterformer``).

Commands, one module each (each adds its own parser, as ``transformers/cli`` does):

  list      registered attention mechanisms, their options and aliases     (:mod:`.mechanisms`)
  bench     time and memory benchmarks: attention, reversible, report      (:mod:`.bench`)
  train     train a model on a task of the papers; works under torchrun    (:mod:`.train`)
  eval      evaluate a checkpoint on its task's test split                  (:mod:`.evaluate`)
  generate  continue a prompt with a character language model, streaming   (:mod:`.generate`)
  translate translate stdin with an encoder-decoder (greedy or beam)       (:mod:`.translate`)
  data      list and download the public datasets                           (:mod:`.data`)
  report    markdown table (and plot) of training runs                      (:mod:`.report`)
  compare   every mechanism on every task over seeds, resumable, summarised (:mod:`.compare`)
  approx    clustered attention inside a pretrained model, no retraining    (:mod:`.approx`)
  longctx   long-context tasks of a pretrained decoder: cluster retrieval   (:mod:`.longctx`)
  cluster   the stand-alone clustering experiment                           (:mod:`.cluster`)
  demo      benchmark + training: full, neural-clustering, cluster-select   (:mod:`.demo`)
"""

from __future__ import annotations

import argparse
import sys

from . import (
    approx,
    bench,
    cluster,
    compare,
    data,
    demo,
    evaluate,
    generate,
    longctx,
    mechanisms,
    report,
    train,
    translate,
)

__all__ = ["build_parser", "main"]

COMMANDS = (mechanisms, bench, train, evaluate, generate, translate, data, report, compare, approx, longctx, cluster,
            demo)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clusterformer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        parser.exit(2, f"clusterformer: error: {exc}\n")
    except KeyboardInterrupt:
        parser.exit(130, "interrupted\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
