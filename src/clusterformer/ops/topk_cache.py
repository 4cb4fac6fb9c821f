"""Two baselines for reading a decoder's cache at a budget: the oracle and Quest (docs/long-context-decoding.md).

Both read the last Lq positions of a cache of n keys against it, causally, every key a query reads counted
against its budget A (a fraction of its sequence's real cached keys, rounded up, or a count:
:func:`clusterformer.ops.retrieval.keys_allowed`), as cluster retrieval does:

* :func:`oracle_attention` -- per query and query head, the A keys of largest q . k among the real keys up to
  its position: the A keys of largest dense attention weight, so the upper bound of any selection of A keys
  (what a perfect retrieval would read). It computes every score, O(n D) per query: a yardstick, not a method.
* :func:`quest_attention` -- Quest (Tang et al. 2024, "Quest: query-aware sparsity for efficient long-context
  LLM inference"): each sequence's real keys cut into pages of ``page_size`` in order, each page summarised by
  the per-channel minimum and maximum of its keys; a query scores a page by the upper bound of q . k over it,
  sum_d max(q_d min_d, q_d max_d), and reads whole pages in descending bound. Here a query always reads its own
  page up to itself (at most its A most recent keys: the page being filled, whose summary would mix in later
  keys), and ranks only the whole pages before it, so nothing it reads or ranks depends on a later key;
  floor((A - own) / page_size) pages fill the rest of its budget.

Under grouped-query attention (H query heads on Hkv key/value heads) every query head selects on its own, as
Quest does per head. Padding: the padding (B, n), True = padding (left padding, as ``generate()`` batches
prompts), of the call's causal :class:`~clusterformer.masks.AttentionMask`; a sequence's budget, pages and
selection are its own, so outputs do not depend on the batch. A budget that covers every key reads every key:
dense causal attention.
"""

from __future__ import annotations

import torch

from ..masks import AttentionMask, allow_empty_rows
from .retrieval import gather_positions, keys_allowed

__all__ = ["oracle_attention", "quest_attention"]


def _budgets(mask: AttentionMask, budget: float | int, B: int, Lq: int, n: int,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(real keys (B, n) bool, each sequence's budget A (B,) long); ``ValueError`` for a mask that does not read
    the cache causally (one query, the last position, sees every key either way)."""
    if (not mask.causal and Lq > 1) or mask.window is not None:
        raise ValueError("mask must be key padding + causal: a cache is read causally, without a window")
    real = mask.real(B, n, device)
    return real, keys_allowed(budget, real.sum(1))


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, read: torch.Tensor, scale: float
            ) -> torch.Tensor:
    """Softmax of q (B, H, Lq, D) over its gathered keys / values (B, H, Lq, K, D) where ``read`` (B, H, Lq, K);
    a query that reads nothing (a padded row) gets 0, by the library's rule."""
    logits = (keys @ (q * scale).unsqueeze(-1)).squeeze(-1)  # (B, H, Lq, K)
    read, no_key = allow_empty_rows(read)
    weights = torch.softmax(logits.masked_fill(~read, float("-inf")), dim=-1)
    return (weights.unsqueeze(-2) @ values).squeeze(-2).masked_fill(no_key, 0.0)


def _gather(x: torch.Tensor, positions: torch.Tensor, rep: int) -> torch.Tensor:
    """x (B, Hkv, n, E), positions (B, H, Lq, K) with H = rep Hkv -> (B, H, Lq, K, E): query head h reads key/value
    head h // rep."""
    B, H = positions.shape[:2]
    grouped = positions.view(B, H // rep, rep, *positions.shape[2:])  # the query heads of each key/value head
    return gather_positions(x, grouped).view(*positions.shape, x.shape[-1])


def oracle_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask,
                     budget: float | int, scale: float) -> torch.Tensor:
    """The oracle (module docstring). q (B, H, Lq, D) at positions n - Lq .. n - 1; k, v (B, Hkv, n, D); ``mask``
    the call's causal mask. Returns (B, H, Lq, D)."""
    B, H, Lq, D = q.shape
    Hkv, n = k.shape[1], k.shape[2]
    rep = H // Hkv
    _real, allowed = _budgets(mask, budget, B, Lq, n, q.device)
    visible = mask.allowed(Lq, n, q.device)  # (B or 1, 1, Lq, n)
    scores = (q.reshape(B, Hkv, rep * Lq, D) @ k.transpose(-1, -2)).view(B, H, Lq, n)
    scores = scores.masked_fill(~visible, float("-inf"))
    top = scores.topk(min(int(allowed.max()), n), dim=-1)
    read = top.values > float("-inf")
    read = read & (torch.arange(top.indices.shape[-1], device=q.device) < allowed.view(B, 1, 1, 1))
    return _attend(q, _gather(k, top.indices, rep), _gather(v, top.indices, rep), read, scale)


def quest_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask,
                    budget: float | int, page_size: int, scale: float) -> torch.Tensor:
    """Quest (module docstring). q (B, H, Lq, D) at positions n - Lq .. n - 1; k, v (B, Hkv, n, D); ``mask`` the
    call's causal mask. Returns (B, H, Lq, D).

    Pages are cut from each sequence's real keys in order (page p holds its real keys of rank p P .. p P + P - 1),
    not from positions of the padded cache, so padding moves no page edge: a sequence reads the same alone as
    beside longer ones."""
    B, H, Lq, D = q.shape
    Hkv, n = k.shape[1], k.shape[2]
    rep, P = H // Hkv, page_size
    dev = q.device
    real, allowed = _budgets(mask, budget, B, Lq, n, dev)
    order = torch.sort((~real).to(torch.uint8), dim=1, stable=True).indices  # (B, n): real positions first
    rank = real.long().cumsum(1) - 1  # (B, n): a real key's rank among its sequence's real keys
    lengths = real.sum(1)
    pages = -(-n // P)
    # per page and channel, the min and max of its keys (pages past a sequence's real keys hold none)
    ranked_keys = k.gather(2, order.view(B, 1, n, 1).expand(B, Hkv, n, D))
    padded = torch.nn.functional.pad(ranked_keys, (0, 0, 0, pages * P - n)).view(B, Hkv, pages, P, D)
    holds = (torch.arange(pages * P, device=dev) < lengths.unsqueeze(1)).view(B, 1, pages, P, 1)
    low = padded.masked_fill(~holds, float("inf")).amin(3)  # (B, Hkv, pages, D)
    high = padded.masked_fill(~holds, float("-inf")).amax(3)
    qg = q.reshape(B, Hkv, rep, Lq, 1, D)
    bound = torch.maximum(qg * low.unsqueeze(2).unsqueeze(2), qg * high.unsqueeze(2).unsqueeze(2)).sum(-1)
    bound = bound.view(B, H, Lq, pages)  # pages at or after a query's own are never ranked below
    # each query (rank r): its own page up to itself, at most A of its most recent keys; then the whole earlier pages
    # (P real keys each) of largest bound, as many as the rest of A holds
    query_real = real[:, n - Lq:].view(B, 1, Lq)
    r = rank[:, n - Lq:].view(B, 1, Lq)
    A = allowed.view(B, 1, 1)
    own_page = torch.div(r, P, rounding_mode="floor")
    own_first = torch.maximum(own_page * P, r - A + 1)
    own_count = torch.where(query_real, r - own_first + 1, 0)
    take = torch.where(query_real, torch.div(A - own_count, P, rounding_mode="floor"), 0).clamp(min=0)
    earlier = torch.arange(pages, device=dev).view(1, 1, 1, pages) < own_page.unsqueeze(-1)  # (B, 1, Lq, pages)
    scores = bound.masked_fill(~earlier, float("-inf"))
    most = max(0, min(int(take.max()), pages))
    top = scores.topk(most, dim=-1)  # (B, H, Lq, most)
    chosen = (top.values > float("-inf")) & (torch.arange(most, device=dev) < take.unsqueeze(-1))
    offsets = torch.arange(P, device=dev)
    page_ranks = (top.indices.unsqueeze(-1) * P + offsets).flatten(-2)  # (B, H, Lq, most P): whole real pages
    own_ranks = (r.unsqueeze(-1) - offsets.flip(0)).expand(B, H, Lq, P)  # the P ranks up to the query's
    own_read = (own_ranks >= own_first.unsqueeze(-1)) & query_real.unsqueeze(-1)
    ranks = torch.cat([page_ranks, own_ranks], -1).clamp(0, n - 1)
    read = torch.cat([chosen.repeat_interleave(P, dim=-1), own_read], -1)
    positions = order.gather(1, ranks.reshape(B, -1)).view(ranks.shape)
    return _attend(q, _gather(k, positions, rep), _gather(v, positions, rep), read, scale)
