"""``clusterformer list``: the registered attention mechanisms, their options, defaults and aliases."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("list", help="registered attention mechanisms and their options")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..attention import describe, names

    for name in names():
        info = describe(name)
        print(f"{name}: {info['summary']}")
        aliases = {target: alias for alias, target in info["aliases"].items()}
        for option, default in info["options"].items():
            alias = f"  (alias {aliases[option]})" if option in aliases else ""
            print(f"    {option} = {default!r}{alias}")
    return 0
