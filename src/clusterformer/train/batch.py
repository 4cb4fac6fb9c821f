"""What a training task hands the loop (:class:`Batch`) and what its evaluation receives (:class:`Predict`).

A module of its own so that every task module (:mod:`.tasks`, :mod:`.translation`, :mod:`.recall`) imports it
without importing the others: the imports of ``train`` flow one way."""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
from torch import nn

__all__ = ["Batch", "Predict"]


class Batch(NamedTuple):
    """One rank's slice of a training step: token ids (B, L), key padding mask (B, L) or None, targets, and the
    model's third input where it takes one (the model is then called as ``model(ids, pad, extra)``): an
    encoder-decoder's teacher-forced decoder input, or the masked language model's positions whose token logits
    the loss reads (its head runs on those rows alone)."""

    ids: torch.Tensor
    pad: torch.Tensor | None
    targets: torch.Tensor
    extra: torch.Tensor | None = None


class Predict(Protocol):
    """What a task's ``evaluate`` gets: ``predict(ids, pad) -> logits`` on CPU (eval mode, no gradient), and the
    model itself (``predict.model``, on ``predict.device``) for tasks that decode with it (translation) or
    inspect its layers (the recall tasks' key-recall diagnostic)."""

    model: nn.Module
    device: torch.device

    def __call__(self, ids: torch.Tensor, pad: torch.Tensor | None) -> torch.Tensor: ...
