"""One mask value, composable predicates, and one rule for a query with no key.

The mask value. Outside and inside the package, padding is one tensor: ``key_padding_mask`` (B, N) bool,
True = padding (``None``: no padding). Its views have names: :func:`real_tokens` (True = a token),
:func:`real_lengths` (tokens per sequence). Attention masks are *allowed* tensors, True = the query may
attend to the key, broadcastable to (..., queries, keys).

Predicates. A mask is built from predicates in the style of ``torch.nn.attention.flex_attention``'s
``mask_mod`` and ``and_masks``: a predicate maps (query index, key index) tensors -- indices into flat
per-row tables (a token's flat index b * N + n for dense attention, a buffer row for windowed attention)
-- to a boolean "allowed" tensor of their broadcast shape:

    allowed = and_masks(key_is_real(real), causal_order(positions), same_group(groups))(q_index, k_index)

The rule. A query with no allowed key (a sequence of padding only, left padding under a causal mask, an
empty window) has no softmax; :func:`allow_empty_rows` gives it every key -- a finite softmax, so no NaN
reaches outputs or gradients -- and reports it, and the caller zeroes its output, which also zeroes every
gradient through it. :func:`masked_sdpa` is SDPA with that rule.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["MaskPredicate", "allow_empty_rows", "and_masks", "cache_allowed", "cache_sdpa", "causal_order",
           "dense_allowed", "key_is_real", "local_blocks", "masked_sdpa", "not_mask", "real_lengths", "real_tokens",
           "same_group", "self_only_when_alone"]

MaskPredicate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# ---------------------------------------------------------------------------------- views of the mask value
def real_tokens(key_padding_mask: torch.Tensor | None, batch: int, length: int, device: torch.device) -> torch.Tensor:
    """(batch, length) bool, True = a real token (all True without a mask)."""
    if key_padding_mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    return ~key_padding_mask


def real_lengths(key_padding_mask: torch.Tensor | None, batch: int, length: int, device: torch.device) -> torch.Tensor:
    """Each sequence's number of real tokens, (batch,) long: ``length`` for all without a mask. What the
    length-tied parameters (k = sqrt(L), chunk sizes, bucket counts) are computed from."""
    if key_padding_mask is None:
        return torch.full((batch,), length, dtype=torch.long, device=device)
    return (~key_padding_mask).sum(1)


# ------------------------------------------------------------------------------------------------ predicates
def and_masks(*predicates: MaskPredicate) -> MaskPredicate:
    """The predicate allowing a (query, key) pair when every one of ``predicates`` does."""

    def both(q_index: torch.Tensor, k_index: torch.Tensor) -> torch.Tensor:
        allowed = predicates[0](q_index, k_index)
        for predicate in predicates[1:]:
            allowed = allowed & predicate(q_index, k_index)
        return allowed

    return both


def key_is_real(real: torch.Tensor) -> MaskPredicate:
    """The key is a real token: ``real`` (rows,) bool per flat row."""
    return lambda q_index, k_index: real[k_index]


def causal_order(positions: torch.Tensor) -> MaskPredicate:
    """The key is not after the query: ``positions`` (rows,) each row's position in its sequence."""
    return lambda q_index, k_index: positions[q_index] >= positions[k_index]


def same_group(groups: torch.Tensor) -> MaskPredicate:
    """Query and key are in the same group: ``groups`` (rows,) each row's group."""
    return lambda q_index, k_index: groups[q_index] == groups[k_index]


def local_blocks(positions: torch.Tensor, block: int) -> MaskPredicate:
    """The key is in the query's local blocks: positions cut into blocks of ``block``, the key's block is the
    query's or the one before (``positions`` (rows,) each row's position in its sequence). The local part of
    neural-clustering's ``local_window``."""
    blocks = torch.div(positions, block, rounding_mode="floor")

    def local(q_index: torch.Tensor, k_index: torch.Tensor) -> torch.Tensor:
        behind = blocks[q_index] - blocks[k_index]
        return (behind >= 0) & (behind <= 1)

    return local


def not_mask(predicate: MaskPredicate) -> MaskPredicate:
    """The predicate allowing a pair when ``predicate`` does not."""
    return lambda q_index, k_index: ~predicate(q_index, k_index)


def self_only_when_alone(allowed: torch.Tensor, is_self: torch.Tensor) -> torch.Tensor:
    """Reformer's shared-QK rule on an allowed mask (..., Nq, Nk): a query may attend to its own token only when
    it has no other allowed key (with shared QK, q . k_self would dominate). ``is_self`` broadcasts to it."""
    others = allowed & ~is_self
    return torch.where(others.any(-1, keepdim=True), others, allowed)


def dense_allowed(key_padding_mask: torch.Tensor, causal: bool) -> torch.Tensor:
    """The allowed mask of attention over every key: key_padding_mask (B, N) -> (B, 1, 1 or N, N)."""
    B, N = key_padding_mask.shape
    device = key_padding_mask.device
    flat = torch.arange(B * N, device=device).view(B, 1, N)
    q_index, k_index = flat.unsqueeze(-1), flat.unsqueeze(-2)  # (B, 1, N, 1), (B, 1, 1, N)
    real = key_is_real(~key_padding_mask.reshape(-1))
    if not causal:
        return real(q_index[..., :1, :], k_index)
    return and_masks(real, causal_order(torch.arange(N, device=device).repeat(B)))(q_index, k_index)


def cache_allowed(key_padding_mask: torch.Tensor | None, q_len: int, kv_len: int, causal: bool,
                  device: torch.device) -> torch.Tensor:
    """The allowed mask of the last ``q_len`` positions of a cache of ``kv_len`` keys attending to it (a prefill
    when the two are equal; a decoding step or a chunk of a prompt otherwise): the keys that are real
    (key_padding_mask (B, kv_len), True = padding, or None) and, under ``causal``, not after the query (query i
    sits at position kv_len - q_len + i). Returns (B or 1, 1, q_len or 1, kv_len)."""
    real = (torch.ones(1, kv_len, dtype=torch.bool, device=device) if key_padding_mask is None
            else ~key_padding_mask)
    B = real.shape[0]
    k_index = torch.arange(B * kv_len, device=device).view(B, 1, 1, kv_len)  # flat rows b * kv_len + position
    predicate = key_is_real(real.reshape(-1))
    if not causal or q_len == 1:  # the last position sees every earlier key
        return predicate(k_index[..., -1:].transpose(-1, -2), k_index)
    predicate = and_masks(predicate, causal_order(torch.arange(kv_len, device=device).repeat(B)))
    return predicate(k_index[..., kv_len - q_len:].transpose(-1, -2), k_index)


# ----------------------------------------------------------------------------------------------- the rule
def allow_empty_rows(allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """allowed (..., Nq, Nk) bool -> (the mask to give the softmax, (..., Nq, Nk); the rows without an allowed
    key, (..., Nq, 1), whose outputs the caller zeroes)."""
    no_key = ~allowed.any(-1, keepdim=True)
    return allowed | no_key, no_key


def masked_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, *, dropout_p: float = 0.0,
    scale: float | None = None, enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with a boolean ``allowed`` mask (broadcastable to (..., Nq, Nk)) and
    the rule of this module: zeros for a query with no allowed key. ``enable_gqa``: k and v have fewer heads than
    q (grouped-query attention; SDPA reads each key/value head for its group of query heads)."""
    mask, no_key = allow_empty_rows(allowed)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                         enable_gqa=enable_gqa)
    return out.masked_fill(no_key, 0.0)


def cache_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None,
               causal: bool, *, scale: float | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Dense attention of q (B, H, Lq, D), the last Lq positions of a cache, on the cache k, v (B, Hkv, n, D)
    (H a multiple of Hkv: grouped-query attention without repeating the cache) under :func:`cache_allowed`,
    with the rule for a query without keys. No mask is built where SDPA's own ``is_causal`` says the same."""
    Lq, n = q.shape[-2], k.shape[-2]
    gqa = q.shape[1] != k.shape[1]
    if key_padding_mask is None and (not causal or Lq == 1 or Lq == n):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal and Lq > 1,
                                              scale=scale, enable_gqa=gqa)
    allowed = cache_allowed(key_padding_mask, Lq, n, causal, q.device)
    return masked_sdpa(q, k, v, allowed, dropout_p=dropout_p, scale=scale, enable_gqa=gqa)
