"""Mechanism specs on the command line: ``NAME[:key=value,...]``, one string naming a mechanism and its options.

Used wherever a command compares several configurations side by side (``compare``, ``longctx``), so that
``neural-clustering:grouping=random`` means the same everywhere. Values are read as JSON (``true``, ``0.1``,
``64``, ``null``) and otherwise kept as strings.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["parse_spec", "split_specs"]


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"NAME[:key=value,...]"`` -> (NAME, options); ``ValueError`` for an item that is not key=value."""
    name, _, rest = spec.strip().partition(":")
    if not name.strip():
        raise ValueError(f"mechanism spec {spec!r} has no name before ':'")
    options: dict[str, Any] = {}
    for item in filter(None, (i.strip() for i in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"option {item!r} in {spec!r} must be key=value")
        try:
            options[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            options[key.strip()] = value.strip()
    return name.strip(), options


def split_specs(text: str) -> list[str]:
    """Split a list of specs. Specs are separated by ';' if the text has one, else by commas -- a comma followed
    by ``key=value`` (and no ':') continues the options of the spec before it:
    ``"full,neural-clustering:k=4,look_back=2,lsh"`` -> ``["full", "neural-clustering:k=4,look_back=2", "lsh"]``.
    """
    if ";" in text:
        return [s.strip() for s in text.split(";") if s.strip()]
    specs: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        if specs and "=" in piece and ":" not in piece:
            specs[-1] += "," + piece
        else:
            specs.append(piece)
    return specs
