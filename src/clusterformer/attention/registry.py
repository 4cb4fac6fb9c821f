"""Registry of attention mechanisms: ``names()``, ``build(name, dim=..., heads=..., **options)``.

Each mechanism registers its layer class together with a frozen dataclass of its own options. ``build``
rejects options the mechanism does not have (naming them and listing the valid ones) and the options
dataclass checks each value in ``__post_init__``, so there is no global parameter namespace shared by
unrelated mechanisms.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .base import AttentionLayer

__all__ = ["Mechanism", "build", "causal_semantics", "describe", "names", "register"]


@dataclass(frozen=True)
class Mechanism:
    name: str
    layer: type[AttentionLayer]
    options: type  # a dataclass whose fields are the mechanism's options, all with defaults
    summary: str


_REGISTRY: dict[str, Mechanism] = {}


def register(name: str, options: type, summary: str):
    """Class decorator: ``@register("full", FullOptions, "...")`` on an :class:`AttentionLayer`."""
    if not dataclasses.is_dataclass(options):
        raise TypeError(f"options for {name!r} must be a dataclass")
    for field in dataclasses.fields(options):
        if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise TypeError(f"option {field.name!r} of {name!r} needs a default")

    def decorate(layer: type[AttentionLayer]) -> type[AttentionLayer]:
        if name in _REGISTRY:
            raise ValueError(f"attention mechanism {name!r} is already registered")
        _REGISTRY[name] = Mechanism(name, layer, options, summary)
        return layer

    return decorate


def names() -> list[str]:
    """Registered mechanism names, sorted."""
    return sorted(_REGISTRY)


def _get(name: Any) -> Mechanism:
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention mechanism {name!r}; available: {', '.join(names())}")
    return _REGISTRY[name]


def describe(name: str) -> dict[str, Any]:
    """The mechanism's summary and its options with their defaults."""
    mech = _get(name)
    defaults = {f.name: f.default for f in dataclasses.fields(mech.options)}
    return {"name": name, "summary": mech.summary, "options": defaults}


def make_options(name: str, options: dict[str, Any]) -> Any:
    """Validate ``options`` for mechanism ``name`` and return its options dataclass."""
    mech = _get(name)
    valid = {f.name for f in dataclasses.fields(mech.options)}
    unknown = sorted(set(options) - valid)
    if unknown:
        raise ValueError(
            f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} for attention "
            f"{name!r}; valid options: {', '.join(sorted(valid)) or '(none)'}"
        )
    return mech.options(**options)


def build(name: str, *, dim: int, heads: int, **options: Any) -> AttentionLayer:
    """Build the attention layer ``name`` with model width ``dim`` split over ``heads`` heads.

    Every option has a default, so ``build(name, dim=64, heads=4)`` works for every name.
    Raises ``ValueError`` for an unknown name, an option the mechanism does not have, or a bad value.
    """
    mech = _get(name)
    return mech.layer(dim, heads, make_options(name, options))


def causal_semantics(name: str, options: Any) -> str:
    """What ``causal=True`` means for mechanism ``name`` with ``options`` (a dict or its options dataclass):
    ``"strict"`` (output t depends on tokens 0..t only), ``"paper"`` (no direct future leak, but which past
    keys a token sees depends on the whole sequence) or ``"refused"``. The option class's
    ``causal_semantics()``; "strict" when it defines none."""
    if isinstance(options, dict):
        options = make_options(name, options)
    method = getattr(options, "causal_semantics", None)
    return "strict" if method is None else method()
