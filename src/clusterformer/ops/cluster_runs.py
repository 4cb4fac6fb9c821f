"""Each query's run of keys from its own cluster, when queries and keys are clustered apart.

A query i with cluster id ``query_ids[i]`` = c reads ``width`` keys of the keys whose id ``key_ids[j]`` is c:

* causal: the ``width`` latest such keys at positions j <= i (fewer when fewer came before);
* otherwise: ``width`` consecutive keys of c in position order, the ones around the query's place among them
  (its rank r = the keys of c before position i; the run starts at r - width // 2, moved inside c's keys).

Sorting the keys by (cluster, position) puts every cluster's keys in one run of slots, in position order, so each
query's keys are consecutive slots: a :class:`~clusterformer.ops.listed_attention.SlotRuns` with one run per query,
which :func:`~clusterformer.ops.listed_attention.listed_attention` reads without an index per key. Where a query
stands among its cluster's keys is one batched ``searchsorted`` of (its cluster, its position) in the sorted keys:
O(N log N) per head, no (N, k) counts, no loop over clusters.

A query may name several clusters (``query_ids`` (B, H, N, R)): it then reads one such run from each, R runs, each
of up to ``width`` keys; a key belongs to one cluster, so the runs of distinct ids never share a key. With
``split="fill"``, ``width`` is the query's keys over all its runs instead, shared out by water-filling: each run
takes what its cluster has (at positions <= i under a causal mask) up to a common level, the largest at which the
runs hold at most ``width`` keys together, and the few keys left below ``width`` go one each to the first runs (the
query's nearest clusters first) that have more. A small cluster then leaves its share to the query's other
clusters rather than leaving it unread.

This is what neural-clustering's ``cluster_on="query-key"`` attends with (its queries and keys assigned to shared
centroids by their own projections); the chunked layouts of :mod:`clusterformer.ops.layouts` need one id per
token, shared by its query and its key.
"""

from __future__ import annotations

import torch

from ..masks import NO_MASK, AttentionMask
from .listed_attention import SlotRuns, listed_attention, listed_attention_reference

__all__ = ["SPLITS", "cluster_runs", "run_attention"]

SPLITS = ("each", "fill")


def cluster_runs(query_ids: torch.Tensor, key_ids: torch.Tensor, width: int | torch.Tensor, *, causal: bool,
                 query_real: torch.Tensor | None = None, split: str = "each") -> SlotRuns:
    """The runs (module docstring) for ``key_ids`` (B, H, N) and ``query_ids`` (B, H, N), or (B, H, N, R) for R
    clusters per query (distinct per query), int64 ids >= 0.

    Ids must be >= 0 (not checked here: a check would sync a device each call). A key whose id no query has (e.g.
    one past the clusters, for padding) is never read. ``width``: the most keys per query and run, an int or a (B,)
    int64 tensor (one per sequence); ``split``: "each" (``width`` per run) or "fill" (``width`` over the query's
    runs together, water-filled: module docstring); ``query_real``: optional (B, N) bool, False for a query that
    reads nothing (padding). Returns SlotRuns with order (B, H, N) and first, length (B, H, N, R) (R = 1 for
    (B, H, N) ids)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if key_ids.dim() != 3 or query_ids.dim() not in (3, 4) or query_ids.shape[:3] != key_ids.shape:
        raise ValueError(f"key_ids must be (B, H, N) and query_ids (B, H, N) or (B, H, N, R) of the same B, H, N; "
                         f"got query_ids {tuple(query_ids.shape)} and key_ids {tuple(key_ids.shape)}")
    if query_ids.dim() == 3:
        query_ids = query_ids.unsqueeze(-1)
    if query_ids.dtype != torch.long or key_ids.dtype != torch.long:
        raise ValueError(f"query_ids and key_ids must be int64; got {query_ids.dtype} and {key_ids.dtype}")
    B, H, N = key_ids.shape
    R = query_ids.shape[-1]
    device = key_ids.device
    if query_real is not None and query_real.shape != (B, N):
        raise ValueError(f"query_real must be a (B, N) = {(B, N)} bool tensor; got {tuple(query_real.shape)}")
    if isinstance(width, int):  # the common case: no device sync for the capacity
        if width < 0:
            raise ValueError(f"width must be >= 0; got {width}")
        widths, capacity = torch.full((B, 1, 1, 1), width, dtype=torch.long, device=device), width
    else:
        if width.shape != (B,):
            raise ValueError(f"width must be an int or a (B,) = ({B},) tensor; got shape {tuple(width.shape)}")
        widths = width.to(device=device, dtype=torch.long).view(B, 1, 1, 1)
        if widths.numel() and int(widths.min()) < 0:
            raise ValueError(f"width must be >= 0; got {width.tolist()}")
        capacity = int(widths.max()) if widths.numel() else 0
    positions = torch.arange(N, device=device)
    # (cluster, position) as one sortable number; sorted, every cluster's keys are one run in position order
    composite, order = torch.sort(key_ids * N + positions, dim=-1, stable=True)
    flat = composite.reshape(B * H, N)
    positions = positions.view(N, 1)  # against the query's R ids

    def slots_before(values: torch.Tensor) -> torch.Tensor:  # sorted keys < values, (B, H, N, R)
        return torch.searchsorted(flat, values.reshape(B * H, N * R)).view(B, H, N, R)

    start = slots_before(query_ids * N)  # the first slot of the query's cluster
    end = slots_before((query_ids + 1) * N)  # one past its last
    if causal:  # the latest `width` keys of the cluster at positions <= i
        upto = slots_before(query_ids * N + positions + 1)
        available = upto - start
    else:  # `width` keys of the cluster around the query's rank, moved inside the cluster's run
        available = end - start
    length = torch.minimum(widths, available) if split == "each" else _water_fill(available, widths)
    if causal:
        first = upto - length
    else:
        rank = slots_before(query_ids * N + positions)
        first = torch.minimum(torch.maximum(start, rank - length // 2), end - length)
    if query_real is not None:
        length = length.masked_fill(~query_real.view(B, 1, N, 1), 0)
    first = first.clamp(max=max(N - 1, 0)) if N else first  # a run of length 0 still names a slot in [0, N)
    return SlotRuns(order, first, length, capacity)


def _water_fill(available: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """Lengths (B, H, N, R) of at most ``available`` (B, H, N, R) keys per run and ``total`` (B, 1, 1, 1) per query:
    min(available, level) at the largest level whose sum is <= total, the rest (fewer than the runs above the level)
    one each to the first runs above it. Over the R runs sorted by size, the level is the first candidate
    (total - the smaller runs) // (the runs left) below its own run's size -- where taking whole runs stops."""
    R = available.shape[-1]
    sizes = available.sort(-1).values
    taken = sizes.cumsum(-1) - sizes  # the smaller runs, taken whole
    candidate = (total - taken).clamp(min=0) // torch.arange(R, 0, -1, device=available.device)
    short = candidate < sizes
    level = torch.where(short.any(-1, keepdim=True), candidate.gather(-1, short.long().argmax(-1, keepdim=True)),
                        sizes[..., -1:])
    length = torch.minimum(available, level)
    above = available > level
    left = total - length.sum(-1, keepdim=True)
    return length + (above & (above.long().cumsum(-1) <= left)).long()


def run_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: SlotRuns, *, dropout_p: float = 0.0,
                  mask: AttentionMask = NO_MASK) -> torch.Tensor:
    """Each query (B, H, N, D) over its run's keys: (B, H, N, D), 0 for a query without keys. The fused kernel
    without dropout (:func:`~clusterformer.ops.listed_attention.listed_attention`); with ``dropout_p`` > 0 (a
    training forward) the run's keys gathered, (B, H, N, capacity, D), and the weights dropped out as SDPA drops
    them (zeroed with probability p, the rest scaled by 1 / (1 - p)). On CUDA or in half precision the fused kernel
    is not there either: both paths then hold the gathered keys and values (B, H, N, capacity, D) for the backward."""
    no_list = q.new_empty(*q.shape[:3], 0, dtype=torch.long)  # every key a query reads is in its run
    if not dropout_p:
        return listed_attention(q, k, v, no_list, mask=mask, runs=runs)[0]
    return listed_attention_reference(q, k, v, no_list, mask=mask, runs=runs, dropout_p=dropout_p)[0]
