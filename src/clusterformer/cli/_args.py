"""Argument types and helpers shared by the commands."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def int_list(text: str) -> list[int]:
    """Comma-separated positive integers."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def name_list(text: str) -> list[str]:
    """Comma-separated registered mechanism names, or "all": every mechanism with a layer of its own (the readers of a
    pretrained decoder's cache, whose layer is full attention, are named one by one)."""
    from ..attention import names
    from ..attention.registry import names_where

    if text.strip() == "all":
        return names_where(kind="sequence")
    values = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in values if v not in names()]
    if not values or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown attention name(s) {', '.join(unknown) or text!r}; available: {', '.join(names())}"
        )
    return values


def mechanism(text: str) -> str:
    """One registered mechanism name."""
    return name_list(text)[0]


def mechanism_spec(text: str) -> str:
    """One registered mechanism, optionally with options: ``NAME[:key=value,...]`` (the spec of ``compare`` and
    ``longctx``); the name is checked here, the options by :func:`spec_options`."""
    from .._specs import parse_spec

    try:
        name, _ = parse_spec(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    mechanism(name)
    return text.strip()


def spec_options(
    flag: str, spec: str | None, options_flag: str, options: dict[str, Any]
) -> tuple[str | None, dict[str, Any]]:
    """(name, options) of a ``NAME[:key=value,...]`` given to ``flag``, merged with the JSON of ``options_flag``;
    ``ValueError`` naming both flags when they set the same option."""
    from .._specs import parse_spec

    if spec is None:
        return None, options
    name, inline = parse_spec(spec)
    both = sorted(set(inline) & set(options))
    if both:
        raise ValueError(f"{flag} {spec!r} and {options_flag} both set {', '.join(both)}: give each option once")
    return name, {**inline, **options}


def json_object(flag: str, text: str | None, example: str) -> dict[str, Any]:
    """The JSON object given to ``flag`` ({} when absent); ``ValueError`` naming the flag otherwise."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} is not valid JSON ({exc}); e.g. {example}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, e.g. {example}")
    return value


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
