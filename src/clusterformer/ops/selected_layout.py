"""Which keys each ``"cluster-select"`` query reads: keys sorted by cluster, around every query's window
(:mod:`clusterformer.ops.selected` attends them).

Every key belongs to one cluster; each query names ``S`` clusters (its selection) and reads, in one softmax:

* its window: causal, the positions (t - window, t]; otherwise [t - window / 2, t + window / 2);
* from each selected cluster, ``cluster_keys`` members outside the window, nearest to the query in position:
  causal, the most recent members at positions <= t - window; otherwise up to cluster_keys / 2 members before the
  window and the rest after it.

The window and the cluster part are disjoint by position, and a query selects distinct clusters, so every key
counts once. Nothing here depends on later positions under ``causal``, or on other sequences of the batch.

Keys sorted by (cluster, position) with one stable sort (:class:`ClusterLayout`); a prefix count of each cluster's
members, (B, H, N + 1, C), gives the rank range of every (query, selected cluster) pair; the ranks map to slots of
the sorted order (:func:`cluster_slots`, or runs of them, :func:`cluster_runs`) and then to positions
(:func:`listed_positions`). No loop over tokens, clusters or queries.

Cluster summaries (``summaries=True``; NSA's compressed branch, Yuan et al. 2025, with clusters for blocks). Each
query also reads, in the same softmax, one summary per cluster of the members it does not read individually and
that lie outside its window: key = their mean key, value = their mean value, logit = q . mean / sqrt(D) + log n
(n members: the summary stands for n keys, and exp of its logit bounds their total weight from below by Jensen).
Every key outside the window is thus counted once -- alone or inside its cluster's summary -- and every cluster,
selected or not, gets the task's gradient through its summary. A summary holds rank ranges of its cluster
(:func:`summary_ranges`); their sums come from each cluster's own prefix sums of the keys and values
(:meth:`ClusterLayout.cluster_prefix`), restarted at the cluster's start, so that a query's summary is computed
from its members alone -- bit for bit, in any dtype, under a causal mask nothing of a later key reaches it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..masks import AttentionMask
from .listed_attention import SlotRuns

__all__ = ["PREFIX_BLOCK", "ClusterLayout", "cluster_layout", "cluster_runs", "cluster_slots", "cluster_summaries",
           "listed_positions", "log_count", "outside_window", "summary_counts", "summary_ranges", "with_window"]


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
        self._plan: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

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
        return self._prefix_plan()[3]

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
        source, empty, block_rank, _ = self._prefix_plan()
        B, H, _, D = x.shape
        blocks = block_rank.shape[-1]
        # gathered from x itself, which the backward keeps anyway (a padded copy would be kept too)
        rows = x.gather(2, source.unsqueeze(-1).expand(B, H, -1, D)).masked_fill(empty, 0.0)
        local = rows.view(B, H, blocks, PREFIX_BLOCK, D).cumsum(3)
        totals = local[:, :, :, -1]  # (B, H, blocks, D)
        shift = 1
        while shift < blocks:  # after it, block b holds its cluster's blocks b - 2 shift + 1 .. b
            reach = (block_rank >= shift).unsqueeze(-1)
            totals = torch.where(reach, totals + F.pad(totals, (0, 0, shift, 0))[:, :, :blocks], totals)
            shift *= 2
        earlier = torch.where((block_rank >= 1).unsqueeze(-1), F.pad(totals, (0, 0, 1, 0))[:, :, :blocks], 0.0)
        return (local + earlier.unsqueeze(3)).view(B, H, blocks * PREFIX_BLOCK, D)

    def _prefix_plan(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`cluster_prefix`'s rows: (B, H, R) the position whose row each holds and (B, H, R, 1) True where
        it holds none (zero), (B, H, R / PREFIX_BLOCK) each block's rank in its cluster, and :attr:`prefix_start`.
        Cluster c takes ceil((total[c] + 1) / PREFIX_BLOCK) blocks, its members from the second row of the first
        on; R covers every cluster of any (B, H) pair: ceil(N / PREFIX_BLOCK) + C blocks."""
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
            empty = (source == N).unsqueeze(-1)
            block = torch.arange(blocks, device=self.order.device).expand(B, H, blocks).contiguous()
            owner = torch.searchsorted(block_end, block, right=True)  # the cluster of each block (C: none)
            block_start = F.pad(block_end - taken, (0, 1), value=0)
            block_start[..., -1] = block_end[..., -1]
            self._plan = (source.clamp(max=N - 1), empty, block - block_start.gather(-1, owner), first_row)
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


def listed_positions(layout: ClusterLayout, selected: torch.Tensor, *, cluster_keys: int, window: int,
                        mask: AttentionMask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys each query reads alone and its window: ((B, H, N, M) long positions, (B, H, N, M) bool allowed,
    the window last), and the :func:`cluster_slots` its cluster part came from. ``selected``: (B, H, N, S) distinct
    cluster ids in [0, num_clusters) per query; ``mask``: the call's mask (causal order, padding)."""
    cluster_positions, cluster_valid, slots = _cluster_positions(layout, selected, cluster_keys=cluster_keys,
                                                                 causal=mask.causal)
    positions, allowed = with_window(cluster_positions, cluster_valid, window=window, mask=mask)
    return positions, allowed, slots


def with_window(cluster_positions: torch.Tensor, cluster_valid: torch.Tensor, *, window: int, mask: AttentionMask
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys a query reads alone from its clusters, (B, H, N, M) positions and valid, followed by its window:
    (B, H, N, M + window) positions and allowed (the window's padding and positions outside [0, N) not): ``mask``
    gives the window's place (causal: (t - window, t]) and the padding."""
    B, H, N, _ = cluster_positions.shape
    device = cluster_positions.device
    t = torch.arange(N, device=device)
    offsets = torch.arange(window, device=device)
    window_positions = t[:, None] + offsets - (window - 1 if mask.causal else window // 2)  # (N, window)
    window_valid = (window_positions >= 0) & (window_positions < N)
    window_positions = window_positions.clamp(0, max(N - 1, 0))
    positions = torch.cat([cluster_positions, window_positions.expand(B, H, N, window)], dim=-1)
    allowed = torch.cat([cluster_valid, window_valid.expand(B, H, N, window)], dim=-1)
    if mask.padding is not None:  # the cluster part never reads padding (its id is num_clusters); the window may
        real = mask.real(B, N, device)[:, None, None, :].expand(B, H, N, N)
        allowed = allowed & real.gather(-1, positions)
    return positions, allowed


def _cluster_positions(layout: ClusterLayout, selected: torch.Tensor, *, cluster_keys: int, causal: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The cluster part of :func:`listed_positions`: positions and valid (B, H, N, S * cluster_keys), and the
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
    lower_end, upper_start = summary_ranges(layout, selected, cluster_keys=cluster_keys, causal=causal)
    count = lower_end + total - upper_start
    start = layout.prefix_start.unsqueeze(2).expand(B, H, N, C)
    rows = torch.stack([start + lower_end, start + total, start + upper_start])  # (3, B, H, N, C)
    index = rows.permute(1, 2, 0, 3, 4).reshape(B, H, 3 * N * C, 1).expand(B, H, 3 * N * C, D)

    def range_sums(x: torch.Tensor) -> torch.Tensor:  # each cluster's own prefix sums: (B, H, N, C, D)
        upto_lower, last, from_upper = layout.cluster_prefix(x).gather(2, index).view(B, H, 3, N, C, D).unbind(2)
        return upto_lower + (last - from_upper)

    n = count.to(k.dtype)
    return range_sums(k) / n.clamp(min=1).unsqueeze(-1), range_sums(v) / n.clamp(min=1).unsqueeze(-1), log_count(n)


def summary_ranges(layout: ClusterLayout, selected: torch.Tensor | None, *, cluster_keys: int, causal: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ranks each query's summaries hold, per cluster: [0, lower_end) and [upper_start, total), both (B, H, N, C):
    the members outside the window, less those read alone from the ``selected`` clusters (the ranges of
    :func:`listed_positions`)."""
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
    lower_end, upper_start = summary_ranges(layout, selected, cluster_keys=cluster_keys, causal=causal)
    return lower_end + layout.total.unsqueeze(2) - upper_start


def outside_window(N: int, window: int, causal: bool, device: torch.device) -> torch.Tensor:
    """(N, N) bool: key j lies outside query t's window (causal: j <= t - window; otherwise j < t - window / 2 or
    j >= t + window / 2)."""
    offset = torch.arange(N, device=device) - torch.arange(N, device=device)[:, None]  # j - t
    if causal:
        return offset <= -window
    return (offset < -(window // 2)) | (offset >= window - window // 2)


def log_count(n: torch.Tensor) -> torch.Tensor:
    """log n where n > 0, -inf where n = 0 (an empty summary is not read)."""
    return torch.where(n > 0, n.clamp(min=1).log(), float("-inf"))
