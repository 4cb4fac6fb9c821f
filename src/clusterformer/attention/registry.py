"""Registry of attention mechanisms: ``names()``, ``build(name, dim=..., heads=..., **options)``.

Each mechanism registers its :class:`~clusterformer.attention.base.InnerAttention` class together with a
frozen dataclass of its own options (a subclass of :class:`~clusterformer.attention.base.AttentionOptions`).
``build`` rejects options the mechanism does not have (naming them and listing the valid ones), maps the
papers' names for options (``ALIASES``) to the library's vocabulary, and the options dataclass checks each
value in ``__post_init__``, so there is no global parameter namespace shared by unrelated mechanisms.

The same registry serves :func:`build` (a whole :class:`~clusterformer.attention.base.AttentionLayer`),
:func:`build_inner` (the mechanism alone, for code that has its own projections) and
:mod:`clusterformer.hf` (a pretrained model's attention).

What a mechanism can do is a capability of its :class:`Mechanism` (its inner attention's class attributes: ``kind``,
``interface_mode``, ``keeps_index``, ``learned_centroids``, ``stack_layers``, ``shared_qk``, ...), and code that
treats mechanisms differently asks it (``names_where(kind="cache")``), never the name: a mechanism registered with
the same attributes is treated alike. :data:`DENSE` and :data:`STACK` are labels that stand beside the names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .._checks import check_int
from .aux import declare_losses
from .base import AttentionLayer, AttentionOptions, InnerAttention, option_fields

__all__ = ["DENSE", "PSEUDO_NAMES", "STACK", "Mechanism", "build", "build_inner", "can_decode", "causal_semantics",
           "defaults_versions", "describe", "make_options", "mechanisms", "names", "names_where", "pin_defaults",
           "register"]

# Labels that stand beside the registered names where mechanisms are compared, and name no mechanism (register refuses
# them): DENSE, a pretrained decoder's own SDPA attention (apps.longctx, bench.retrieval, bench.prefill); STACK, the
# Cluster-Former paper's stack, sliding-window layers whose last is a Cluster-Former layer (apps.compare).
DENSE = "dense"
STACK = "cluster-former-stack"
PSEUDO_NAMES = (DENSE, STACK)


@dataclass(frozen=True)
class Mechanism:
    """A registered mechanism: its name, inner attention, options dataclass and summary, and what it can do (the
    inner attention's class attributes, :class:`~clusterformer.attention.base.InnerAttention`): code that treats
    mechanisms differently asks these, never the name."""

    name: str
    inner: type[InnerAttention]
    options: type[AttentionOptions]  # a dataclass whose fields are the mechanism's options, all with defaults
    summary: str

    @property
    def shared_qk(self) -> bool:
        return self.inner.shared_qk

    @property
    def aux_losses(self) -> tuple[str, ...]:
        return self.inner.aux_losses

    @property
    def kind(self) -> str:
        """``"sequence"`` (a model's layer: a sequence attends to itself, and it trains) or ``"cache"`` (it reads a
        pretrained decoder's key/value cache; training it would train full attention)."""
        return self.inner.kind

    @property
    def interface_mode(self) -> str | None:
        """How :mod:`clusterformer.hf`'s AttentionInterface runs it on a model's own q, k, v (None: it cannot)."""
        return self.inner.interface_mode

    @property
    def keeps_index(self) -> bool:
        """A cache reader that keeps a key index beside the cache, re-clustered every ``refresh`` keys."""
        return self.inner.keeps_index

    @property
    def learned_centroids(self) -> bool:
        """Learned centroids that can flow from layer to layer (the encoder's ``centroid_flow``) and train at their
        own rate (``centroid_lr_scale``)."""
        return self.inner.learned_centroids

    @property
    def stack_layers(self) -> str | None:
        """The mechanism of the other layers of the paper's stack this one belongs in (train's ``cluster_layers``),
        or None."""
        return self.inner.stack_layers


_REGISTRY: dict[str, Mechanism] = {}


def register(name: str, options: type, summary: str):
    """Class decorator: ``@register("full", FullOptions, "...")`` on an :class:`InnerAttention` subclass."""
    if name in PSEUDO_NAMES:
        raise ValueError(f"{name!r} is a label beside the mechanisms' names (PSEUDO_NAMES), not a mechanism's name")
    if not (dataclasses.is_dataclass(options) and issubclass(options, AttentionOptions)):
        raise TypeError(f"options for {name!r} must be a dataclass subclassing AttentionOptions")
    for field in dataclasses.fields(options):
        if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise TypeError(f"option {field.name!r} of {name!r} needs a default")
    fields = option_fields(options)
    for alias, target in options.ALIASES.items():
        if target not in fields or alias in fields:
            raise TypeError(f"alias {alias!r} of {name!r} must name an option ({target!r}) and not be one")

    def decorate(inner: type[InnerAttention]) -> type[InnerAttention]:
        if not issubclass(inner, InnerAttention):
            raise TypeError(f"{inner.__name__} must subclass InnerAttention")
        if name in _REGISTRY:
            raise ValueError(f"attention mechanism {name!r} is already registered")
        _REGISTRY[name] = Mechanism(name, inner, options, summary)
        declare_losses(inner.aux_losses)
        return inner

    return decorate


def names() -> list[str]:
    """Registered mechanism names, sorted."""
    return sorted(_REGISTRY)


def mechanisms() -> list[Mechanism]:
    """Every registered mechanism, sorted by name."""
    return [_REGISTRY[name] for name in names()]


def names_where(**capabilities: Any) -> list[str]:
    """The names, sorted, of the mechanisms whose :class:`Mechanism` attributes equal ``capabilities``:
    ``names_where(kind="cache")``, ``names_where(learned_centroids=True)``."""
    for capability in capabilities:
        if not isinstance(getattr(Mechanism, capability, None), property):
            raise ValueError(f"{capability!r} is not a capability of a Mechanism")
    return [mech.name for mech in mechanisms()
            if all(getattr(mech, capability) == value for capability, value in capabilities.items())]


def get(name: Any) -> Mechanism:
    """The registered mechanism ``name`` (``ValueError`` listing the names if there is none)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention mechanism {name!r}; available: {', '.join(names())}")
    return _REGISTRY[name]


def describe(name: str) -> dict[str, Any]:
    """The mechanism's summary, its options with their defaults, the aliases it accepts, whether it shares QK
    and whether it has attention dropout."""
    mech = get(name)
    return {"name": name, "summary": mech.summary, "options": option_fields(mech.options),
            "aliases": dict(mech.options.ALIASES), "shared_qk": mech.shared_qk,
            "attention_dropout": mech.options.ATTENTION_DROPOUT}


def make_options(name: str, options: dict[str, Any] | AttentionOptions) -> AttentionOptions:
    """Validate ``options`` for mechanism ``name`` (a dict, aliases allowed, or its options dataclass) and
    return its options dataclass."""
    mech = get(name)
    if isinstance(options, mech.options):
        return options
    if not isinstance(options, dict):
        raise ValueError(f"options for {name!r} must be a dict or {mech.options.__name__}, got {options!r}")
    valid = option_fields(mech.options)
    canonical: dict[str, Any] = {}
    for key, value in options.items():
        target = mech.options.ALIASES.get(key, key)
        if target in canonical:
            raise ValueError(f"option {target!r} of attention {name!r} is given twice (as {target!r} and an alias)")
        canonical[target] = value
    kind = mech.options
    # options whose ablations lost, kept in a subclass of the mechanism's options (its EXPERIMENTAL class; none
    # in ``describe``) so that recorded runs can be rebuilt: naming any of them builds that class
    experimental = getattr(kind, "EXPERIMENTAL", None)
    if experimental is not None and not set(canonical) <= set(valid):
        kind, valid = experimental, option_fields(experimental)
    unknown = sorted(set(canonical) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} for attention "
            f"{name!r}; valid options: {', '.join(sorted(valid)) or '(none)'}"
        )
    try:
        return kind(**canonical)
    except ValueError as error:  # name the option as the caller spelled it
        message = str(error)
        for alias, target in mech.options.ALIASES.items():
            if alias in options and message.startswith(target):
                raise ValueError(f"{target} (given as {alias}){message[len(target):]}") from None
        raise


def defaults_versions() -> dict[str, int]:
    """Every mechanism's ``DEFAULTS_VERSION`` (what its defaults compute), for checkpoints and run records."""
    return {name: _REGISTRY[name].options.DEFAULTS_VERSION for name in names()}


def pin_defaults(name: str, options: dict[str, Any], versions: dict[str, int] | None) -> dict[str, Any]:
    """``options`` of mechanism ``name`` as a record written under the defaults ``versions`` meant them: the options
    whose defaults changed since (:meth:`AttentionOptions.earlier_defaults`) set to the old defaults, unless given.
    ``versions`` is the record's :func:`defaults_versions`; None, or a mechanism missing from it, is version 1 (the
    records written before versions were kept). An unknown name is returned as it is (its own code refuses it)."""
    mech = _REGISTRY.get(name)
    version = (versions or {}).get(name, 1)
    if mech is None or version >= mech.options.DEFAULTS_VERSION:
        return dict(options)
    canonical = {mech.options.ALIASES.get(key, key): value for key, value in options.items()}
    return {**options, **mech.options.earlier_defaults(version, canonical)}


def build_inner(name: str, *, dim: int, heads: int, **options: Any) -> InnerAttention:
    """The inner attention (the mechanism alone: q, k, v -> output) of ``name``; see :func:`build`."""
    mech = get(name)
    _check_width(dim, heads)
    return mech.inner(dim, heads, make_options(name, options))


def _check_width(dim: int, heads: int) -> None:
    check_int("dim", dim, minimum=1)
    check_int("heads", heads, minimum=1)
    if dim % heads:
        raise ValueError(f"dim must be divisible by heads; got dim={dim}, heads={heads}")


def build(name: str, *, dim: int, heads: int, **options: Any) -> AttentionLayer:
    """Build the attention layer ``name`` with model width ``dim`` split over ``heads`` heads: the layer's
    projections around the registered inner attention.

    Every option has a default, so ``build(name, dim=64, heads=4)`` works for every name.
    Raises ``ValueError`` for an unknown name, an option the mechanism does not have, or a bad value.
    """
    mech = get(name)
    opts = make_options(name, options)
    _check_width(dim, heads)
    return AttentionLayer(dim, heads, mech.inner(dim, heads, opts), bias=opts.bias)


def causal_semantics(name: str, options: Any) -> str:
    """What ``causal=True`` means for mechanism ``name`` with ``options`` (a dict or its options dataclass):
    ``"strict"``, ``"paper"`` or ``"refused"`` (:meth:`AttentionOptions.causal_semantics`)."""
    return make_options(name, options).causal_semantics()


def can_decode(name: str, options: Any) -> bool:
    """Whether mechanism ``name`` with ``options`` has cached incremental decoding (``layer.prefill`` /
    ``layer.step``): it is strictly causal and implements the cache."""
    opts = make_options(name, options)
    return get(name).inner.decodes and opts.causal_semantics() == "strict" and opts.cached_decoding()
