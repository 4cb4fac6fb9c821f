"""The one rule for a query that may attend to no key, shared by every masked attention in the package.

Masks are boolean "allowed" tensors (True = the query may attend to the key), broadcastable to
(..., queries, keys); the public convention outside (``key_padding_mask``, True = padding, plus ``causal``)
is turned into one of these at the call site. A query with no allowed key (a sequence of padding only, left
padding under a causal mask, an empty window) has no softmax; it is given every key -- a finite softmax, so
no NaN reaches outputs or gradients -- and its output is then zeroed, which also zeroes every gradient
flowing through it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["allow_empty_rows", "masked_sdpa", "real_lengths"]


def real_lengths(key_padding_mask: torch.Tensor | None, batch: int, length: int, device: torch.device) -> torch.Tensor:
    """Each sequence's number of real tokens, (batch,) long: ``length`` for all without a mask. What the
    length-tied parameters (k = sqrt(L), chunk sizes, bucket counts) are computed from."""
    if key_padding_mask is None:
        return torch.full((batch,), length, dtype=torch.long, device=device)
    return (~key_padding_mask).sum(1)


def allow_empty_rows(allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """allowed (..., Nq, Nk) bool -> (the mask to give the softmax, (..., Nq, Nk); the rows without an allowed
    key, (..., Nq, 1), whose outputs the caller zeroes)."""
    no_key = ~allowed.any(-1, keepdim=True)
    return allowed | no_key, no_key


def masked_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, *, dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with a boolean ``allowed`` mask (broadcastable to (..., Nq, Nk)) and
    the rule of this module: zeros for a query with no allowed key."""
    mask, no_key = allow_empty_rows(allowed)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
    return out.masked_fill(no_key, 0.0)
