"""The one path from auxiliary losses to the training loss.

Layers with auxiliary objectives (neural clustering's L1 and L2 now; commitment losses later) publish
them in ``layer.aux_losses`` on every forward. After the model's forward, the training loop calls
:func:`collect_aux_losses` on the model and combines them with :func:`total_loss`:

    logits = model(tokens, key_padding_mask=pad)
    aux = collect_aux_losses(model)             # {"clustering": L1, "centroid_sorting": L2}
    loss = total_loss(task_loss, aux, {"clustering": mu, "centroid_sorting": nu}, task_weight=lam)

With several layers, each loss is the *mean* over the layers that produced it, so the weights mu, nu
mean the same thing at any depth (paper appendix C, eq. 17: mu L1 + nu L2 + lambda L3).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

__all__ = ["collect_aux_losses", "total_loss"]


def collect_aux_losses(model: nn.Module) -> dict[str, torch.Tensor]:
    """Mean of each named auxiliary loss over all attention layers in ``model`` (from their last forward):
    every :class:`~clusterformer.attention.AttentionLayer`, and any other module with an ``aux_losses`` dict
    (e.g. the attention that :func:`clusterformer.hf.patch` puts into a pretrained model)."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(getattr(module, "aux_losses", None), dict):
            for name, value in module.aux_losses.items():
                sums[name] = sums[name] + value if name in sums else value
                counts[name] = counts.get(name, 0) + 1
    return {name: sums[name] / counts[name] for name in sums}


def total_loss(
    task_loss: torch.Tensor,
    aux_losses: Mapping[str, torch.Tensor],
    weights: Mapping[str, float],
    *,
    task_weight: float = 1.0,
) -> torch.Tensor:
    """task_weight * task_loss + sum_name weights[name] * aux_losses[name].

    Every weight must name a known loss or be absent (absent = 0); an aux loss without a weight is
    ignored, so a model without clustering trains unchanged.
    """
    for name, weight in weights.items():
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
