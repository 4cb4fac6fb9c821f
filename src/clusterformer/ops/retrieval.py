"""Cluster retrieval over a growing key/value cache: long-context decoding that reads a fraction of the keys.

The setting of ClusterKV and Squeezed Attention (pretrained decoder LLMs, long prompts): per layer and key/value
head, the cached keys are grouped by K-means; each query scores the cluster centroids and attends exactly to the
keys of its best clusters, up to a budget, plus the first few tokens (attention sinks, which soak up attention
mass in pretrained LLMs) and a recent window. Without an index this is StreamingLLM's sinks + window (the
``sink-window`` mechanism). The registered mechanisms and their options: :mod:`clusterformer.attention.retrieval`.

Per query q (scaled by ``scale``) of a head whose key/value head holds the cache, with C clusters of sizes s_c,
key means mu_c and value means nu_c:

The budget. ``budget`` (a fraction of a sequence's real cached keys, rounded up, or a count) is what each query
reads, every key and every centroid term counted once: A = sinks + centroid terms + window + retrieved keys.
The sinks are the first ``min(sink, A - 1)`` real tokens (a query keeps at least its own key); the centroid
terms of ``estimate_remainder`` are C (the number of clusters), reserved where some key would be left out and A
leaves room for them beyond the sinks and one key (else the remainder is not estimated for that sequence:
without room, or because every key is read); the rest, the *cap*,
goes to the query's window -- its ``cap`` most recent positions up to its own, never before ``index.end`` --
and to the retrieved keys, R = cap - (n - index.end) when positive. Window positions that the cap leaves out,
and that the index does not hold yet, are not read: the budget is a bound, not a target.

1. Scores q . mu_c; clusters in descending score order fill the R slots (the last one possibly in part), by
   position within a cluster. Under grouped-query attention the query heads that share a key/value head share
   the ranking (by their best score): one gather of keys per group. ``rerank`` = f > 1 (beyond ClusterKV): the
   clusters fill f x R slots with candidates, and the R candidates of highest exact q . k (the best over the
   queries that share the ranking) are the retrieved keys -- f x R keys scored, R attended.
2. Exact softmax attention over the union of the sink keys, the window (causal), and the retrieved keys.
3. ``estimate_remainder=True`` (beyond ClusterKV): the keys of each cluster that were *not* retrieved, n'_c of
   them, enter the same softmax as one term with logit q . mu_c + log n'_c and value nu_c -- the cluster seen
   from its centroid, as improved-clustered attention treats the keys outside its top-k (there, eq. 11, the
   cluster is a query cluster; here it is a key cluster).

The three key sets are disjoint by construction: the index holds the real keys of rank >= ``sink`` (per
sequence) at positions before the window; a key joins the index when it leaves the window. A budget that
covers every key (``A >= n``: the caller attends densely then) reads every key: the result is dense attention
(up to rounding).

The index (:class:`KeyClusterIndex`) is built by :func:`build_index` after a prefill (Lloyd K-means,
:func:`clusterformer.clustering.euclidean_kmeans`, on each head's keys: nearby keys have nearby logits for
every query, |q.k1 - q.k2| <= |q| |k1 - k2|, so Euclidean clusters are the ones a dot-product query can rank
by their mean). :func:`extend_index` lets each key that leaves the window join its nearest centroid (the
running means move with it); after ``refresh`` joins the index is rebuilt from all its keys. Members are kept
per cluster in a slot array (G, C, capacity) that grows by doubling, so a join is O(C D), not a re-sort.

Cost per query and head: O(C D) to score the centroids, O(f R log C) to find the slots, O(f R D) to re-rank
(f = ``rerank``), O((sink + window + R) D) to attend -- against O(n D) for dense attention over n cached keys.
Clustering: O(iterations n C D) per rebuild, amortised over ``refresh`` tokens.

Kernels. A decoding step (one query position, ``"group"`` or ``"head"`` selection, no remainder estimate) runs
as one C++ pass per (sequence, key/value head, unit) where the extension is built (``csrc/retrieval_decode.cpp``,
option ``kernel``: steps 1-2 above reading the candidate rows where they lie in the cache, prefetched, instead of
gathering copies of them); every other call is the PyTorch composition below, which is also the reference the
tests hold the kernel to.

Masks: the call's :class:`~clusterformer.masks.AttentionMask` -- causal order (a cache is read causally) and
padding (B, n) or None (left padding, as Hugging Face batches prompts for generation); inside, its view ``real``
(:meth:`~clusterformer.masks.AttentionMask.real`) marks the real keys.
Every choice is per sequence -- its budget from its own number of real keys, its own sinks, clusters from its
own keys only (padding never seeds or moves a centroid) -- so a sequence's outputs do not depend on the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from ..clustering.kmeans import cluster_sums, euclidean_kmeans
from ..masks import CAUSAL_MASK, AttentionMask, allow_empty_rows, check_mask
from .extensions import CppExtension
from .layouts import group_ranks

__all__ = ["DECODE_KERNEL", "JOIN_BATCH", "KeyClusterIndex", "RetrievalSettings", "build_index",
           "decode_kernel_unusable", "extend_index", "gather_positions", "keys_allowed", "keys_allowed_count",
           "retrieval_attention"]


class RetrievalSettings(Protocol):
    """What the functions of this module read from a mechanism's options
    (:class:`clusterformer.attention.retrieval.ClusterRetrievalOptions`, whose docstring defines each one;
    sink-window's options have no ``num_clusters`` and never reach the index)."""

    budget: float | int
    num_clusters: int
    sink: int
    window: int
    refresh: int
    iterations: int
    estimate_remainder: bool
    selection: str
    rerank: int
    kernel: str


def keys_allowed(budget: float | int, lengths: torch.Tensor) -> torch.Tensor:
    """(B,) real cached keys -> (B,) keys a query may attend to under ``budget`` (a fraction of the cache,
    rounded up, or a count; at most the cache)."""
    if isinstance(budget, float):
        allowed = torch.ceil(lengths.double() * budget).long()
    else:
        allowed = torch.full_like(lengths, budget)
    return torch.minimum(allowed, lengths)


def keys_allowed_count(budget: float | int, length: int) -> int:
    """:func:`keys_allowed` for one length given as a Python int (no tensors: the decoding hot path)."""
    return min(length, math.ceil(length * budget) if isinstance(budget, float) else budget)


JOIN_BATCH = 16  # keys leave the window for the index in batches: one update per 16 decoding steps


@dataclass
class KeyClusterIndex:
    """The clustered keys of one layer: G = B x (key/value heads) rows of C clusters.

    centroids (G, C, D), key_sums (G, C, D), value_sums (G, C, Dv) in the compute dtype, and the centroids
    transposed in the keys' dtype for scoring (G, D, C); counts (G, C) long; members (G, C, capacity) the
    positions of each cluster's keys (the first counts[g, c] valid, in the order they joined); sinks (B, S)
    positions of each sequence's first real tokens, sink_ok (B, S) which exist; end: the index holds the real
    keys of rank >= sink at positions < end, and the window is everything from ``end`` on; joined: keys that
    joined since the last clustering; fewest: the fewest keys any row holds (slots beyond it may be empty);
    length: the cache length at the last call; probe (G, P, D): the keys at :data:`PROBES` positions spread over
    0 .. end - 1 then (to recognise the same cache later), probe_at (P,) those positions; options: the settings it
    was clustered under (:meth:`follows` refuses it to a reader with other settings)."""

    centroids: torch.Tensor
    centroids_t: torch.Tensor
    key_sums: torch.Tensor
    value_sums: torch.Tensor
    counts: torch.Tensor
    members: torch.Tensor
    sinks: torch.Tensor
    sink_ok: torch.Tensor
    end: int
    joined: int
    fewest: int
    length: int
    probe: torch.Tensor | None
    options: RetrievalSettings
    probe_at: torch.Tensor | None = None
    _live: tuple[int, torch.Tensor] | None = None

    def follows(self, k: torch.Tensor, options: RetrievalSettings | None = None) -> bool:
        """Whether cache keys k (B, Hkv, n, D) continue the cache this index was built on, and (given
        ``options``, the settings the caller reads the cache with) whether it was built under those settings: an
        index clustered under others (another number of clusters, other sinks) is not this reader's."""
        if options is not None and options is not self.options and options != self.options:
            return False
        B, Hkv, n, D = k.shape
        if B * Hkv != self.counts.shape[0] or n < self.length or self.centroids.shape[-1] != D:
            return False
        if self.probe is None:
            return True
        return bool(torch.equal(k[:, :, self.probe_at].reshape(B * Hkv, -1, D), self.probe))

    @property
    def sink_live(self) -> torch.Tensor:
        """(B, S) the sinks attended as sinks: before the window (a sink inside the window is counted there)."""
        if self._live is None or self._live[0] != self.end:
            self._live = (self.end, self.sink_ok & (self.sinks < self.end))
        return self._live[1]


def _ranks(real: torch.Tensor) -> torch.Tensor:
    """(B, n) bool -> (B, n) long: number of real keys before each position."""
    return real.long().cumsum(1) - real.long()


def _indexable(real: torch.Tensor, sink: int, end: int) -> torch.Tensor:
    """(B, end) bool: real keys of rank >= sink before ``end``."""
    return real[:, :end] & (_ranks(real)[:, :end] >= sink)


def _first_real(real: torch.Tensor | None, count: int, batch: int = 0, n: int = 0,
                device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions (B, S) of each row's first ``count`` real keys, which exist (B, S)), S = min(count, n).
    ``real`` None: no padding (then ``batch``, ``n`` and ``device`` give the shape)."""
    if real is None:
        positions = torch.arange(min(count, n), device=device).expand(batch, -1)
        return positions, torch.ones(positions.shape, dtype=torch.bool, device=device)
    positions = torch.sort((~real).to(torch.uint8), dim=1, stable=True).indices[:, :min(count, real.shape[1])]
    return positions, real.gather(1, positions)


def _tally(points: torch.Tensor, values: torch.Tensor, assign: torch.Tensor, valid: torch.Tensor,
           C: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What keys (G, m, D) with values (G, m, Dv), assigned to clusters (G, m), add to an index (only the
    ``valid`` ones): key sums, value sums, counts (G, C) long, each key's group (C for an invalid key: an extra
    group that is dropped) and its rank among the earlier keys of that group."""
    weight = valid.to(points.dtype)
    key_sums, counts = cluster_sums(points, assign, C, weight)
    value_sums, _ = cluster_sums(values, assign, C, weight)
    ids = torch.where(valid, assign, C)
    rank, _ = group_ranks(ids, C + 1)
    return key_sums, value_sums, counts.round().long(), ids, rank


def build_index(k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None, end: int,
                options: RetrievalSettings) -> KeyClusterIndex:
    """Cluster the keys at positions < ``end`` of cache k, v (B, Hkv, n, D); ``mask``: the cache's
    :class:`~clusterformer.masks.AttentionMask`, whose padding (B, n) or None is read (None: no padding)."""
    B, Hkv, n, D = k.shape
    real = check_mask(mask, B, n).real(B, n, k.device)
    G, C = B * Hkv, max(1, options.num_clusters)
    dtype = torch.promote_types(k.dtype, torch.float32)
    sinks, sink_ok = _first_real(real, options.sink)
    valid = _indexable(real, options.sink, end).unsqueeze(1).expand(B, Hkv, end).reshape(G, end)
    points = k[:, :, :end].reshape(G, end, D).to(dtype)
    values = v[:, :, :end].reshape(G, end, v.shape[-1]).to(dtype)
    if end == 0:
        assign = torch.zeros(G, 0, dtype=torch.long, device=k.device)
    else:
        assign = euclidean_kmeans(points, C, iterations=options.iterations, valid=valid)
    key_sums, value_sums, counts, ids, rank = _tally(points, values, assign, valid, C)
    capacity = max(1, int(counts.max()) if counts.numel() else 1)
    members = torch.zeros(G * (C + 1) * capacity, dtype=torch.long, device=k.device)
    g = torch.arange(G, device=k.device).unsqueeze(1)
    slot = ((g * (C + 1) + ids) * capacity + rank.clamp(max=capacity - 1))[valid]
    members[slot] = torch.arange(end, device=k.device).expand(G, end)[valid]
    centroids = key_sums / counts.clamp(min=1).unsqueeze(-1).to(dtype)
    index = KeyClusterIndex(
        centroids=centroids, centroids_t=centroids.transpose(1, 2).to(k.dtype).contiguous(), key_sums=key_sums,
        value_sums=value_sums, counts=counts, members=members.view(G, C + 1, capacity)[:, :C].contiguous(),
        sinks=sinks.contiguous(), sink_ok=sink_ok,  # contiguous once here: every fused decoding step reads them
        end=end, joined=0, fewest=int(counts.sum(1).min()) if G else 0, length=n, probe=None, options=options,
    )
    _set_probe(index, k)
    return index


PROBES = 8  # cached keys an index compares to recognise the cache it was built on


def _probe_positions(end: int) -> torch.Tensor:
    """The positions :meth:`KeyClusterIndex.follows` compares: :data:`PROBES` spread over 0 .. end - 1, the last
    one included."""
    return torch.linspace(0, end - 1, min(PROBES, end)).round().long().unique()


def _set_probe(index: KeyClusterIndex, k: torch.Tensor) -> None:
    B, Hkv, n, D = k.shape
    index.length = n
    if index.end == 0:
        index.probe = index.probe_at = None
        return
    index.probe_at = _probe_positions(index.end)  # kept: follows() reads the same positions at every step
    index.probe = k[:, :, index.probe_at].reshape(B * Hkv, -1, D).clone()


def extend_index(index: KeyClusterIndex, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None,
                 end: int, options: RetrievalSettings) -> KeyClusterIndex:
    """Let the keys at positions [index.end, end) join their nearest centroids (re-cluster everything once
    ``refresh`` keys have joined since the last clustering, or when ``index`` was built under other ``options``).
    Returns the (updated in place or new) index."""
    if not (options is index.options or options == index.options):
        return build_index(k, v, mask, end, options)
    start = index.end
    if end <= start:
        _set_probe(index, k)
        return index
    if index.joined + (end - start) > options.refresh:
        return build_index(k, v, mask, end, options)
    B, Hkv, n, D = k.shape
    real = check_mask(mask, B, n).real(B, n, k.device)
    G, C = B * Hkv, index.counts.shape[1]
    dtype = index.centroids.dtype
    valid = _indexable(real, options.sink, end)[:, start:]
    valid = valid.unsqueeze(1).expand(B, Hkv, end - start).reshape(G, end - start)
    points = k[:, :, start:end].reshape(G, end - start, D).to(dtype)
    values = v[:, :, start:end].reshape(G, end - start, v.shape[-1]).to(dtype)
    c = index.centroids
    score = torch.baddbmm(-(c * c).sum(-1).unsqueeze(1), points, c.transpose(1, 2), alpha=2)
    score = score.masked_fill(index.counts.unsqueeze(1) == 0, float("-inf"))  # only clusters with members
    assign = score.max(-1).indices
    key_sums, value_sums, new_counts, ids, rank = _tally(points, values, assign, valid, C)
    rank = rank + torch.cat([index.counts, index.counts.new_zeros(G, 1)], 1).gather(1, ids)
    counts = index.counts + new_counts
    capacity = index.members.shape[-1]
    needed = int(counts.max())
    if needed > capacity:  # grow by doubling: amortised O(1) per join
        grown = index.members.new_zeros(G, C, max(needed, 2 * capacity))
        grown[..., :capacity] = index.members
        index.members, capacity = grown, grown.shape[-1]
    g = torch.arange(G, device=k.device).unsqueeze(1)
    slot = ((g * C + assign) * capacity + rank)[valid]
    index.members.view(-1)[slot] = torch.arange(start, end, device=k.device).expand(G, end - start)[valid]
    index.key_sums += key_sums
    index.value_sums += value_sums
    index.counts = counts
    index.centroids = torch.where(counts.unsqueeze(-1) > 0, index.key_sums / counts.clamp(min=1).unsqueeze(-1),
                                  index.centroids)
    index.centroids_t = index.centroids.transpose(1, 2).to(k.dtype).contiguous()
    index.fewest = int(counts.sum(1).min())
    index.joined += end - start
    index.end = end
    _set_probe(index, k)
    return index


def retrieval_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None,
                        index: KeyClusterIndex | None, options: RetrievalSettings, scale: float,
                        selection: str | None = None, ranking: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the last Lq positions of a cache to it, by sinks + window + retrieved clusters.

    Args:
        q: (B, H, Lq, D) queries of cache positions n - Lq .. n - 1 (H a multiple of the key/value heads).
        k, v: (B, Hkv, n, D) the cache, the queries' own keys included.
        mask: the call's :class:`~clusterformer.masks.AttentionMask`: causal (or one query), without a window;
            its padding (B, n) or None. None: :data:`~clusterformer.masks.CAUSAL_MASK` (no padding).
        index: the clustered keys (:func:`build_index`); the window is then every position from ``index.end``
            on (at least ``options.window`` and the Lq queries: the caller keeps the index that far back). None:
            sinks + window only, the window taking what the sinks leave of the budget (sink-window).
        options: the budget and its parts.
        scale: softmax scale.
        selection: who shares a ranking of the clusters and one set of retrieved keys: ``"head"`` (each query),
            ``"group"`` (the query heads of a key/value head, per position), ``"block"`` (those heads at all Lq
            positions: the sparse prefill's blocks); None: ``options.selection``.
        ranking: with ``"block"``, the queries (B, H, Lr, D) whose best scores rank the clusters and the
            re-ranked candidates, in place of the call's own real queries. The sparse prefill passes the block
            before: then no query's keys depend on a later query of its block (strict causality).

    Returns:
        (B, H, Lq, D).
    """
    if selection is not None and selection not in ("head", "group", "block"):
        raise ValueError(f"selection must be 'head', 'group' or 'block'; got {selection!r}")
    B, H, Lq, D = q.shape
    Hkv, n = k.shape[1], k.shape[2]
    rep = H // Hkv
    Q = rep * Lq
    mask = CAUSAL_MASK if mask is None else check_mask(mask, B, n, device=q.device)
    if (not mask.causal and Lq > 1) or mask.window is not None:
        raise ValueError("mask must be causal (or one query) and without a window: a cache is read causally")
    real = None if mask.padding is None else mask.real(B, n, q.device)  # None: no masks
    if real is None:  # every row holds n keys: the budget is one number
        allowed: torch.Tensor | int = keys_allowed_count(options.budget, n)
    else:
        allowed = keys_allowed(options.budget, real.sum(1))  # (B,)
    if index is not None:
        return _attend_retrieved(q, k, v, real, index, options, scale, allowed, selection or options.selection,
                                 ranking)
    # Sinks + window (StreamingLLM): the sinks shared by every query of a group, each query's window its own most
    # recent positions, up to the budget with the sinks.
    qg = q.reshape(B, Hkv, Q, D) * scale  # queries grouped by their key/value head: no copies of the cache
    sink_count, cap = _split_budget(allowed, options.sink, 0)
    sinks, sink_ok = _first_real(real, options.sink, B, n, q.device)
    start = max(0, n - Lq - (cap if isinstance(cap, int) else int(cap.max())) + 1)
    keys = torch.cat([gather_positions(k, sinks), k[:, :, start:]], 2)  # (B, Hkv, S + W, D)
    values = torch.cat([gather_positions(v, sinks), v[:, :, start:]], 2)
    logits = qg @ keys.transpose(-1, -2)  # (B, Hkv, Q, S + W)
    query_pos = (n - Lq + torch.arange(Lq, device=q.device)).repeat(rep)  # (Q,): queries in (head, position) order
    ok = _read_mask(query_pos, sinks, sink_ok, sink_count, start, n, cap, real)  # (B, Q, S + W)
    ok, no_key = allow_empty_rows(ok.unsqueeze(1))  # a query with no key at all (a padded row): zeros, by the rule
    weights = torch.softmax(logits.masked_fill(~ok, float("-inf")), dim=-1)
    return (weights @ values).masked_fill(no_key, 0.0).reshape(B, H, Lq, -1)


def _split_budget(allowed: torch.Tensor | int, sink: int, reserved: torch.Tensor | int
                  ) -> tuple[torch.Tensor | int, torch.Tensor | int]:
    """The budget's accounting, every key or centroid a query reads counted once: ``allowed`` keys per query
    (an int, or (B,) per sequence) = sinks + ``reserved`` (centroid terms) + the query's window + retrieved keys.
    Returns (the sinks read, at most ``sink`` and leaving the query at least its own key; the cap of the window
    and the retrieved keys together, >= 1)."""
    if isinstance(allowed, int):
        sinks = max(0, min(sink, allowed - 1))
        return sinks, max(1, allowed - sinks - reserved)
    sinks = (allowed - 1).clamp(min=0, max=sink)
    return sinks, (allowed - sinks - reserved).clamp(min=1)


def _read_mask(query_pos: torch.Tensor, sinks: torch.Tensor, sink_ok: torch.Tensor, sink_count: torch.Tensor | int,
               start: int, n: int, cap: torch.Tensor | int, real: torch.Tensor | None) -> torch.Tensor:
    """(B, Q, S + W) bool: which sinks (B, S) and which positions start .. n - 1 each query (at ``query_pos``
    (Q,)) reads: the first ``sink_count`` sinks that exist and lie before its window, and the real positions of
    its window -- the ``cap`` most recent positions up to its own (causal)."""
    B, S = sinks.shape
    cap_ = cap if isinstance(cap, int) else cap.view(B, 1, 1)
    count = sink_count if isinstance(sink_count, int) else sink_count.view(B, 1, 1)
    first = (query_pos.view(1, -1, 1) - cap_ + 1).clamp(min=start)  # (1 or B, Q, 1): its first window position
    sink_read = sink_ok.unsqueeze(1) & (torch.arange(S, device=sinks.device) < count) & (sinks.unsqueeze(1) < first)
    positions = torch.arange(start, n, device=sinks.device)
    window = (positions <= query_pos.view(1, -1, 1)) & (positions >= first)
    if real is not None:
        window = window & real[:, None, start:]
    return torch.cat([sink_read.expand(B, -1, S), window.expand(B, -1, n - start)], -1)


@dataclass(frozen=True)
class _Units:
    """Who shares one set of retrieved keys (:func:`_attend_retrieved`): ``queries`` (B, Hkv, U, m, D), the m
    scaled queries of each of U units; ``scaled`` (B, Hkv, rep, Lq, D) the same queries by head and position;
    ``positions`` (U, m), or (U, 1) where a unit's queries share one position ("group"), their cache positions."""

    queries: torch.Tensor
    scaled: torch.Tensor
    positions: torch.Tensor
    selection: str

    @property
    def count(self) -> int:
        return self.queries.shape[2]


def _units(q: torch.Tensor, scale: float, Hkv: int, n: int, selection: str) -> _Units:
    """The units of ``selection`` for q (B, H, Lq, D) at the last Lq positions of a cache of n: per query head and
    position ("head", m = 1), per key/value head and position ("group": its query heads, m = rep), or per key/value
    head for all Lq positions ("block", m = rep x Lq); units in (head, position) order, "group"'s in position order."""
    B, H, Lq, D = q.shape
    rep = H // Hkv
    scaled = (q * scale).view(B, Hkv, rep, Lq, D)
    U, m = {"head": (rep * Lq, 1), "group": (Lq, rep), "block": (1, rep * Lq)}[selection]
    queries = scaled.permute(0, 1, 3, 2, 4) if selection == "group" else scaled.reshape(B, Hkv, U, m, D)
    steps = torch.arange(Lq, device=q.device)
    positions = n - Lq + (steps.view(Lq, 1) if selection == "group" else steps.repeat(rep).view(U, m))
    return _Units(queries, scaled, positions, selection)


@dataclass(frozen=True)
class _Budget:
    """A call's budget in parts (:func:`_retrieval_budget`): the sinks read, the cap of the window and the
    retrieved keys together, the centroid terms reserved (``estimate_remainder``), the retrieved keys' width R and
    each row's share of it (an int, or (B, 1, 1, 1) per sequence)."""

    sink_count: torch.Tensor | int
    cap: torch.Tensor | int
    reserved: torch.Tensor | int
    width: int
    row_budget: torch.Tensor | int


def _retrieval_budget(allowed: torch.Tensor | int, options: RetrievalSettings, index: KeyClusterIndex,
                      real: torch.Tensor | None, n: int, B: int, Hkv: int) -> _Budget:
    """The budget, every key or centroid read counted: sinks, the C centroid terms of estimate_remainder (where the
    budget leaves room for them: else none), the query's window (the most recent positions, up to the cap) and the
    retrieved keys, which fill what the last query's window leaves of the cap."""
    start, C = index.end, index.counts.shape[1]
    W = n - start
    sink_count, cap = _split_budget(allowed, options.sink, 0)
    reserved: torch.Tensor | int = 0
    # The window a sequence's last real query reads: W positions, fewer where padding ends the sequence early (the
    # sparse prefill reads padded batches with their padding last; left padding never reaches a window that
    # holds keys the index does not).
    window_read = W if real is None else real[:, start:].sum(1)
    if options.estimate_remainder:  # needed where the cap cannot retrieve every key a head of the sequence holds
        held = index.counts.sum(-1).view(B, Hkv).amax(1)  # (B,)
        if isinstance(allowed, int):
            needed = cap - W < int(held.max()) and allowed - sink_count - 1 >= C
            reserved = C if needed else 0
        else:
            reserved = torch.where((cap - window_read < held) & (allowed - sink_count - 1 >= C), C, 0)
        sink_count, cap = _split_budget(allowed, options.sink, reserved)
    if isinstance(cap, int):
        retrieved = max(0, cap - W)
        return _Budget(sink_count, cap, reserved, retrieved, retrieved)
    retrieved = (cap - window_read).clamp(min=0)
    return _Budget(sink_count, cap, reserved, int(retrieved.max()), retrieved.view(B, 1, 1, 1))


def _sinks_and_window(units: _Units, index: KeyClusterIndex, budget: _Budget, real: torch.Tensor | None, n: int
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Every unit's sinks and window (every position from ``index.end``): their positions, (B, Hkv, U, S) and
    (B, Hkv, U, W), and which each query reads, (B, 1, U, m or 1, width) bool, or None where it reads them all
    (SDPA's unmasked path is the faster one)."""
    B, Hkv, U = units.queries.shape[:3]
    start, S = index.end, index.sinks.shape[1]
    W = n - start
    positions = [index.sinks.view(B, 1, 1, S).expand(B, Hkv, U, S),
                 torch.arange(start, n, device=units.queries.device).view(1, 1, 1, W).expand(B, Hkv, U, W)]
    read = _read_mask(units.positions.reshape(-1), index.sinks, index.sink_live, budget.sink_count, start, n,
                      budget.cap, real).view(B, 1, U, units.positions.shape[1], S + W)
    return positions, [None if bool(part.all()) else part for part in (read[..., :S], read[..., S:])]


def _cluster_scores(units: _Units, index: KeyClusterIndex, ranking: torch.Tensor | None, real: torch.Tensor | None,
                    n: int) -> torch.Tensor:
    """(B, Hkv, U, C): each unit's score of each cluster -- its query's q . mu_c, or the best among its queries
    (they read the same cache, so the unit gathers its keys once); with "block" and ``ranking`` (B, Hkv, 1, Q, D),
    scaled, the best among those queries in place of the unit's own, of which a padding query (past a short
    sequence's end) ranks nothing."""
    B, Hkv, rep, Lq, D = units.scaled.shape
    C = index.counts.shape[1]
    centroids = index.centroids_t.view(B, Hkv, 1, D, C)
    if units.selection == "block" and ranking is not None:  # the block's ranking queries, not its own
        return (ranking @ centroids).amax(3)  # (B, Hkv, 1, C)
    head_scores = units.scaled @ centroids  # (B, Hkv, rep, Lq, C): q . mu_c
    if units.selection == "head":
        return head_scores.reshape(B, Hkv, rep * Lq, C)
    if units.selection == "group":
        return head_scores.amax(2)
    if real is not None:
        head_scores = head_scores.masked_fill(~real[:, n - Lq:].view(B, 1, 1, Lq, 1), float("-inf"))
    return head_scores.amax((2, 3)).unsqueeze(2)


@dataclass(frozen=True)
class _Retrieved:
    """The clusters in each unit's order (``perm``, ``sizes``, their running total ``cum``: (B, Hkv, U, C)) and the
    keys retrieved from them: ``candidates`` (B, Hkv, U, R) positions (None where R = 0), ``valid`` (B, Hkv, U, R)
    or None (all), ``kept_cluster`` the cluster of each key re-ranking kept (estimate_remainder; else empty)."""

    perm: torch.Tensor
    sizes: torch.Tensor
    cum: torch.Tensor
    candidates: torch.Tensor | None
    valid: torch.Tensor | None
    kept_cluster: torch.Tensor


def _retrieve(units: _Units, scores: torch.Tensor, index: KeyClusterIndex, k: torch.Tensor,
              real: torch.Tensor | None, options: RetrievalSettings, budget: _Budget, ranking: torch.Tensor | None,
              n: int) -> _Retrieved:
    """Each unit's retrieved keys: rerank x R slots filled by its ranked clusters' members in order (R without
    re-ranking), of which re-ranking keeps the R of best exact score (:func:`_rerank`)."""
    B, Hkv, U, C = scores.shape
    rep, Lq = units.scaled.shape[2:4]
    dev = scores.device
    capacity, R = index.members.shape[-1], budget.width
    perm = scores.sort(dim=-1, descending=True, stable=True).indices  # (B, Hkv, U, C)
    sizes = index.counts.view(B, Hkv, 1, C).expand(B, Hkv, U, C).gather(-1, perm)
    cum = sizes.cumsum(-1)
    if R == 0:
        return _Retrieved(perm, sizes, cum, None, None, torch.zeros(0))
    Rc = R * options.rerank
    slots = torch.arange(Rc, device=dev).expand(B, Hkv, U, Rc).contiguous()
    r = torch.searchsorted(cum, slots, right=True).clamp_(max=C - 1)  # the ranked cluster of each slot
    within = (slots - (cum - sizes).gather(-1, r)).clamp_(max=capacity - 1)  # past a row's keys: masked
    g = (torch.arange(B * Hkv, device=dev) * C).view(B, Hkv, 1, 1)
    flat = ((g + perm.gather(-1, r)) * capacity + within).view(-1)
    candidates = index.members.view(-1).index_select(0, flat).view(B, Hkv, U, Rc)
    needs_mask = index.fewest < Rc or real is not None  # rows with fewer keys or a smaller budget
    valid = (slots < cum[..., -1:]) & (slots < budget.row_budget * options.rerank) if needs_mask else None
    kept_cluster = torch.zeros(0)
    if options.rerank > 1:
        query_ok = None  # padding queries score nothing (as in the ranking)
        if units.selection == "block" and ranking is None and real is not None:
            query_ok = real[:, n - Lq:].repeat(1, rep).view(B, 1, 1, units.queries.shape[3])
        candidates, valid, chosen = _rerank(units.queries if ranking is None else ranking, k, candidates, valid,
                                            budget.row_budget, R, query_ok)
        if options.estimate_remainder:  # (B, Hkv, U, R): the cluster of each kept key
            kept_cluster = perm.gather(-1, r).gather(-1, chosen)
    return _Retrieved(perm, sizes, cum, candidates, valid, kept_cluster)


def _read_allowed(ok: list[torch.Tensor | None], widths: list[int], shape: tuple[int, int, int]
                  ) -> torch.Tensor | None:
    """The parts' masks (each (B, 1, U, rows, width) bool, or None: all read) side by side, (B, Hkv, U, rows, K);
    None where every part is read whole."""
    if all(part is None for part in ok):
        return None
    B, Hkv, U = shape
    rows = max(1 if part is None else part.shape[-2] for part in ok)
    device = next(part for part in ok if part is not None).device
    return torch.cat([(torch.ones(1, 1, U, 1, width, dtype=torch.bool, device=device) if part is None else part)
                      .expand(B, Hkv, U, rows, width) for part, width in zip(ok, widths, strict=True)], -1)


def _with_remainder(keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, index: KeyClusterIndex,
                    retrieved: _Retrieved, budget: _Budget, options: RetrievalSettings, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``estimate_remainder``: every cluster's unretrieved keys as one key mu_c with logit bias log n'_c, after the
    keys (B, Hkv, U, K, D) and values, in the queries' ``dtype``; the mask becomes additive, (B, Hkv, U, rows,
    K + C)."""
    B, Hkv, U, K, D = keys.shape
    sizes = retrieved.sizes
    C = sizes.shape[-1]
    if options.rerank > 1 and budget.width > 0:  # the kept keys are any members: count them per cluster
        kept = torch.ones_like(retrieved.kept_cluster) if retrieved.valid is None else retrieved.valid.long()
        left = index.counts.view(B, Hkv, 1, C) - torch.zeros_like(sizes).scatter_add_(-1, retrieved.kept_cluster,
                                                                                       kept)
    else:  # the retrieved keys are each ranked cluster's first members
        taken = (budget.row_budget - (retrieved.cum - sizes)).clamp(min=0)
        left = torch.zeros_like(sizes).scatter_(-1, retrieved.perm, sizes - torch.minimum(taken, sizes))
    bias = torch.log(left.to(dtype))  # log 0 = -inf: nothing left, no term
    if not isinstance(budget.reserved, int):  # the rows whose budget leaves no room for the centroid terms
        bias = bias.masked_fill((budget.reserved == 0).view(B, 1, 1, 1), float("-inf"))
    means = (index.value_sums / index.counts.clamp(min=1).unsqueeze(-1)).to(dtype).view(B, Hkv, 1, C, -1)
    zeros = torch.zeros(B, Hkv, U, 1 if mask is None else mask.shape[-2], K, dtype=dtype, device=keys.device)
    keys = torch.cat([keys, index.centroids.to(dtype).view(B, Hkv, 1, C, D).expand(B, Hkv, U, C, D)], 3)
    values = torch.cat([values, means.expand(B, Hkv, U, C, means.shape[-1])], 3)
    if mask is not None:
        zeros = zeros.masked_fill(~mask, float("-inf"))
    return keys, values, torch.cat([zeros, bias.unsqueeze(-2).expand(*zeros.shape[:-1], C)], -1)  # additive


def _attend_units(units: _Units, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                  real: torch.Tensor | None) -> torch.Tensor:
    """One fused attention per (sequence, key/value head, unit): its m queries on its keys (B, Hkv, U, K, D), under
    ``mask`` (bool or additive, (B, Hkv, U, rows, K)). Returns (B, H, Lq, Dv)."""
    B, Hkv, U, m, D = units.queries.shape
    rep, Lq = units.scaled.shape[2:4]
    no_key = None
    if mask is not None and real is not None:  # a query with no key at all (a padded row): zeros, by the rule
        # (without padding every query reads at least its own key)
        allowed = mask if mask.dtype == torch.bool else mask > float("-inf")
        allowed, no_key = allow_empty_rows(allowed)
        mask = allowed if mask.dtype == torch.bool else mask.masked_fill(no_key, 0.0)
    out = F.scaled_dot_product_attention(
        units.queries.reshape(B, Hkv * U, m, D), keys.view(B, Hkv * U, -1, D),
        values.view(B, Hkv * U, -1, values.shape[-1]),
        attn_mask=None if mask is None else mask.view(B, Hkv * U, mask.shape[-2], -1), scale=1.0)  # q is scaled
    if no_key is not None:
        out = out.masked_fill(no_key.view(B, Hkv * U, no_key.shape[-2], 1), 0.0)
    if units.selection == "group":  # units are positions, their queries heads
        return out.view(B, Hkv, Lq, rep, -1).permute(0, 1, 3, 2, 4).reshape(B, Hkv * rep, Lq, -1)
    return out.view(B, Hkv * rep, Lq, -1)  # (head, position) order


def _attend_retrieved(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor | None,
                      index: KeyClusterIndex, options: RetrievalSettings, scale: float,
                      allowed: torch.Tensor | int, selection: str,
                      ranking: torch.Tensor | None = None) -> torch.Tensor:
    """The index path of :func:`retrieval_attention`. A *unit* chooses one set of key positions -- sinks, window
    (every position from ``index.end``), retrieved slots -- gathered once for keys and once for values and
    attended in one fused SDPA call by its m queries: per query head and position (``selection="head"``, m = 1),
    per key/value head and position (``"group"``: the group's query heads, m = rep), or per key/value head for
    all Lq positions of the call (``"block"``, m = rep x Lq: one gather for the whole block, each query masked to
    its own causal window). The steps: the units (:func:`_units`), the budget's parts (:func:`_retrieval_budget`),
    the sinks and window (:func:`_sinks_and_window`), the clusters ranked (:func:`_cluster_scores`) and their keys
    retrieved (:func:`_retrieve`), with ``estimate_remainder`` a term per cluster for the rest
    (:func:`_with_remainder`), and the attention (:func:`_attend_units`). One decoding step without the remainder
    takes the fused C++ step instead (:func:`_decode_fused`)."""
    B, _, Lq, D = q.shape
    if Lq == 1 and ranking is None and selection != "block" and not options.estimate_remainder and \
            options.kernel != "torch":
        reason = decode_kernel_unusable(q, k, v)
        if reason is None:
            return _decode_fused(q, k, v, real, index, options, scale, allowed, selection == "head")
        if options.kernel == "fused":
            raise ValueError(f"cluster retrieval's kernel='fused' cannot run here: {reason}; use kernel='auto'")
    Hkv, n = k.shape[1], k.shape[2]
    units = _units(q, scale, Hkv, n, selection)
    budget = _retrieval_budget(allowed, options, index, real, n, B, Hkv)
    positions, ok = _sinks_and_window(units, index, budget, real, n)
    if ranking is not None and selection == "block":  # the block's ranking queries, scaled, as one unit's
        ranking = (ranking * scale).reshape(B, Hkv, 1, -1, D)
    retrieved = _retrieve(units, _cluster_scores(units, index, ranking, real, n), index, k, real, options, budget,
                          ranking, n)
    if retrieved.candidates is not None:
        positions.append(retrieved.candidates)
        ok.append(None if retrieved.valid is None else retrieved.valid.unsqueeze(-2))
    positions = torch.cat(positions, -1)  # (B, Hkv, U, K)
    keys, values = gather_positions(k, positions), gather_positions(v, positions)  # (B, Hkv, U, K, D)
    widths = [index.sinks.shape[1], n - index.end, budget.width][:len(ok)]
    mask = _read_allowed(ok, widths, (B, Hkv, units.count))
    if options.estimate_remainder and not (isinstance(budget.reserved, int) and budget.reserved == 0):
        keys, values, mask = _with_remainder(keys, values, mask, index, retrieved, budget, options, q.dtype)
    return _attend_units(units, keys, values, mask, real)


DECODE_KERNEL = CppExtension("retrieval_decode", "cluster retrieval's fused decoding step")


def decode_kernel_unusable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the fused decoding step (``csrc/retrieval_decode.cpp``) cannot run on these tensors, or None when it
    can: CPU, float32 or float64 alike, no gradient (it has no backward), the extension built."""
    if q.device.type != "cpu" or k.device.type != "cpu" or v.device.type != "cpu":
        return f"it runs on the CPU (got {q.device.type})"
    if q.dtype not in (torch.float32, torch.float64) or k.dtype != q.dtype or v.dtype != q.dtype:
        return (f"it takes float32 or float64 queries, keys and values of one dtype (got {q.dtype}, {k.dtype}, "
                f"{v.dtype})")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return "it has no backward (run decoding under torch.no_grad())"
    if DECODE_KERNEL.load() is None:
        return f"the extension is not available ({DECODE_KERNEL.error})"
    return None


def _decode_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor | None,
                  index: KeyClusterIndex, options: RetrievalSettings, scale: float, allowed: torch.Tensor | int,
                  per_head: bool) -> torch.Tensor:
    """:func:`_attend_retrieved` for one query position (a decoding step), ``"group"`` or ``"head"`` selection,
    without the remainder estimate, in one C++ pass per unit that reads the cache where it lies (no gathered copy of
    the candidates, sinks or window): the same keys read, the same function up to rounding (a test holds the two to
    1e-10 in float64). Here only the per-sequence numbers of the budget are worked out: the sinks each sequence
    reads, its window's first position and its retrieved keys."""
    B, H, _, D = q.shape
    Hkv, n = k.shape[1], k.shape[2]
    start = index.end
    sink_count, cap = _split_budget(allowed, options.sink, 0)
    if isinstance(cap, int):  # one budget for every sequence: a decoding step's query is at n - 1
        rows = torch.tensor([max(0, cap - (n - start)), max(start, n - cap), sink_count]).expand(B, 3)
    else:  # per sequence: its window holds its real positions from index.end on
        window_read = real[:, start:].sum(1) if real is not None else n - start
        rows = torch.stack([(cap - window_read).clamp(min=0), (n - cap).clamp(min=start), sink_count], 1)
    # rows: per sequence the keys it retrieves, its window's first position, the sinks it reads
    out = DECODE_KERNEL.load().decode(
        q.reshape(B, Hkv, H // Hkv, D) * scale, k.contiguous(), v.contiguous(), index.centroids_t,
        index.counts, index.members, index.sinks, index.sink_live, rows.contiguous(),
        torch.empty(0, dtype=torch.bool) if real is None else real.contiguous(), options.rerank, per_head)
    return out.view(B, H, 1, v.shape[-1])


def _rerank(unit_queries: torch.Tensor, k: torch.Tensor, candidates: torch.Tensor, valid: torch.Tensor | None,
            row_budget: torch.Tensor | int, R: int, query_ok: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Keep each unit's R candidates of highest exact score (``rerank``): unit_queries (B, Hkv, U, m, D) scaled,
    candidates (B, Hkv, U, Rc) positions, valid (B, Hkv, U, Rc) or None (all valid). A unit's score of a key is
    the best q . k over its m queries (as the clusters are ranked; over those ``query_ok`` (B, 1, U, m) admits,
    if given). Returns the kept positions (B, Hkv, U, R) (in descending score where ``row_budget`` differs per
    sequence; else in any order), which are valid (a real candidate among the first ``row_budget`` of its
    sequence) and the kept candidates' indices."""
    B = candidates.shape[0]
    keys = gather_positions(k, candidates)  # (B, Hkv, U, Rc, D)
    # (m, D) @ (D, Rc), not (Rc, D) @ (D, m): the long side last is the faster product for a few queries, and
    # the best over the queries is then a reduction over rows
    scores = unit_queries @ keys.transpose(-1, -2)  # (B, Hkv, U, m, Rc)
    if query_ok is not None:
        scores = scores.masked_fill(~query_ok.unsqueeze(-1), float("-inf"))
    scores = scores.amax(-2)  # (B, Hkv, U, Rc)
    if valid is not None:
        scores = scores.masked_fill(~valid, float("-inf"))
    # the softmax does not need the kept keys in order; rows whose budgets differ keep their best row_budget
    top = scores.topk(R, dim=-1, sorted=not isinstance(row_budget, int))
    kept = candidates.gather(-1, top.indices)
    if valid is None:
        return kept, None, top.indices
    rank = torch.arange(R, device=k.device)
    limit = row_budget if isinstance(row_budget, int) else row_budget.view(B, 1, 1, 1)
    return kept, (top.values > float("-inf")) & (rank < limit), top.indices


def gather_positions(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x (B, Hkv, n, E); positions (B, S) shared by the heads or (B, Hkv, *S) per head -> (B, Hkv, *S, E)."""
    B, Hkv, n, E = x.shape
    if positions.dim() == 2:
        return x.gather(2, positions.view(B, 1, -1, 1).expand(B, Hkv, -1, E))
    offset = (torch.arange(B * Hkv, device=x.device) * n).view(B, Hkv, *([1] * (positions.dim() - 2)))
    return x.reshape(B * Hkv * n, E).index_select(0, (positions + offset).reshape(-1)).view(*positions.shape, E)
