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
the sorted order and then to positions. The keys and values at those positions are gathered, (B, H, N, M, D) with
M = S * cluster_keys + window, and attended with explicit scores: O(N M D) time and memory, no loop over tokens,
clusters or queries.

Cluster summaries (``summaries=True``; NSA's compressed branch, Yuan et al. 2025, with clusters for blocks). Each
query also reads, in the same softmax, one summary per cluster of the members it does not read individually and
that lie outside its window: key = their mean key, value = their mean value, logit = q . mean / sqrt(D) + log n
(n members: the summary stands for n keys, and exp of its logit bounds their total weight from below by Jensen).
Every key outside the window is thus counted once -- alone or inside its cluster's summary -- and every cluster,
selected or not, gets the task's gradient through its summary. The sums come from one prefix sum of the keys and
values in sorted (cluster, position) order, (B, H, N + 1, D): a rank range of a cluster is a difference of two
rows. :func:`summary_selection` ranks the clusters by the same logits over all their members outside the window.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["cluster_layout", "cluster_summaries", "selected_cluster_attention", "selected_positions",
           "summary_counts", "summary_selection", "use_dense_mask"]


class ClusterLayout(NamedTuple):
    """Keys in sorted (cluster, position) order, per (sequence, head).

    order: (B, H, N) slot -> position; total: (B, H, C) members per cluster; start: (B, H, C) first slot of each
    cluster; below: (B, H, N, C) members of each cluster before query t's window (causal: at positions <= t -
    window; otherwise before t - window / 2); beyond: (B, H, N, C) members before the end of t's window (causal:
    ``total``, nothing lies beyond it)."""

    order: torch.Tensor
    total: torch.Tensor
    start: torch.Tensor
    below: torch.Tensor
    beyond: torch.Tensor


def cluster_layout(key_ids: torch.Tensor, *, num_clusters: int, window: int, causal: bool) -> ClusterLayout:
    """The sorted layout of ``key_ids`` (B, H, N) in [0, num_clusters] (``num_clusters``: padding, sorted last and
    in no cluster) around every query's window. One stable sort and one prefix count, (B, H, N + 1, C)."""
    N = key_ids.shape[-1]
    C = num_clusters
    order = torch.sort(key_ids, dim=-1, stable=True).indices  # slot -> position, by (cluster, position)
    members = F.one_hot(key_ids, C + 1)[..., :C]  # (B, H, N, C)
    before = F.pad(members.cumsum(2), (0, 0, 1, 0))  # (B, H, N + 1, C): members at positions < p
    total = before[:, :, N]  # (B, H, C)
    start = total.cumsum(-1) - total  # first slot of each cluster
    t = torch.arange(N, device=key_ids.device)
    if causal:  # the window is (t - window, t]
        return ClusterLayout(order, total, start, before[:, :, (t - window + 1).clamp(min=0)],
                             total.unsqueeze(2).expand_as(before[:, :, :N]))
    half = window // 2  # the window is [t - window / 2, t + window / 2)
    return ClusterLayout(order, total, start, before[:, :, (t - half).clamp(min=0)],
                         before[:, :, (t + window - half).clamp(max=N)])


def selected_positions(
    key_ids: torch.Tensor, selected: torch.Tensor, *, num_clusters: int, cluster_keys: int, window: int, causal: bool,
    key_padding_mask: torch.Tensor | None = None, layout: ClusterLayout | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The key positions each query reads: ((B, H, N, M) long positions, (B, H, N, M) bool allowed).

    key_ids: (B, H, N) in [0, num_clusters]; ``num_clusters`` marks padding (never counted or read).
    selected: (B, H, N, S) distinct cluster ids in [0, num_clusters) per query. ``layout``: :func:`cluster_layout`
    of the same ids, if the caller has it."""
    B, H, N = key_ids.shape
    S = selected.shape[-1]
    device = key_ids.device
    if layout is None:
        layout = cluster_layout(key_ids, num_clusters=num_clusters, window=window, causal=causal)
    order, total, start = layout.order, layout.total, layout.start
    t = torch.arange(N, device=device)
    steps = torch.arange(cluster_keys, device=device)
    below, beyond = layout.below.gather(-1, selected), layout.beyond.gather(-1, selected)  # (B, H, N, S)
    if causal:  # the most recent members at positions <= t - window
        ranks = (below - cluster_keys).unsqueeze(-1) + steps
        valid = ranks >= 0
    else:  # before the window [t - window / 2, t + window / 2) and after it
        first_half = cluster_keys // 2
        lower = below.unsqueeze(-1) - first_half + steps[:first_half]
        upper = beyond.unsqueeze(-1) + steps[: cluster_keys - first_half]
        ranks = torch.cat([lower, upper], dim=-1)
        size = total.gather(-1, selected.flatten(2)).view(B, H, N, S, 1)
        valid = (ranks >= 0) & (ranks < size)
    slots = start.gather(-1, selected.flatten(2)).view(B, H, N, S, 1) + ranks
    slots = slots.clamp(0, max(N - 1, 0)).view(B, H, N * S * cluster_keys)
    cluster_positions = order.gather(-1, slots).view(B, H, N, S * cluster_keys)
    cluster_valid = valid.view(B, H, N, S * cluster_keys)

    offsets = torch.arange(window, device=device)
    window_positions = t[:, None] + offsets - (window - 1 if causal else window // 2)  # (N, window)
    window_valid = (window_positions >= 0) & (window_positions < N)
    window_positions = window_positions.clamp(0, max(N - 1, 0))
    positions = torch.cat([cluster_positions, window_positions.expand(B, H, N, window)], dim=-1)
    allowed = torch.cat([cluster_valid, window_valid.expand(B, H, N, window)], dim=-1)
    if key_padding_mask is not None:  # the cluster part never reads padding (its id is num_clusters); the window may
        pad = key_padding_mask[:, None, None, :].expand(B, H, N, N)
        allowed = allowed & ~pad.gather(-1, positions)
    return positions, allowed


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
    start = layout.start.unsqueeze(2).expand(B, H, N, C)
    rows = torch.stack([start + lower_end, start, start + total, start + upper_start])  # (4, B, H, N, C)
    index = rows.permute(1, 2, 0, 3, 4).reshape(B, H, 4 * N * C, 1).expand(B, H, 4 * N * C, D)

    def range_sums(x: torch.Tensor) -> torch.Tensor:  # prefix sums in sorted order, differenced: (B, H, N, C, D)
        prefix = F.pad(x.gather(2, layout.order.unsqueeze(-1).expand(B, H, N, D)).cumsum(2), (0, 0, 1, 0))
        upto_lower, first, last, from_upper = prefix.gather(2, index).view(B, H, 4, N, C, D).unbind(2)
        return (upto_lower - first) + (last - from_upper)

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


def summary_selection(q: torch.Tensor, k: torch.Tensor, key_ids: torch.Tensor, layout: ClusterLayout, *,
                      select: int, window: int, causal: bool, dense: bool) -> torch.Tensor:
    """The ``select`` clusters (B, H, N, S) whose summary of every member outside the window scores highest for
    each query: q . mean / sqrt(D) + log n, the logit the summary would have in the softmax. No gradient (an
    argmax); clusters without such members rank last. ``dense``: from the (N, N) scores by two matmuls (the
    dense-mask kernel's way, :func:`use_dense_mask`), otherwise from :func:`cluster_summaries`."""
    with torch.no_grad():
        q, k = q.detach() * q.shape[-1] ** -0.5, k.detach()
        if dense:
            C = layout.total.shape[-1]
            members = F.one_hot(key_ids, C + 1)[..., :C].to(q.dtype)  # (B, H, N, C); padding in none
            outside = _outside_window(key_ids.shape[-1], window, causal, q.device).to(q.dtype)
            n = outside @ members
            logits = ((q @ k.transpose(-1, -2)) * outside) @ members / n.clamp(min=1) + _log_count(n)
        else:
            keys, _, log_n = cluster_summaries(k, k, layout, None, cluster_keys=0, causal=causal)
            logits = torch.einsum("bhnd,bhncd->bhnc", q, keys) + log_n
    return logits.topk(select, dim=-1).indices


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


def use_dense_mask(kernel: str, length: int, keys_per_query: int) -> bool:
    """Whether ``kernel`` attends through an (N, N) mask: "dense-mask", or "auto" while N <= 16 M (M: keys per query
    read alone) -- on the CPU the mask was 7x faster than the gather at N = 4,096, M = 256 (docs/benchmarks.md)."""
    return kernel == "dense-mask" or (kernel == "auto" and length <= 16 * keys_per_query)


def _weights(scores: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Softmax over the last axis of scores with -inf for keys not read; a row without keys gets weights 0."""
    empty = (scores == float("-inf")).all(-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return F.dropout(weights, dropout_p) if dropout_p else weights


KERNELS = ("auto", "gather", "dense-mask")


def selected_cluster_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_ids: torch.Tensor, selected: torch.Tensor, *,
    num_clusters: int, cluster_keys: int, window: int, causal: bool, key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0, kernel: str = "auto", summaries: bool = False, layout: ClusterLayout | None = None,
) -> torch.Tensor:
    """Softmax attention of each query over its window and its selected clusters' keys (module docstring).

    q, k, v: (B, H, N, D); key_ids (B, H, N) in [0, num_clusters] (num_clusters: padding); selected (B, H, N, S)
    distinct cluster ids. ``kernel``: "gather" (the keys each query reads, O(N M D)), "dense-mask" (the same set as
    an (N, N) boolean mask for one SDPA call: O(N^2 D) but matmul-shaped, faster while N is a few times M), or
    "auto" (dense-mask for N <= 16 M: on the CPU it was 7x faster than the gather at N = 4,096, M = 256).
    ``summaries``: also one summary per cluster of the members not read alone outside the window, in the same
    softmax (:func:`cluster_summaries`). ``layout``: :func:`cluster_layout` of ``key_ids``, if the caller has it.
    Returns (B, H, N, D); a query without any key gets 0."""
    B, H, N, D = q.shape
    if layout is None:
        layout = cluster_layout(key_ids, num_clusters=num_clusters, window=window, causal=causal)
    positions, allowed = selected_positions(key_ids, selected, num_clusters=num_clusters, cluster_keys=cluster_keys,
                                            window=window, causal=causal, key_padding_mask=key_padding_mask,
                                            layout=layout)
    M = positions.shape[-1]
    scale = D ** -0.5
    if use_dense_mask(kernel, N, M):
        # scatter True at every allowed position; the entries that are not allowed go to an extra column, dropped
        index = torch.where(allowed, positions, N)
        mask = torch.zeros(B, H, N, N + 1, dtype=torch.bool, device=q.device).scatter_(-1, index, True)[..., :N]
        if summaries:
            n = summary_counts(layout, selected, cluster_keys=cluster_keys, causal=causal).to(q.dtype)
            return _dense_with_summaries(q * scale, k, v, key_ids, mask, n, window, causal, dropout_p)
        empty = ~mask.any(-1, keepdim=True)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | empty, dropout_p=dropout_p)
        return out.masked_fill(empty, 0.0)
    index = positions.reshape(B, H, N * M, 1).expand(B, H, N * M, D)
    keys = k.gather(2, index).view(B, H, N, M, D)
    values = v.gather(2, index).view(B, H, N, M, D)
    scores = torch.einsum("bhnd,bhnmd->bhnm", q * scale, keys).masked_fill(~allowed, float("-inf"))
    if summaries:
        summary_keys, summary_values, log_n = cluster_summaries(k, v, layout, selected, cluster_keys=cluster_keys,
                                                                causal=causal)
        summary_scores = torch.einsum("bhnd,bhncd->bhnc", q * scale, summary_keys) + log_n
        scores = torch.cat([scores, summary_scores], dim=-1)
        values = torch.cat([values, summary_values], dim=3)
    return torch.einsum("bhnm,bhnmd->bhnd", _weights(scores, dropout_p), values)


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
