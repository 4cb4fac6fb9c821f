"""Auxiliary outputs of a forward -- losses and groupings -- carried out of the model by one collector.

Nothing a forward computes is stored on a module. A mechanism with an auxiliary objective (neural
clustering's L1 and L2, routing's commitment loss) *publishes* it with :func:`publish_losses`; a mechanism
that groups tokens publishes the grouping with :func:`publish_groups`. Both go to the collectors that are
open in the current context (a :class:`contextvars.ContextVar`, so threads and nested contexts do not mix)
and are dropped when none is open, so a module keeps no tensor, and no autograd graph, alive between calls.

The one path from auxiliary losses to the training loss:

    with collect_aux_losses() as aux:           # a Mapping: loss name -> mean over the layers that made it
        logits = model(tokens, key_padding_mask=pad)
    loss = total_loss(task_loss, aux, {"clustering": mu, "centroid_sorting": nu}, task_weight=lam)

With several layers each loss is the *mean* over the calls that produced it, so the weights mu, nu mean
the same thing at any depth (paper appendix C, eq. 17: mu L1 + nu L2 + lambda L3).

Diagnostics -- which group (cluster, bucket, query cluster) each token went to -- are read the same way:

    with record_groups() as groups:             # {layer: its last call's groups, detached}
        model(tokens)
    groups[model.encoder.blocks[0].attn]        # (B, H, N), (B, H, rounds, N) or (B, N) -- see the mechanism
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import NamedTuple

import torch
from torch import nn

__all__ = ["AuxLosses", "collect_aux_losses", "declare_losses", "known_losses", "publish_groups", "publish_losses",
           "record_groups", "total_loss"]


class AuxLosses(Mapping[str, torch.Tensor]):
    """The auxiliary losses published inside one :func:`collect_aux_losses` block: a read-only mapping from
    loss name to the mean of that loss over every call that published it (tensors with their graphs)."""

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, int] = {}

    def add(self, losses: Mapping[str, torch.Tensor]) -> None:
        for name, value in losses.items():
            self._sums[name] = self._sums[name] + value if name in self._sums else value
            self._counts[name] = self._counts.get(name, 0) + 1

    def counts(self) -> dict[str, int]:
        """How many calls published each loss."""
        return dict(self._counts)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._sums[name] / self._counts[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._sums)

    def __len__(self) -> int:
        return len(self._sums)

    def __repr__(self) -> str:
        return f"AuxLosses({ {name: float(self[name]) for name in self} })"


class _Collectors(NamedTuple):
    """What is open in one context: loss collectors and group recorders."""

    losses: tuple[AuxLosses, ...] = ()
    groups: tuple[dict, ...] = ()


_OPEN: ContextVar[_Collectors] = ContextVar("clusterformer_aux_collectors", default=_Collectors())  # noqa: B039


@contextlib.contextmanager
def collect_aux_losses() -> Iterator[AuxLosses]:
    """Collect the auxiliary losses of every attention call inside the block (see the module docs)."""
    aux = AuxLosses()
    current = _OPEN.get()
    token = _OPEN.set(_Collectors((*current.losses, aux), current.groups))
    try:
        yield aux
    finally:
        _OPEN.reset(token)


@contextlib.contextmanager
def record_groups() -> Iterator[dict[nn.Module, torch.Tensor]]:
    """Record, per publishing module, the groups of its last call inside the block (detached)."""
    groups: dict[nn.Module, torch.Tensor] = {}
    current = _OPEN.get()
    token = _OPEN.set(_Collectors(current.losses, (*current.groups, groups)))
    try:
        yield groups
    finally:
        _OPEN.reset(token)


@contextlib.contextmanager
def isolated() -> Iterator[tuple[AuxLosses, dict[nn.Module, torch.Tensor]]]:
    """Collect into fresh collectors *instead of* the open ones (for code that re-publishes what it got,
    as the reversible stack does with the losses of its blocks)."""
    aux: AuxLosses = AuxLosses()
    groups: dict[nn.Module, torch.Tensor] = {}
    token = _OPEN.set(_Collectors((aux,), (groups,)))
    try:
        yield aux, groups
    finally:
        _OPEN.reset(token)


def publish_losses(losses: Mapping[str, torch.Tensor]) -> None:
    """Hand one call's auxiliary losses (name -> scalar tensor) to the open collectors; dropped if none."""
    for aux in _OPEN.get().losses:
        aux.add(losses)


def publish_groups(module: nn.Module, groups: torch.Tensor) -> None:
    """Hand one call's grouping to the open group recorders (detached); dropped if none."""
    recorders = _OPEN.get().groups
    if recorders:
        groups = groups.detach()
        for recorder in recorders:
            recorder[module] = groups


def total_loss(
    task_loss: torch.Tensor,
    aux_losses: Mapping[str, torch.Tensor],
    weights: Mapping[str, float],
    *,
    task_weight: float = 1.0,
    known: tuple[str, ...] | None = None,
) -> torch.Tensor:
    """task_weight * task_loss + sum_name weights[name] * aux_losses[name].

    An aux loss without a weight is ignored, so a model without clustering trains unchanged. A weight must
    name a loss that some mechanism publishes (``known``, default :func:`known_losses`): a misspelled weight
    raises ``ValueError`` instead of silently doing nothing. A known loss that this model did not publish
    (a weight for clustering losses on a full-attention model) is allowed and adds nothing.
    """
    known = known_losses() if known is None else known
    for name, weight in weights.items():
        if name not in known:
            raise ValueError(f"loss weight {name!r} names no auxiliary loss; known losses: {', '.join(known)}")
        if weight < 0:
            raise ValueError(f"loss weight {name!r} must be >= 0, got {weight}")
    if task_weight < 0:
        raise ValueError(f"task_weight must be >= 0, got {task_weight}")
    loss = task_weight * task_loss
    for name, value in aux_losses.items():
        weight = weights.get(name, 0.0)
        if weight:
            loss = loss + weight * value.to(loss.dtype)
    return loss


_KNOWN: set[str] = set()


def declare_losses(names: tuple[str, ...]) -> None:
    """Make loss ``names`` known to :func:`total_loss` (the registry declares each mechanism's losses)."""
    _KNOWN.update(names)


def known_losses() -> tuple[str, ...]:
    """Names of the auxiliary losses that registered mechanisms publish."""
    return tuple(sorted(_KNOWN))
