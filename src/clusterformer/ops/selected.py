"""Attention over the keys of *selected* clusters plus a local window (``"cluster-select"``, issue #31).

Every key belongs to one cluster; each query names ``S`` clusters (its selection) and reads, in one softmax:

* its window: causal, the positions (t - window, t]; otherwise [t - window / 2, t + window / 2);
* from each selected cluster, ``cluster_keys`` members outside the window, nearest to the query in position:
  causal, the most recent members at positions <= t - window; otherwise up to cluster_keys / 2 members before the
  window and the rest after it.

The window and the cluster part are disjoint by position, and a query selects distinct clusters, so every key
counts once. Nothing here depends on later positions under ``causal``, or on other sequences of the batch.

Implementation. Keys sorted by (cluster, position) with one stable sort; a prefix count of each cluster's
members, (B, H, N + 1, C), gives the rank range of every (query, selected cluster) pair; the ranks map to slots of
the sorted order and then to positions. The keys at those positions, M = S * cluster_keys + window per query, are
read as sparse key lists (:mod:`clusterformer.ops.key_lists`: the scores by a sampled product, the output by a CSR
product, no (B, H, N, M, D) gather) and attended with explicit scores: O(N M D) time, O(N M) memory, no loop over
tokens, clusters or queries.

Cluster summaries (``summaries=True``; NSA's compressed branch, Yuan et al. 2025, with clusters for blocks). Each
query also reads, in the same softmax, one summary per cluster of the members it does not read individually and
that lie outside its window: key = their mean key, value = their mean value, logit = q . mean / sqrt(D) + log n
(n members: the summary stands for n keys, and exp of its logit bounds their total weight from below by Jensen).
Every key outside the window is thus counted once -- alone or inside its cluster's summary -- and every cluster,
selected or not, gets the task's gradient through its summary. The sums come from one prefix sum of the keys and
values in sorted (cluster, position) order, (B, H, N + 1, D): a rank range of a cluster is a difference of two
rows. :func:`summary_selection` ranks the clusters by the same logits over all their members outside the window.

The ``"banded"`` kernel computes the same softmax from matmuls over chunks, O(N (window + L + M + C) D) without any
(N, N) or (N, C, D) tensor. Positions are cut into chunks of L <= 128 keys (:func:`band_chunk`); query t in chunk i
sees its whole window inside the *band* of the fewest chunks around i that hold every window of the chunk (causal:
i - ceil((window - 1) / L) .. i), and every other key of the band lies outside the window, in the band's first
chunk or two (and last, non-causal). A summary is then the members in whole chunks beyond the band -- one row of
per-chunk prefix sums of the clusters' keys and values, (B, H, N / L + 1, C, D) -- plus the members in the band
outside the window, read from the band's own scores through the band's one-hot clusters on those columns only,
less the members the query reads alone (their scores are computed anyway). Only those keys, S * cluster_keys per
query, are listed per query, as sparse key lists. One band per layer call (:func:`chunk_band`) serves the
summaries' selection and the attention.

The ``"fused"`` kernel (CPU, :mod:`clusterformer.ops.listed_attention`) reads the window in place, the selected
clusters' keys as runs of consecutive slots of the cluster-sorted order (:func:`cluster_runs`: one run per selected
cluster, two without a causal mask) and the summaries from one prefix sum in that order, in one C++ pass; with
``selection="bound"`` the ranking is another (:func:`bound_selection`). Ties between groups go to the lower id
(:func:`top_groups`), in every kernel and in the cached decoder.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..masks import masked_sdpa, real_tokens
from .key_lists import KeyLists, key_lists, listed_scores, listed_sum, run_key_lists
from .listed_attention import (
    RangeSummaries,
    SlotRuns,
    bound_groups,
    extension_available,
    extension_error,
    listed_attention,
    summary_logits,
    top_members,
)
from .recompute import recompute_saved

__all__ = ["BAND_CHUNK", "KERNELS", "ChunkBand", "band_chunk", "bound_logits", "bound_selection",
           "chunk_band", "cluster_layout", "cluster_slots", "cluster_summaries", "fused_usable", "group_extremes",
           "resolve_kernel", "scored_members", "selected_cluster_attention", "selected_positions",
           "summary_counts", "summary_selection", "top_groups", "upper_bounds"]


class ClusterLayout:
    """Keys in sorted (cluster, position) order, per (sequence, head), and the members of each cluster around every
    query's window.

    order: (B, H, N) slot -> position; total: (B, H, C) members per cluster; start: (B, H, C) first slot of each
    cluster; below: (B, H, N, C) members of each cluster before query t's window (causal: at positions <= t -
    window; otherwise before t - window / 2); beyond: (B, H, N, C) members before the end of t's window (causal:
    ``total``, nothing lies beyond it). ``below`` and ``beyond`` are built when first read, from one prefix count
    (B, H, N + 1, C); :meth:`selected_counts` gives their columns of a few clusters per query without it."""

    def __init__(self, key_ids: torch.Tensor, *, num_clusters: int, window: int, causal: bool) -> None:
        self.key_ids, self.num_clusters, self.window, self.causal = key_ids, num_clusters, window, causal
        self.order = torch.sort(key_ids, dim=-1, stable=True).indices  # slot -> position, by (cluster, position)
        # (B, H, C): a histogram, not a (B, H, N, C) one-hot; padding (id C) falls in the dropped last bin
        self.total = _histogram(key_ids, num_clusters + 1)[..., :num_clusters]
        self.start = self.total.cumsum(-1) - self.total  # first slot of each cluster
        self._counts: tuple[torch.Tensor, torch.Tensor] | None = None
        self._plan: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(N,) the positions that end each query's part before its window and the end of its window: a cluster's
        members at positions < the first are ``below``, those at positions < the second are ``beyond``."""
        N = self.key_ids.shape[-1]
        t = torch.arange(N, device=self.key_ids.device)
        if self.causal:  # the window is (t - window, t]
            return (t - self.window + 1).clamp(min=0), torch.full_like(t, N)
        half = self.window // 2  # the window is [t - window / 2, t + window / 2)
        return (t - half).clamp(min=0), (t + self.window - half).clamp(max=N)

    def _built(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._counts is None:
            N, C = self.key_ids.shape[-1], self.num_clusters
            members = F.one_hot(self.key_ids, C + 1)[..., :C]  # (B, H, N, C)
            before = F.pad(members.cumsum(2), (0, 0, 1, 0))  # (B, H, N + 1, C): members at positions < p
            low, high = self._bounds()
            self._counts = (before[:, :, low],
                            self.total.unsqueeze(2).expand_as(before[:, :, :N]) if self.causal else before[:, :, high])
        return self._counts

    @property
    def below(self) -> torch.Tensor:
        return self._built()[0]

    @property
    def beyond(self) -> torch.Tensor:
        return self._built()[1]

    def selected_counts(self, selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``below`` and ``beyond`` of the clusters ``selected`` (B, H, N, S) only, (B, H, N, S) each. Without the
        (B, H, N, C) counts built, by binary search in the sorted keys (cluster * (N + 1) + position, ascending):
        O(N S log N) instead of O(N C)."""
        if self._counts is not None:
            return self.below.gather(-1, selected), self.beyond.gather(-1, selected)
        B, H, N = self.key_ids.shape
        S = selected.shape[-1]
        sorted_keys = self.key_ids.gather(-1, self.order) * (N + 1) + self.order  # (B, H, N), ascending
        first = self.start.gather(-1, selected.flatten(2)).view(B, H, N, S)

        def members_before(ends: torch.Tensor) -> torch.Tensor:  # members of the selected clusters at positions < ends
            probes = (selected * (N + 1) + ends[:, None]).flatten(2).contiguous()  # (B, H, N S)
            return torch.searchsorted(sorted_keys, probes).view(B, H, N, S) - first

        low, high = self._bounds()
        if self.causal:
            return members_before(low), self.total.gather(-1, selected.flatten(2)).view(B, H, N, S)
        return members_before(low), members_before(high)

    @property
    def prefix_start(self) -> torch.Tensor:
        """(B, H, C) the row of :meth:`cluster_prefix` that holds each cluster's empty sum: row prefix_start[c] + r
        holds the sum of cluster c's first r members (r = 0 .. total[c])."""
        return self._prefix_plan()[2]

    def cluster_prefix(self, x: torch.Tensor) -> torch.Tensor:
        """Per cluster, the prefix sums of its members' rows of x (B, H, N, D) in position order, each restarted at
        the cluster's start: (B, H, R, D), cluster c at rows :attr:`prefix_start` [c] + 0 .. total[c] (row + r: its
        first r members; the first row exactly 0).

        A sum of a cluster's first r members depends on those r members alone, bit for bit: no other cluster's
        rows enter it (a difference of prefix sums over the whole sorted order would carry the rounding error of
        every earlier cluster -- later positions included -- into it, and break strict causality in float32). Each
        cluster's rows are cut into blocks of :data:`PREFIX_BLOCK` from its start; a block's sums are one cumsum
        within it, and a block adds the sum of its cluster's earlier blocks, found by a segmented scan over the
        blocks (ceil(log2 blocks) element-wise passes, Hillis and Steele 1986; no loop over clusters)."""
        source, block_rank, _ = self._prefix_plan()
        B, H, N, D = x.shape
        blocks = block_rank.shape[-1]
        rows = F.pad(x, (0, 0, 0, 1)).gather(2, source.unsqueeze(-1).expand(B, H, -1, D))  # row N: zero
        local = rows.view(B, H, blocks, PREFIX_BLOCK, D).cumsum(3)
        totals = local[:, :, :, -1]  # (B, H, blocks, D)
        shift = 1
        while shift < blocks:  # after it, block b holds its cluster's blocks b - 2 shift + 1 .. b
            reach = (block_rank >= shift).unsqueeze(-1)
            totals = torch.where(reach, totals + F.pad(totals, (0, 0, shift, 0))[:, :, :blocks], totals)
            shift *= 2
        earlier = torch.where((block_rank >= 1).unsqueeze(-1), F.pad(totals, (0, 0, 1, 0))[:, :, :blocks], 0.0)
        return (local + earlier.unsqueeze(3)).view(B, H, blocks * PREFIX_BLOCK, D)

    def _prefix_plan(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`cluster_prefix`'s rows: (B, H, R) the position whose row each holds (N: none, zero), (B, H,
        R / PREFIX_BLOCK) each block's rank in its cluster, and :attr:`prefix_start`. Cluster c takes
        ceil((total[c] + 1) / PREFIX_BLOCK) blocks, its members from the second row of the first on; R covers
        every cluster of any (B, H) pair: ceil(N / PREFIX_BLOCK) + C blocks."""
        if self._plan is None:
            B, H, N = self.order.shape
            C, L = self.num_clusters, PREFIX_BLOCK
            blocks = -(-N // L) + C
            taken = torch.div(self.total + L, L, rounding_mode="floor")  # ceil((total + 1) / L)
            block_end = taken.cumsum(-1)  # (B, H, C)
            first_row = (block_end - taken) * L
            # sorted slot s, of cluster c and rank s - start[c], goes to row first_row[c] + 1 + rank; padding
            # (cluster C, sorted last) to the dropped row R
            slot_ids = self.key_ids.gather(-1, self.order)  # (B, H, N), ascending
            slot = torch.arange(N, device=self.order.device)
            inside = slot_ids < C
            cluster = slot_ids.clamp(max=C - 1)
            row = torch.where(inside, (first_row - self.start).gather(-1, cluster) + 1 + slot, blocks * L)
            source = torch.full((B, H, blocks * L + 1), N, dtype=torch.long, device=self.order.device)
            source = source.scatter_(-1, row, self.order)[..., :-1]
            block = torch.arange(blocks, device=self.order.device).expand(B, H, blocks).contiguous()
            owner = torch.searchsorted(block_end, block, right=True)  # the cluster of each block (C: none)
            block_start = F.pad(block_end - taken, (0, 1), value=0)
            block_start[..., -1] = block_end[..., -1]
            self._plan = (source, block - block_start.gather(-1, owner), first_row)
        return self._plan


PREFIX_BLOCK = 16  # rows per block of :meth:`ClusterLayout.cluster_prefix`


def _histogram(ids: torch.Tensor, bins: int) -> torch.Tensor:
    """(..., N) ids in [0, bins) -> (..., bins) counts, by one scatter-add."""
    return torch.zeros(*ids.shape[:-1], bins, dtype=torch.long, device=ids.device).scatter_add_(
        -1, ids, torch.ones_like(ids))


def cluster_layout(key_ids: torch.Tensor, *, num_clusters: int, window: int, causal: bool) -> ClusterLayout:
    """The sorted layout of ``key_ids`` (B, H, N) in [0, num_clusters] (``num_clusters``: padding, sorted last and
    in no cluster) around every query's window: one stable sort; the (B, H, N + 1, C) prefix count behind
    ``below`` and ``beyond`` when they are first read."""
    return ClusterLayout(key_ids, num_clusters=num_clusters, window=window, causal=causal)


def selected_positions(
    key_ids: torch.Tensor, selected: torch.Tensor, *, num_clusters: int, cluster_keys: int, window: int, causal: bool,
    key_padding_mask: torch.Tensor | None = None, layout: ClusterLayout | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The key positions each query reads: ((B, H, N, M) long positions, (B, H, N, M) bool allowed).

    key_ids: (B, H, N) in [0, num_clusters]; ``num_clusters`` marks padding (never counted or read).
    selected: (B, H, N, S) distinct cluster ids in [0, num_clusters) per query. ``layout``: :func:`cluster_layout`
    of the same ids, if the caller has it."""
    if layout is None:
        layout = cluster_layout(key_ids, num_clusters=num_clusters, window=window, causal=causal)
    positions, allowed, _ = _selected_positions(layout, selected, cluster_keys=cluster_keys, window=window,
                                                causal=causal, key_padding_mask=key_padding_mask)
    return positions, allowed


def cluster_slots(layout: ClusterLayout, selected: torch.Tensor, *, cluster_keys: int, causal: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the selected clusters' members that each query reads alone sit in cluster-sorted order: ((B, H, N, S,
    cluster_keys) long slots of ``layout.order``, not clamped, (B, H, N, S, cluster_keys) bool valid). Causal: one
    run of consecutive slots per cluster, its ``cluster_keys`` most recent members at positions <= t - window;
    otherwise two, the members just before the window and just after it (``cluster_keys // 2`` and the rest). A slot
    that is not valid may lie in a neighbouring cluster or up to ``cluster_keys`` outside [0, N)."""
    B, H, N = layout.order.shape
    S = selected.shape[-1]
    steps = torch.arange(cluster_keys, device=selected.device)
    below, beyond = layout.selected_counts(selected)  # (B, H, N, S)
    if causal:  # the most recent members at positions <= t - window
        ranks = (below - cluster_keys).unsqueeze(-1) + steps
        valid = ranks >= 0
    else:  # before the window [t - window / 2, t + window / 2) and after it
        first_half = cluster_keys // 2
        lower = below.unsqueeze(-1) - first_half + steps[:first_half]
        upper = beyond.unsqueeze(-1) + steps[: cluster_keys - first_half]
        ranks = torch.cat([lower, upper], dim=-1)
        size = layout.total.gather(-1, selected.flatten(2)).view(B, H, N, S, 1)
        valid = (ranks >= 0) & (ranks < size)
    return layout.start.gather(-1, selected.flatten(2)).view(B, H, N, S, 1) + ranks, valid


def cluster_runs(layout: ClusterLayout, selected: torch.Tensor, *, cluster_keys: int | None, causal: bool
                 ) -> SlotRuns:
    """The slots of :func:`cluster_slots` as runs of consecutive slots of ``layout.order`` (:class:`SlotRuns`), one
    per selected cluster (causal) or two (before the window, then after it): (B, H, N, S or 2 S) tensors in place of
    (B, H, N, S, cluster_keys) ones, for the fused kernel. The same keys in the same order. ``cluster_keys=None``:
    every member outside the window (the candidates of ``members="score"``, :func:`scored_members`), the capacity
    then the longest run."""
    B, H, N = layout.order.shape
    S = selected.shape[-1]
    below, beyond = layout.selected_counts(selected)  # (B, H, N, S)
    start = layout.start.gather(-1, selected.flatten(2)).view(B, H, N, S)
    if causal:  # the cluster_keys most recent members at positions <= t - window
        length = below if cluster_keys is None else below.clamp(max=cluster_keys)
        capacity = (int(length.max()) if length.numel() else 0) if cluster_keys is None else cluster_keys
        return SlotRuns(layout.order, start + below - length, length, capacity)
    size = layout.total.gather(-1, selected.flatten(2)).view(B, H, N, S)
    lower, upper = below, size - beyond
    if cluster_keys is not None:
        first_half = cluster_keys // 2
        lower, upper = lower.clamp(max=first_half), upper.clamp(min=0, max=cluster_keys - first_half)
    # per selected cluster its run before the window, then its run after it (cluster_slots' order)
    first = torch.stack([start + below - lower, start + beyond], dim=-1).view(B, H, N, 2 * S)
    length = torch.stack([lower, upper], dim=-1).view(B, H, N, 2 * S)
    capacity = ((int(length.max()) if length.numel() else 0) if cluster_keys is None
                else max(cluster_keys // 2, cluster_keys - cluster_keys // 2))
    return SlotRuns(layout.order, first, length, capacity)


def scored_members(q: torch.Tensor, k: torch.Tensor, layout: ClusterLayout, selected: torch.Tensor, *,
                   cluster_keys: int, causal: bool) -> torch.Tensor:
    """``members="score"``: the keys each query reads alone from each selected cluster -- its ``cluster_keys``
    members outside the query's window of largest q . k (causal: at positions <= t - window), in place of the most
    recent ones. (B, H, N, S * cluster_keys) int64 positions, per cluster in position order, -1 after them where
    the cluster has fewer such members (equal scores at the cut: the later position is kept). No gradient (an
    argmax, as the selection is).

    The fused C++ pass where it runs (:func:`clusterformer.ops.listed_attention.top_members`: O(N S n D) for
    clusters of n members), else tensor operations over the candidates padded to the largest run, (B, H, N, S, 2 n)
    scores -- the definition, and the path on CUDA."""
    with torch.no_grad():
        runs, per_group = cluster_runs(layout, selected, cluster_keys=None, causal=causal), 1 if causal else 2
        if q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64) and extension_available():
            return top_members(q, k, runs, per_group=per_group, keep=cluster_keys)
        B, H, N, S = selected.shape
        candidates = runs.as_index().view(B, H, N, S, -1)  # (B, H, N, S, per_group * capacity), -1: none
        n = candidates.shape[-1]
        flat = candidates.clamp(min=0).view(B, H, N * S * n, 1).expand(-1, -1, -1, k.shape[-1])
        keys = k.detach().to(q.dtype).gather(2, flat).view(B, H, N, S, n, k.shape[-1])
        scores = torch.einsum("bhnd,bhnsmd->bhnsm", q.detach(), keys).masked_fill(candidates < 0, float("-inf"))
        # best first, equal scores the later position first: a stable sort by position, then by score
        by_position = candidates.sort(dim=-1, descending=True, stable=True).indices
        ranked = by_position.gather(-1, scores.gather(-1, by_position).sort(dim=-1, descending=True, stable=True)
                                    .indices)
        best = candidates.gather(-1, ranked)[..., :cluster_keys]
        if best.shape[-1] < cluster_keys:
            best = F.pad(best, (0, cluster_keys - best.shape[-1]), value=-1)
        # in position order, none (-1) last
        best = torch.where(best < 0, N, best).sort(dim=-1).values
        return torch.where(best == N, -1, best).reshape(B, H, N, S * cluster_keys)


def _selected_positions(layout: ClusterLayout, selected: torch.Tensor, *, cluster_keys: int, window: int,
                        causal: bool, key_padding_mask: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`selected_positions`, and the :func:`cluster_slots` its cluster part came from."""
    cluster_positions, cluster_valid, slots = _cluster_positions(layout, selected, cluster_keys=cluster_keys,
                                                                 causal=causal)
    positions, allowed = _with_window(cluster_positions, cluster_valid, window=window, causal=causal,
                                      key_padding_mask=key_padding_mask)
    return positions, allowed, slots


def _with_window(cluster_positions: torch.Tensor, cluster_valid: torch.Tensor, *, window: int, causal: bool,
                 key_padding_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys a query reads alone from its clusters, (B, H, N, M) positions and valid, followed by its window:
    (B, H, N, M + window) positions and allowed (the window's padding and positions outside [0, N) not)."""
    B, H, N, _ = cluster_positions.shape
    device = cluster_positions.device
    t = torch.arange(N, device=device)
    offsets = torch.arange(window, device=device)
    window_positions = t[:, None] + offsets - (window - 1 if causal else window // 2)  # (N, window)
    window_valid = (window_positions >= 0) & (window_positions < N)
    window_positions = window_positions.clamp(0, max(N - 1, 0))
    positions = torch.cat([cluster_positions, window_positions.expand(B, H, N, window)], dim=-1)
    allowed = torch.cat([cluster_valid, window_valid.expand(B, H, N, window)], dim=-1)
    if key_padding_mask is not None:  # the cluster part never reads padding (its id is num_clusters); the window may
        real = real_tokens(key_padding_mask, B, N, device)[:, None, None, :].expand(B, H, N, N)
        allowed = allowed & real.gather(-1, positions)
    return positions, allowed


def _cluster_positions(layout: ClusterLayout, selected: torch.Tensor, *, cluster_keys: int, causal: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The cluster part of :func:`selected_positions`: positions and valid (B, H, N, S * cluster_keys), and the
    :func:`cluster_slots` they came from. Never padding: its id, num_clusters, is in no cluster."""
    B, H, N = layout.order.shape
    S = selected.shape[-1]
    slots, valid = cluster_slots(layout, selected, cluster_keys=cluster_keys, causal=causal)
    clamped = slots.clamp(0, max(N - 1, 0)).view(B, H, N * S * cluster_keys)
    positions = layout.order.gather(-1, clamped).view(B, H, N, S * cluster_keys)
    return positions, valid.view(B, H, N, S * cluster_keys), slots


def cluster_summaries(
    k: torch.Tensor, v: torch.Tensor, layout: ClusterLayout, selected: torch.Tensor | None, *, cluster_keys: int,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per query and cluster, the mean key and value of the cluster's members outside the query's window that it
    does not read one by one (``selected`` (B, H, N, S): those clusters' ``cluster_keys`` nearest members are read
    alone; ``None``: every member outside the window), and log n of their number.

    Returns keys, values (B, H, N, C, D) (zeros where n = 0) and log n (B, H, N, C) (-inf where n = 0)."""
    B, H, N, D = k.shape
    C = layout.total.shape[-1]
    total = layout.total.unsqueeze(2).expand(B, H, N, C)
    lower_end, upper_start = _summary_ranges(layout, selected, cluster_keys=cluster_keys, causal=causal)
    count = lower_end + total - upper_start
    start = layout.prefix_start.unsqueeze(2).expand(B, H, N, C)
    rows = torch.stack([start + lower_end, start + total, start + upper_start])  # (3, B, H, N, C)
    index = rows.permute(1, 2, 0, 3, 4).reshape(B, H, 3 * N * C, 1).expand(B, H, 3 * N * C, D)

    def range_sums(x: torch.Tensor) -> torch.Tensor:  # each cluster's own prefix sums: (B, H, N, C, D)
        upto_lower, last, from_upper = layout.cluster_prefix(x).gather(2, index).view(B, H, 3, N, C, D).unbind(2)
        return upto_lower + (last - from_upper)

    n = count.to(k.dtype)
    return range_sums(k) / n.clamp(min=1).unsqueeze(-1), range_sums(v) / n.clamp(min=1).unsqueeze(-1), _log_count(n)


def _summary_ranges(layout: ClusterLayout, selected: torch.Tensor | None, *, cluster_keys: int, causal: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ranks each query's summaries hold, per cluster: [0, lower_end) and [upper_start, total), both (B, H, N, C):
    the members outside the window, less those read alone from the ``selected`` clusters (the ranges of
    :func:`selected_positions`)."""
    lower_end, upper_start = layout.below, layout.beyond
    if selected is not None:
        total = layout.total.unsqueeze(2).expand_as(lower_end)
        before_window = cluster_keys if causal else cluster_keys // 2
        lower_end = lower_end.scatter(-1, selected, (lower_end.gather(-1, selected) - before_window).clamp(min=0))
        upper_start = upper_start.scatter(-1, selected, torch.minimum(
            upper_start.gather(-1, selected) + (cluster_keys - before_window), total.gather(-1, selected)))
    return lower_end, upper_start


def summary_counts(layout: ClusterLayout, selected: torch.Tensor | None, *, cluster_keys: int, causal: bool
                   ) -> torch.Tensor:
    """How many members each query's summary of each cluster holds, (B, H, N, C) long: those of
    :func:`cluster_summaries`, from the layout's counts alone (no pass over the keys)."""
    lower_end, upper_start = _summary_ranges(layout, selected, cluster_keys=cluster_keys, causal=causal)
    return lower_end + layout.total.unsqueeze(2) - upper_start


def _to_chunks(x: torch.Tensor, L: int, fill: float | bool = 0) -> torch.Tensor:
    """(B, H, N, X) -> (B, H, ceil(N / L), L, X): positions in chunks of L, the last one padded with ``fill``."""
    N = x.shape[2]
    chunks = -(-N // L)
    return F.pad(x, (0, 0, 0, chunks * L - N), value=fill).view(*x.shape[:2], chunks, L, x.shape[-1])


def _from_chunks(x: torch.Tensor, N: int) -> torch.Tensor:
    """(B, H, chunks, L, X) -> (B, H, N, X): the first N positions (:func:`_to_chunks` undone)."""
    return x.flatten(2, 3)[:, :, :N]


BAND_CHUNK = 128  # the banded kernel's chunk length, at most (smaller windows: the window's own span)


def band_chunk(window: int, causal: bool) -> int:
    """The chunk length L of the ``"banded"`` kernel: the keys a query's window holds on its past side (causal:
    ``window``; otherwise ``window / 2``), at most :data:`BAND_CHUNK` = 128. A band spans the window plus less than
    one chunk, (window + L) keys per query rather than 2 window, while the per-chunk cluster sums, (N / L, C, D),
    grow as L shrinks. Measured on one CPU thread (one causal layer's forward and backward, 64 clusters, 96 keys
    read alone; docs/benchmarks.md): with a window of 512 at N = 4,096, chunks of 128 took 0.64x the time of
    chunks of 512 (64: 0.78x, 256: 0.60-0.67x, the machine shared); with a window of 96 at N = 1,024, chunks of 96
    were faster than 48 or 32."""
    return min(window if causal else window // 2, BAND_CHUNK)


class ChunkBand(NamedTuple):
    """The chunk bands of the ``"banded"`` kernel (module docstring; :func:`chunk_band`), with Np = chunks * L >= N
    padded positions and R = (before + 1 + after) L band keys per chunk.

    scores: (B, H, chunks, L, R) q . k / sqrt(D) of each query against its band (q as given: scaled by the caller);
    window: (B, H, chunks, L, R) bool, the band key is in the query's window and real; outside: (L, R) 1 where the
    band key is outside the window and not after the query (causal), else 0, in q's dtype; spans: the (start, stop)
    column ranges of the band that hold any such key (one causal, two otherwise) -- the summaries' products read
    only those; members: (B, H, chunks, R, C) the band keys' one-hot clusters (padding in none); values: (B, H,
    chunks, R, D), or None when no values were given (a selection only scores); beyond_keys, beyond_values: (B, H,
    chunks, C, D) per query chunk, the sums of each cluster's members in the whole chunks outside its band (causal:
    before it; otherwise before and after); summary_dots: (B, H, N, C) q . (sum of each cluster's members outside
    the window). A band built without summaries holds the window's parts alone: members, beyond_keys,
    beyond_values and summary_dots are None."""

    scores: torch.Tensor
    window: torch.Tensor
    outside: torch.Tensor
    spans: tuple[tuple[int, int], ...]
    members: torch.Tensor | None
    values: torch.Tensor | None
    beyond_keys: torch.Tensor | None
    beyond_values: torch.Tensor | None
    summary_dots: torch.Tensor | None
    values_recipe: Callable[[], torch.Tensor] | None = None  # rebuilds ``values`` from v (ops/recompute.py)


def chunk_band(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, key_ids: torch.Tensor,
               key_padding_mask: torch.Tensor | None, *, num_clusters: int, window: int, causal: bool,
               summaries: bool) -> ChunkBand:
    """The bands of chunks around every query chunk (:class:`ChunkBand`); q already scaled. Chunks of L =
    :func:`band_chunk` positions; the band of chunk i is chunks i - before .. i + after, the fewest that hold every
    query's window. Built once per layer call, it serves both the summaries' selection and the attention
    (``summaries``: also the summaries' dots, with the gradient when q and k have one)."""
    B, N = key_ids.shape[0], key_ids.shape[2]
    C = num_clusters
    L = band_chunk(window, causal)
    half = window // 2
    # query t = i L + a reads (t - window, t] (causal) or [t - half, t + window - half): the band must reach
    # window - 1 (or half) positions before a = 0 and window - half - 1 after a = L - 1
    before = -(-(window - 1) // L) if causal else -(-half // L)
    after = 0 if causal else -(-(window - half - 1) // L)
    width = before + 1 + after
    chunks = -(-N // L)

    def band(x: torch.Tensor) -> torch.Tensor:  # (B, H, chunks, L, X) -> (B, H, chunks, R, X)
        shifted = F.pad(x, (0, 0, 0, 0, before, after))
        return torch.cat([shifted[:, :, s:s + chunks] for s in range(width)], dim=3)

    real = real_tokens(key_padding_mask, B, N, q.device)
    band_real = band(_to_chunks(real[:, None, :, None], L, False)).squeeze(-1)  # (B, 1, chunks, R)
    keys = _to_chunks(k, L)
    band_keys = band(keys)
    # the product's backward needs the band's copy of the keys (width x K): shift them into it again then, from the
    # chunked keys, which the cluster sums below keep anyway and which cost N x K without them (a recipe on k itself
    # would keep the fused QKV output)
    with recompute_saved(band_keys, lambda: band(keys)):
        scores = _to_chunks(q, L) @ band_keys.transpose(-1, -2)  # (B, H, chunks, L, R)
    del band_keys

    # key j = (i - before) L + r of the band against query t = i L + a: j - t = r - before L - a, in every chunk
    a = torch.arange(L, device=q.device)[:, None]
    offset = torch.arange(width * L, device=q.device)[None, :] - before * L - a  # (L, R)
    if causal:
        in_window, outside = (offset > -window) & (offset <= 0), offset <= -window
        # offset <= -window somewhere in column r: r <= before L - window + (L - 1)
        spans = ((0, before * L - window + L),)
    else:
        in_window = (offset >= -half) & (offset < window - half)
        outside = ~in_window
        # offset < -half somewhere in column r: r < before L - half + L - 1; offset >= window - half: r >= before
        # L + window - half
        spans = ((0, before * L - half + L - 1), (before * L + window - half, width * L))
    spans = tuple((lo, hi) for lo, hi in spans if hi > lo)

    outside = outside.to(q.dtype)
    values = None if v is None else _to_chunks(v, L)
    window_real = in_window & band_real.unsqueeze(-2)
    if not summaries:  # the window alone: no cluster sums, (N / L, C, D) prefix sums and their products
        return ChunkBand(scores, window_real, outside, spans, None, None if values is None else band(values), None,
                         None, None, None if values is None else lambda: band(values))

    members = _to_chunks(F.one_hot(key_ids, C + 1)[..., :C].to(q.dtype), L)  # padding (id C): in no cluster

    # per-chunk sums of each cluster's keys and values, summed over chunks: upto[m] = chunks 0 .. m; shifted by
    # slices (an index would scatter in its backward)
    def beyond(x: torch.Tensor) -> torch.Tensor:
        upto = (members.transpose(-1, -2) @ x).cumsum(2)  # (B, H, chunks, C, D)
        sums = F.pad(upto, (0, 0, 0, 0, before + 1, 0))[:, :, :chunks]  # row i: the chunks before i - before
        if not causal:  # and the chunks after i + after: all, less upto[min(i + after, chunks - 1)]
            last = upto[:, :, -1:]
            reach = torch.cat([upto[:, :, after:], last.expand(-1, -1, min(after, chunks), -1, -1)], dim=2)
            sums = sums + (last - reach)
        return sums

    band_members = band(members)
    beyond_keys = beyond(keys)
    # the whole chunks beyond the band by one (L, D) x (D, C) product per chunk, the band's own members outside
    # the window from its scores, over the spans that hold any
    dots = _to_chunks(q, L) @ beyond_keys.transpose(-1, -2)
    for lo, hi in spans:
        dots = dots + (scores[..., lo:hi] * outside[:, lo:hi]) @ band_members[..., lo:hi, :]
    dots = _from_chunks(dots, N)
    return ChunkBand(scores, window_real, outside, spans, band_members,
                     None if values is None else band(values), beyond_keys,
                     None if values is None else beyond(values), dots,
                     None if values is None else lambda: band(values))  # ``values``: kept by beyond(values)


def top_groups(logits: torch.Tensor, select: int, by_cluster: int = 0) -> torch.Tensor:
    """The ``select`` groups (..., S) of largest summary logits (..., G). With ``by_cluster`` = R > 0 (groups
    c R + r: cluster c cut into R spans, the option ``position_splits``), ``select`` clusters by the log-sum-exp
    of their groups' logits (log of the weight the whole cluster's summaries would draw), then each selected
    cluster's one group of largest logit: distinct groups of distinct clusters. Best first; equal logits go to the
    lower id (a stable sort: ``topk`` leaves the order of ties unspecified, and groups without members tie at -inf,
    so the rule is part of the definition -- the fused :func:`clusterformer.ops.listed_attention.bound_groups` and
    the cached decoder keep it too)."""
    if not by_cluster:
        return _largest(logits, select)
    spans = logits.unflatten(-1, (-1, by_cluster))  # (..., C, R)
    clusters = _largest(spans.logsumexp(-1), select)  # (..., S)
    best = spans.argmax(-1).gather(-1, clusters)  # each selected cluster's best span (the first of equal ones)
    return clusters * by_cluster + best


def _largest(x: torch.Tensor, select: int) -> torch.Tensor:
    """The indices of the ``select`` largest entries along the last axis, largest first, equal ones in index order."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :select]


def with_own_group(selected: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """The selection ``selected`` (..., S), best first, with each query's own group ``own`` (...) read first:
    own, then the S - 1 best others (own moves to the front where it was selected; otherwise the last is dropped).
    Distinct groups stay distinct."""
    S = selected.shape[-1]
    candidates = torch.cat([own.unsqueeze(-1), selected], -1)  # (..., S + 1)
    repeat = F.pad(selected == own.unsqueeze(-1), (1, 0))  # own's second place, if selected
    order = torch.sort(repeat.to(torch.int32), dim=-1, stable=True).indices
    return candidates.gather(-1, order[..., :S])


def summary_selection(q: torch.Tensor, k: torch.Tensor, key_ids: torch.Tensor, layout: ClusterLayout, *,
                      select: int, window: int, causal: bool, kernel: str,
                      key_padding_mask: torch.Tensor | None = None, band: ChunkBand | None = None,
                      by_cluster: int = 0, groups: int | None = None) -> torch.Tensor:
    """The ``select`` clusters (B, H, N, S), among the first ``groups`` (None: all), whose summary of every member
    outside the window scores highest for each query: q . mean / sqrt(D) + log n, the logit the summary would have
    in the softmax (``by_cluster``: the groups' clusters first, :func:`top_groups`). No gradient (an argmax);
    clusters without such members rank last. ``kernel`` (one of :func:`resolve_kernel`'s answers):
    "dense-mask" from the (N, N) scores by two matmuls, "banded" from chunk bands and per-chunk prefix sums (``band``:
    the layer's :func:`chunk_band` of the same q / sqrt(D) and k, built with summaries, whose dots the attention
    reads too; otherwise one is built here), "fused" from one prefix sum of the keys in sorted order and a C++ pass
    (:func:`clusterformer.ops.listed_attention.summary_logits`), "gather" from :func:`cluster_summaries`."""
    with torch.no_grad():
        q, k = q.detach() * q.shape[-1] ** -0.5, k.detach()
        if kernel in ("dense-mask", "banded"):  # every member outside the window
            n = summary_counts(layout, None, cluster_keys=0, causal=causal).to(q.dtype)
        if kernel == "dense-mask":
            C = layout.total.shape[-1]
            members = F.one_hot(key_ids, C + 1)[..., :C].to(q.dtype)  # (B, H, N, C); padding in none
            outside = _outside_window(key_ids.shape[-1], window, causal, q.device).to(q.dtype)
            logits = ((q @ k.transpose(-1, -2)) * outside) @ members / n.clamp(min=1) + _log_count(n)
        elif kernel == "banded":
            if band is None or band.summary_dots is None:
                band = chunk_band(q, k, None, key_ids, key_padding_mask, num_clusters=layout.total.shape[-1],
                                  window=window, causal=causal, summaries=True)
            logits = band.summary_dots / n.clamp(min=1) + _log_count(n)
        elif kernel == "fused":  # the fused kernel's summaries of every member outside the window, logits alone
            prefix = layout.cluster_prefix(k)
            logits = summary_logits(q, RangeSummaries(prefix, prefix, layout.prefix_start, layout.total,
                                                      layout.below, layout.beyond), scale=1.0)
        else:
            keys, _, log_n = cluster_summaries(k, k, layout, None, cluster_keys=0, causal=causal)
            logits = torch.einsum("bhnd,bhncd->bhnc", q, keys) + log_n
    return top_groups(logits[..., :groups], select, by_cluster)


def group_extremes(k: torch.Tensor, groups: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel-wise max and min of the keys k (B, H, N, D) per group, (B, H, G, D) each, -inf and +inf where a
    group has no member; ``groups`` (B, H, N) in [0, num_groups] (num_groups: in none)."""
    D = k.shape[-1]
    signed = _signed_extremes(k, groups, num_groups)
    return signed[..., :D], -signed[..., D:]


def _signed_extremes(k: torch.Tensor, slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Per slot, the channel-wise max of k (B, H, N, D) and of -k (= -min k), (B, H, num_slots, 2 D), by one
    in-place scatter of [k, -k]; -inf where a slot has no member. ``slots`` (B, H, N) in [0, num_slots]
    (num_slots: in none)."""
    return _scattered_extremes(k, slots, num_slots + 1)[:, :, :num_slots]


def _scattered_extremes(k: torch.Tensor, slots: torch.Tensor, size: int) -> torch.Tensor:
    """The max of [k, -k] per slot, slots (B, H, N) in [0, size): one fill and one in-place scatter into a
    contiguous (B, H, size, 2 D) buffer, -inf in a slot without members."""
    B, H, N, D = k.shape
    signed = torch.cat([k, -k], dim=-1)
    index = slots.unsqueeze(-1).expand(B, H, N, 2 * D)
    return signed.new_full((B, H, size, 2 * D), float("-inf")).scatter_reduce_(2, index, signed, "amax")


def _bounds_by_state(q: torch.Tensor, states: torch.Tensor, *, pad: int, block: int) -> torch.Tensor:
    """Query t (of q (B, H, N, D)) against the signed extremes (max k, max -k: :func:`_run_extremes`) of its
    run's state: ``states`` (B, H, runs, G, 2 D), one per run of ``block`` queries, where query t sits at t + ``pad``
    in run floor((t + pad) / block) (:func:`_state_runs`); consumed (masked in place). q+ . hi + q- . lo =
    [q+, -q-] . [hi, -lo], (B, H, N, G), -inf where the state holds no member: one (block, 2 D) x (2 D, G) product
    per run."""
    B, H, N, D = q.shape
    runs = states.shape[2]
    signed_q = torch.cat([q.clamp(min=0), (-q).clamp(min=0)], dim=-1)
    padded = F.pad(signed_q, (0, 0, pad, runs * block - N - pad)).view(B, H, runs, block, 2 * D)
    empty = states[..., :1] == float("-inf")  # (B, H, runs, G, 1): any key makes every channel finite
    bound = padded @ states.masked_fill_(empty, 0).transpose(-1, -2)  # (B, H, runs, block, G)
    return bound.masked_fill_(empty.transpose(-1, -2), float("-inf")).flatten(2, 3)[:, :, pad:pad + N]


def _state_runs(N: int, shift: int, block: int) -> tuple[int, int, int]:
    """Queries t = 0 .. N - 1 read the state of block floor((t + shift) / block): padded by ``pad`` = shift mod
    block they form ``runs`` runs of ``block`` queries, run r reading the state of block r + ``first``. Returns
    (pad, first, runs)."""
    pad = shift % block
    return pad, (shift - pad) // block, -(-(N + pad) // block)


def upper_bounds(q: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """Queries q (..., M, D) against groups of channel-wise max hi and min lo (..., G, D): the upper bound
    sum_d max(q_d hi_d, q_d lo_d) = q+ . hi + q- . lo of q . k over each group's keys, (..., M, G); -inf for a group
    without keys (hi = -inf: any key makes every channel finite)."""
    empty = (hi[..., 0] == float("-inf")).unsqueeze(-1)  # (..., G, 1)
    hi, lo = hi.masked_fill(empty, 0), lo.masked_fill(empty, 0)  # an empty group's +-inf, masked below
    bound = q.clamp(min=0) @ hi.transpose(-1, -2) + q.clamp(max=0) @ lo.transpose(-1, -2)
    return bound.masked_fill(empty.transpose(-1, -2), float("-inf"))


def _running_max_(x: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """The running max along dim 2 of x (B, H, S, G, D), in place (``reverse``: from the end, a suffix max): a scan
    of ceil(log2 S) element-wise passes between x and one spare buffer (Hillis and Steele 1986), not a loop over the
    S blocks. On a CPU, one thread, 48 ms at S = 16, G = 128, D = 64, B H = 32, against 183 ms for cummax along a
    contiguous last dim (which also computes indices, and needs the tensor moved there) and 80 ms for the same scan
    by concatenations. Returns the buffer that holds the result (x or the spare)."""
    current, spare = x, torch.empty_like(x)
    shift = 1
    # after the pass with a given shift, entry s holds the max of s - 2 shift + 1 .. s (reverse: s .. s + 2 shift - 1)
    while shift < x.shape[2]:
        if reverse:
            spare[:, :, -shift:] = current[:, :, -shift:]
            torch.maximum(current[:, :, :-shift], current[:, :, shift:], out=spare[:, :, :-shift])
        else:
            spare[:, :, :shift] = current[:, :, :shift]
            torch.maximum(current[:, :, shift:], current[:, :, :-shift], out=spare[:, :, shift:])
        current, spare = spare, current
        shift *= 2
    return current


def _run_extremes(k: torch.Tensor, key_ids: torch.Tensor, *, num_groups: int, block: int, offset: int,
                  length: int) -> torch.Tensor:
    """The signed extremes (max k, max -k) of every block and group, block j at entry j + ``offset`` of a
    (B, H, length, G + 1, 2 D) tensor (group G: padding), -inf where an entry holds no member; the blocks that land
    outside [0, length) go to the padding group of the last entry, which nobody reads. One scatter into the
    layout the queries' runs read, so no shift or gather of the states follows."""
    B, H, N, D = k.shape
    G1 = num_groups + 1
    entry = torch.div(torch.arange(N, device=k.device), block, rounding_mode="floor") + offset
    inside = (entry >= 0) & (entry < length)
    slot = torch.where(inside, entry * G1, (length - 1) * G1)[None, None, :] + torch.where(inside, key_ids, num_groups)
    return _scattered_extremes(k, slot, length * G1).view(B, H, length, G1, 2 * D)


def _prefix_states(k: torch.Tensor, key_ids: torch.Tensor, *, num_groups: int, block: int, first: int, runs: int
                   ) -> torch.Tensor:
    """Run r's state of the prefix, the extremes over blocks < r + ``first`` (``first`` <= 0: a window or its past
    half lies before the query's own block), (B, H, runs, G, 2 D), -inf where there is none: block j scattered at
    entry j + 1 - first, then one running max, so that entry r holds blocks 0 .. r + first - 1."""
    states = _running_max_(_run_extremes(k, key_ids, num_groups=num_groups, block=block, offset=1 - first,
                                         length=runs))
    return states[..., :num_groups, :]


def _suffix_states(k: torch.Tensor, key_ids: torch.Tensor, *, num_groups: int, block: int, first: int, runs: int
                   ) -> torch.Tensor:
    """Run r's state of the suffix, the extremes over blocks >= r + ``first`` (``first`` >= 1: the window's far side
    lies after the query's own block), (B, H, runs, G, 2 D), -inf where there is none: block j scattered at entry
    j - first, then one running max from the end."""
    length = max(runs, -(-k.shape[2] // block) - first)
    states = _running_max_(_run_extremes(k, key_ids, num_groups=num_groups, block=block, offset=-first,
                                         length=length), reverse=True)
    return states[:, :, :runs, :num_groups]


def bound_logits(q: torch.Tensor, k: torch.Tensor, key_ids: torch.Tensor, *, num_groups: int, window: int,
                 causal: bool, block: int) -> torch.Tensor:
    """Per query and group, (B, H, N, G): the upper bound sum_d max(q_d hi_d, q_d lo_d) of q . k over the group's
    members in the whole blocks of ``block`` positions outside the query's window -- causal: positions
    < block floor((t - window + 1) / block), every block at or before t - window; otherwise the larger of the
    bound over the blocks wholly before the window [t - window / 2, t + window / 2) and the bound over those wholly
    after it. -inf where there is no such member. q as given (the caller scales it); ``key_ids`` (B, H, N) in
    [0, num_groups] (``num_groups``: padding, in no group). Members in a block the window cuts are left out: they
    lie within window + block positions of the query. hi and -lo travel as one tensor [hi, -lo], whose running
    extremes are one running max, scattered directly in the order the queries' runs read them (no shift or gather
    of states)."""
    N = q.shape[2]
    extremes = {"num_groups": num_groups, "block": block}
    if causal:  # query t reads the blocks before block floor((t + 1 - window) / block)
        pad, first, runs = _state_runs(N, 1 - window, block)
        return _bounds_by_state(q, _prefix_states(k, key_ids, first=first, runs=runs, **extremes), pad=pad,
                                block=block)
    half = window // 2
    pad, first, runs = _state_runs(N, -half, block)  # the blocks before block floor((t - half) / block)
    before = _bounds_by_state(q, _prefix_states(k, key_ids, first=first, runs=runs, **extremes), pad=pad,
                              block=block)
    # the blocks from block ceil((t + window - half) / block) on
    pad, first, runs = _state_runs(N, window - half + block - 1, block)
    return torch.maximum(before, _bounds_by_state(q, _suffix_states(k, key_ids, first=first, runs=runs, **extremes),
                                                  pad=pad, block=block))


def bound_selection(q: torch.Tensor, k: torch.Tensor, key_ids: torch.Tensor, *, num_groups: int, select: int,
                    window: int, causal: bool, block: int, by_cluster: int = 0, kernel: str = "auto") -> torch.Tensor:
    """The ``select`` groups (B, H, N, S) of largest :func:`bound_logits` for q / sqrt(D) (``by_cluster``:
    :func:`top_groups`'s). No gradient (an argmax); groups without members there rank last. ``kernel="fused"``: the
    bounds and the choice in one C++ pass (:func:`clusterformer.ops.listed_attention.bound_groups`; the bounds alone
    with ``by_cluster``), the same groups up to the rounding of near ties."""
    scale = q.shape[-1] ** -0.5
    if kernel == "fused":  # q scaled inside the kernel (no scaled copy)
        extremes = {"num_groups": num_groups, "window": window, "causal": causal, "block": block, "scale": scale}
        if not by_cluster:
            return bound_groups(q.detach(), k.detach(), key_ids, select=select, **extremes)
        return top_groups(bound_groups(q.detach(), k.detach(), key_ids, **extremes), select, by_cluster)
    scaled = q.detach() * scale
    with torch.no_grad():
        logits = bound_logits(scaled, k.detach(), key_ids, num_groups=num_groups, window=window, causal=causal,
                              block=block)
    return top_groups(logits, select, by_cluster)


def _outside_window(N: int, window: int, causal: bool, device: torch.device) -> torch.Tensor:
    """(N, N) bool: key j lies outside query t's window (causal: j <= t - window; otherwise j < t - window / 2 or
    j >= t + window / 2)."""
    offset = torch.arange(N, device=device) - torch.arange(N, device=device)[:, None]  # j - t
    if causal:
        return offset <= -window
    return (offset < -(window // 2)) | (offset >= window - window // 2)


def _log_count(n: torch.Tensor) -> torch.Tensor:
    """log n where n > 0, -inf where n = 0 (an empty summary is not read)."""
    return torch.where(n > 0, n.clamp(min=1).log(), float("-inf"))


KERNELS = ("auto", "gather", "dense-mask", "banded", "fused")


DENSE_MASK_UP_TO = 256  # "auto" takes the dense mask to this length, the banded kernel beyond


def fused_usable(q: torch.Tensor, *, dropout_p: float = 0.0) -> str | None:
    """Why the ``"fused"`` kernel cannot take these queries, or None when it can: it runs float32/float64 CPU tensors
    without attention dropout, once its C++ kernel is built (:mod:`clusterformer.ops.listed_attention`)."""
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.float64):
        return f"it runs float32/float64 CPU tensors; got {q.dtype} on {q.device}"
    if dropout_p:
        return f"it has no attention dropout; got dropout_p={dropout_p}"
    if not extension_available():
        return f"its C++ kernel is not built here ({extension_error()})"
    return None


def resolve_kernel(kernel: str, length: int, *, q: torch.Tensor | None = None, dropout_p: float = 0.0) -> str:
    """The kernel that ``kernel`` names at this length: "gather", "dense-mask", "banded" or "fused" as given ("fused"
    with ``q``: a ``ValueError`` saying why where it cannot run, :func:`fused_usable`); "auto" takes the fused kernel
    for queries ``q`` it can run, else the dense mask while N <= 256 and the banded kernel beyond. Measured on the
    CPU (one thread, a layer's forward and backward, docs/benchmarks.md "cluster-select's sparse key lists" and "the
    fused key lists"): the dense mask took 0.77x the banded kernel's time at N = 256 (causal, 64 keys) and 0.97x at
    N = 256 (non-causal, 144 keys); the banded kernel took 0.47x the dense mask's at N = 384, 0.37x at 512,
    0.26-0.45x at 1,024, 0.09x at 1,500 and 0.10x at 4,096. The gather kernel (every key, window included, listed
    per query) is the reference form; it is slower than one of them at every length measured. The fused kernel
    reads the same keys and summaries in one C++ pass, and was faster than the three at every length and shape
    measured."""
    if kernel == "fused" and q is not None:
        reason = fused_usable(q, dropout_p=dropout_p)
        if reason:
            raise ValueError(f"cluster-select's kernel='fused' cannot run here: {reason}; use kernel='auto'")
    if kernel != "auto":
        return kernel
    if q is not None and fused_usable(q, dropout_p=dropout_p) is None:
        return "fused"
    return "dense-mask" if length <= DENSE_MASK_UP_TO else "banded"


def _weights(scores: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Softmax over the last axis of scores with -inf for keys not read; a row without keys gets weights 0."""
    empty = (scores == float("-inf")).all(-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return F.dropout(weights, dropout_p) if dropout_p else weights


def selected_cluster_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_ids: torch.Tensor, selected: torch.Tensor, *,
    num_clusters: int, cluster_keys: int, window: int, causal: bool, key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0, kernel: str = "auto", summaries: bool = False, layout: ClusterLayout | None = None,
    band: ChunkBand | None = None, members: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of each query over its window and its selected clusters' keys (module docstring).

    q, k, v: (B, H, N, D); key_ids (B, H, N) in [0, num_clusters] (num_clusters: padding); selected (B, H, N, S)
    distinct cluster ids. ``kernel``: "gather" (every key each query reads as sparse key lists: O(N M D); the name
    is the historical one), "banded" (the window from chunk bands, the cluster keys listed, the summaries from
    per-chunk prefix sums: O(N (M + C) D), no (N, N) or (N, C, D) tensor), "dense-mask" (the same set as an (N, N)
    boolean mask for one SDPA call: O(N^2 D) but matmul-shaped, faster at a few hundred positions), "fused" (the
    gather kernel's lists and the summaries read by one C++ pass, :mod:`clusterformer.ops.listed_attention`; no
    attention dropout) or
    "auto" (:func:`resolve_kernel`).
    ``summaries``: also one summary per cluster of the members not read alone outside the window, in the same
    softmax (:func:`cluster_summaries`). ``layout``: :func:`cluster_layout` of ``key_ids``, if the caller has it;
    ``band``: with the banded kernel, the layer's :func:`chunk_band` of q / sqrt(D), k and v (with summaries when
    ``summaries``), if the caller has it (the summaries' selection reads the same band).
    ``members``: (B, H, N, M) the key positions each query reads alone from its clusters (-1: none), in place of
    each selected cluster's members nearest to the window (:func:`scored_members`: ``members="score"``); not with
    ``summaries``, whose ranges leave out the nearest members.
    Returns (B, H, N, D); a query without any key gets 0."""
    B, H, N, D = q.shape
    if layout is None:
        layout = cluster_layout(key_ids, num_clusters=num_clusters, window=window, causal=causal)
    scale = D ** -0.5
    kernel = resolve_kernel(kernel, N, q=q, dropout_p=dropout_p)
    if members is not None:
        if summaries:
            raise ValueError("members lists the keys read alone, but the summaries leave out each cluster's members "
                             "nearest to the window: pass summaries=False with members")
        if members.shape[:3] != (B, H, N) or members.dtype != torch.long:
            raise ValueError(f"members must be an int64 tensor (B, H, N, M) with (B, H, N) = {(B, H, N)}; got "
                             f"{members.dtype} {tuple(members.shape)}")
        if kernel == "fused":
            return listed_attention(q, k, v, members, scale, window=window,
                                    window_offset=window - 1 if causal else window // 2,
                                    key_padding_mask=key_padding_mask)[0]
        positions, allowed = _with_window(members.clamp(min=0), members >= 0, window=window, causal=causal,
                                          key_padding_mask=key_padding_mask)
        return _attend_positions(q, k, v, key_ids, selected, positions, allowed, layout, kernel=kernel,
                                 window=window, cluster_keys=cluster_keys, causal=causal,
                                 key_padding_mask=key_padding_mask, dropout_p=dropout_p, band=band, slots=None)
    if kernel == "fused":  # the selected clusters' keys as runs of sorted slots, the window read in place: one C++ pass
        runs = cluster_runs(layout, selected, cluster_keys=cluster_keys, causal=causal)
        ranges = None
        if summaries:  # each cluster's rows in sorted order outside the window, less those read alone
            lower_end, upper_start = _summary_ranges(layout, selected, cluster_keys=cluster_keys, causal=causal)
            ranges = RangeSummaries(layout.cluster_prefix(k), layout.cluster_prefix(v), layout.prefix_start,
                                    layout.total, lower_end, upper_start)
        return listed_attention(q, k, v, q.new_empty(B, H, N, 0, dtype=torch.long), scale, window=window,
                                window_offset=window - 1 if causal else window // 2,
                                key_padding_mask=key_padding_mask, summaries=ranges, runs=runs)[0]
    positions, allowed, slots = _selected_positions(layout, selected, cluster_keys=cluster_keys, window=window,
                                                    causal=causal, key_padding_mask=key_padding_mask)
    return _attend_positions(q, k, v, key_ids, selected, positions, allowed, layout, kernel=kernel, window=window,
                             cluster_keys=cluster_keys, causal=causal, key_padding_mask=key_padding_mask,
                             dropout_p=dropout_p, band=band, slots=slots, summaries=summaries)


def _attend_positions(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_ids: torch.Tensor,
                      selected: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor, layout: ClusterLayout,
                      *, kernel: str, window: int, cluster_keys: int, causal: bool,
                      key_padding_mask: torch.Tensor | None, dropout_p: float, band: ChunkBand | None,
                      slots: torch.Tensor | None, summaries: bool = False) -> torch.Tensor:
    """The unfused kernels ("banded", "dense-mask", "gather") over the keys each query reads alone, (B, H, N, M)
    ``positions`` and ``allowed`` with its window last (:func:`_with_window`), and with ``summaries`` the summaries
    of the rest (``slots``: the :func:`cluster_slots` of the cluster part, when it is the nearest members)."""
    B, H, N, D = q.shape
    scale = D ** -0.5
    M = positions.shape[-1]
    if kernel == "banded":  # the cluster part only: the band holds the window
        alone = M - window
        return _banded_attention(q * scale, k, v, key_ids, selected, positions[..., :alone], allowed[..., :alone],
                                 layout, window=window, cluster_keys=cluster_keys, causal=causal,
                                 key_padding_mask=key_padding_mask, summaries=summaries, dropout_p=dropout_p,
                                 band=band, slots=slots)
    if kernel == "dense-mask":
        # scatter True at every allowed position; the entries that are not allowed go to an extra column, dropped
        index = torch.where(allowed, positions, N)
        mask = torch.zeros(B, H, N, N + 1, dtype=torch.bool, device=q.device).scatter_(-1, index, True)[..., :N]
        if summaries:
            n = summary_counts(layout, selected, cluster_keys=cluster_keys, causal=causal).to(q.dtype)
            return _dense_with_summaries(q * scale, k, v, key_ids, mask, n, window, causal, dropout_p)
        return masked_sdpa(q, k, v, mask, dropout_p=dropout_p)
    lists = key_lists(positions)  # the keys each query reads, as sparse key lists (ops/key_lists.py)
    scores = listed_scores(q * scale, k, lists).masked_fill(~allowed, float("-inf"))
    if not summaries:
        return listed_sum(_weights(scores, dropout_p), v, lists)
    summary_keys, summary_values, log_n = cluster_summaries(k, v, layout, selected, cluster_keys=cluster_keys,
                                                            causal=causal)
    summary_scores = torch.einsum("bhnd,bhncd->bhnc", q * scale, summary_keys) + log_n
    weights = _weights(torch.cat([scores, summary_scores], dim=-1), dropout_p)
    return listed_sum(weights[..., :M], v, lists) + torch.einsum("bhnc,bhncd->bhnd", weights[..., M:], summary_values)


def _banded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_ids: torch.Tensor,
                      selected: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor, layout: ClusterLayout, *,
                      window: int, cluster_keys: int, causal: bool, key_padding_mask: torch.Tensor | None,
                      summaries: bool, dropout_p: float, band: ChunkBand | None,
                      slots: torch.Tensor | None = None) -> torch.Tensor:
    """The ``"banded"`` kernel (module docstring): the window from the chunk bands, the selected clusters' keys as
    sparse key lists ((B, H, N, M) ``positions`` / ``allowed`` of the keys read alone, from :func:`selected_positions`
    without its window columns), the summaries from the band's ``summary_dots`` less the keys read alone -- one
    softmax over the three, normalised by the row's largest logit without concatenating them. q is already
    scaled; a row without keys gets 0. ``slots``: the :func:`cluster_slots` of ``positions``, if the caller has
    them: the keys are then listed as runs of the cluster-sorted keys (:func:`_read_alone`)."""
    B, H, N, _ = q.shape
    C = layout.total.shape[-1]
    if band is None:
        band = chunk_band(q, k, v, key_ids, key_padding_mask, num_clusters=C, window=window, causal=causal,
                          summaries=summaries)
    L = band.scores.shape[3]
    # the keys read alone as sparse key lists (ops/key_lists.py): no (B, H, N, M, D) gather
    lists = _read_alone(positions, slots, layout, cluster_keys=cluster_keys, causal=causal)
    alone_raw = listed_scores(q, k, lists)  # (B, H, N, M)
    alone_scores = alone_raw.masked_fill(~allowed, float("-inf"))

    window_scores = _from_chunks(band.scores.masked_fill(~band.window, float("-inf")), N)
    m = torch.maximum(window_scores.amax(-1, keepdim=True), alone_scores.amax(-1, keepdim=True))
    if summaries:  # q . (sum of the members outside the window, less those read alone) / n + log n
        n = summary_counts(layout, selected, cluster_keys=cluster_keys, causal=causal).to(q.dtype)
        read_alone = alone_raw.masked_fill(~allowed, 0.0).view(B, H, N, -1, cluster_keys).sum(-1)  # (B, H, N, S)
        dots = band.summary_dots.scatter_add(-1, selected, -read_alone)
        summary_scores = dots / n.clamp(min=1) + _log_count(n)
        m = torch.maximum(m, summary_scores.amax(-1, keepdim=True))
    # the shift cancels in the ratio, so it needs no gradient; -inf (a row without keys) becomes 0 to keep exp finite
    m = m.detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    in_window, alone = torch.exp(window_scores - m), torch.exp(alone_scores - m)
    total = in_window.sum(-1, keepdim=True) + alone.sum(-1, keepdim=True)
    if summaries:
        summary = torch.exp(summary_scores - m)
        total = total + summary.sum(-1, keepdim=True)
    total = torch.where(total > 0, total, torch.ones_like(total))  # a row without keys: 0 / 1
    in_window, alone = F.dropout(in_window / total, dropout_p), F.dropout(alone / total, dropout_p)

    band_weights = _to_chunks(in_window, L)
    # the products' backward needs the band's copy of the values (width x V): the recipe shifts v into it again
    keep_values = (nullcontext() if band.values_recipe is None
                   else recompute_saved(band.values, band.values_recipe))
    if not summaries:
        with keep_values:
            banded = band_weights @ band.values
        return _from_chunks(banded, N) + listed_sum(alone, v, lists)
    # a summary's weight spreads over its members as w / n: those in whole chunks beyond the band through the
    # chunk sums, those in the band through the band weights, less the members read alone
    share = F.dropout(summary / total, dropout_p) / n.clamp(min=1)  # (B, H, N, C)
    share_chunks = _to_chunks(share, L)
    with keep_values:  # matrix products only: none keeps its own output (ops/recompute.py)
        out = band_weights @ band.values + share_chunks @ band.beyond_values
        for lo, hi in band.spans:  # the band's members outside the window: only these columns hold any
            members, values = band.members[..., lo:hi, :], band.values[..., lo:hi, :]
            out = out + ((share_chunks @ members.transpose(-1, -2)) * band.outside[:, lo:hi]) @ values
    taken = share.gather(-1, selected).repeat_interleave(cluster_keys, dim=-1) * allowed  # (B, H, N, M)
    return _from_chunks(out, N) + listed_sum(alone - taken, v, lists)


def _read_alone(positions: torch.Tensor, slots: torch.Tensor | None, layout: ClusterLayout, *, cluster_keys: int,
                causal: bool) -> KeyLists:
    """The keys each query reads alone (``positions``) as sparse key lists.

    A selected cluster's members read alone are one run of consecutive slots in cluster-sorted order (two runs of
    ``cluster_keys / 2`` without ``causal``: :func:`cluster_slots`), so the lists' transpose is built from the runs
    with no sort of the entries (:func:`run_key_lists`), over the slots padded by ``cluster_keys`` at both ends so
    that no run is clamped. The entries outside [0, N) or in a neighbouring cluster are masked, as the transpose
    asks. Without ``slots``, or with an odd ``cluster_keys`` and no ``causal`` (runs of two lengths), plain
    :func:`key_lists`."""
    runs = None if slots is None else (1 if causal else 2 if cluster_keys % 2 == 0 else 0)
    if not runs:
        return key_lists(positions)
    B, H, N = layout.order.shape
    length, pad = cluster_keys // runs, cluster_keys
    first = slots[..., ::length].reshape(B, H, N, -1) + pad  # (B, H, N, S runs) first slot of each run
    key_slot = torch.empty_like(layout.order).scatter_(-1, layout.order, torch.arange(N, device=positions.device)
                                                       .expand(B, H, N)) + pad
    return run_key_lists(positions, first, length, key_slot, N + 2 * pad)


def _dense_with_summaries(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_ids: torch.Tensor, mask: torch.Tensor,
                          n: torch.Tensor, window: int, causal: bool, dropout_p: float) -> torch.Tensor:
    """The dense-mask kernel with cluster summaries, by matmuls: ``rest`` (B, H, N, N) marks the keys each summary
    holds (outside the window, real, not read alone); with the one-hot clusters O (B, H, N, C), n = rest O
    (given, (B, H, N, C): :func:`summary_counts`) and q . sum = (scores * rest) O. A summary's weight w spreads
    over its members as w / n, so the output is one (N, N) x (N, D) product. One softmax over the keys read alone
    and the summaries, without concatenating them: with m the row's largest logit, weights e^(s - m) / Z. A row
    without keys or summaries gets 0. q is already scaled. (Below N = C * D the (N, N) passes cost less than
    (N, C, D) summaries per query.)"""
    N, C = q.shape[2], n.shape[-1]
    members = F.one_hot(key_ids, C + 1)[..., :C].to(q.dtype)  # padding: in no cluster
    rest = (_outside_window(N, window, causal, q.device) & (key_ids < C).unsqueeze(2) & ~mask).to(q.dtype)
    scores = q @ k.transpose(-1, -2)
    summary_scores = (scores * rest) @ members / n.clamp(min=1) + _log_count(n)
    alone_scores = scores.masked_fill(~mask, float("-inf"))
    # the shift cancels in the ratio, so it needs no gradient; -inf (a row without keys) becomes 0 to keep exp finite
    m = torch.maximum(alone_scores.amax(-1, keepdim=True), summary_scores.amax(-1, keepdim=True)).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    alone, summary = torch.exp(alone_scores - m), torch.exp(summary_scores - m)
    total = alone.sum(-1, keepdim=True) + summary.sum(-1, keepdim=True)
    total = torch.where(total > 0, total, torch.ones_like(total))  # a row without keys: 0 / 1
    if dropout_p:
        alone, summary = F.dropout(alone / total, dropout_p), F.dropout(summary / total, dropout_p)
        total = torch.ones_like(total)
    spread = (summary / n.clamp(min=1)) @ members.transpose(-1, -2) * rest  # each member's share of its summary
    return (alone + spread) @ v / total
