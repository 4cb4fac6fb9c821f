"""``clusterformer data {list,download}``: the public datasets, fetched and verified by checksum."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ._args import log


def add_parser(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="datasets: list, download")
    data_sub = data.add_subparsers(dest="what", required=True)
    p = data_sub.add_parser("list", help="datasets that can be downloaded, and their files")
    p.set_defaults(func=run_list)
    p = data_sub.add_parser("download", help="fetch public originals, verified by checksum")
    p.add_argument("names", nargs="+", help="mr cr subj mpqa 20news imdb wikiqa tinyshakespeare")
    p.add_argument("--data-dir", default=None, help="destination (default: $CLUSTERFORMER_DATA, else the user cache)")
    p.set_defaults(func=run_download)


def run_download(args: argparse.Namespace) -> int:
    from ..data.download import download

    dest = args.data_dir or os.environ.get("CLUSTERFORMER_DATA") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "clusterformer" / "data")
    for name in args.names:
        for path in download(name, dest, log=log):
            log(f"ok {path}")
    return 0


def run_list(args: argparse.Namespace) -> int:
    from ..data.download import SOURCES

    for name, files in SOURCES.items():
        print(f"{name}: " + ", ".join(rel for rel, _, _, _ in files))
    return 0
