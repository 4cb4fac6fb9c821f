"""``clusterformer list``: the registered attention mechanisms, their options, defaults and aliases."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("list", help="registered attention mechanisms and their options")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..attention import describe, names
    from ..attention.registry import make_options

    for name in names():
        info = describe(name)
        print(f"{name}: {info['summary']}")
        aliases = {target: alias for alias, target in info["aliases"].items()}
        built = make_options(name, {})  # what the defaults resolve to ("auto", None) when nothing is given
        for option, default in info["options"].items():
            alias = f"  (alias {aliases[option]})" if option in aliases else ""
            value = getattr(built, option)
            resolved = f"  (resolves to {value!r})" if value != default else ""
            print(f"    {option} = {default!r}{alias}{resolved}")
    return 0
