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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["selected_cluster_attention", "selected_positions"]


def selected_positions(
    key_ids: torch.Tensor, selected: torch.Tensor, *, num_clusters: int, cluster_keys: int, window: int, causal: bool,
    key_padding_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The key positions each query reads: ((B, H, N, M) long positions, (B, H, N, M) bool allowed).

    key_ids: (B, H, N) in [0, num_clusters]; ``num_clusters`` marks padding (never counted or read).
    selected: (B, H, N, S) distinct cluster ids in [0, num_clusters) per query."""
    B, H, N = key_ids.shape
    S = selected.shape[-1]
    device = key_ids.device
    C = num_clusters
    order = torch.sort(key_ids, dim=-1, stable=True).indices  # slot -> position, by (cluster, position)
    members = F.one_hot(key_ids, C + 1)[..., :C]  # (B, H, N, C)
    before = F.pad(members.cumsum(2), (0, 0, 1, 0))  # (B, H, N + 1, C): members at positions < p
    total = before[:, :, N]  # (B, H, C)
    start = total.cumsum(-1) - total  # first slot of each cluster
    t = torch.arange(N, device=device)
    steps = torch.arange(cluster_keys, device=device)

    def rank_at(position: torch.Tensor) -> torch.Tensor:  # members before each query's ``position``: (B, H, N, S)
        return before[:, :, position].gather(-1, selected)

    if causal:  # the most recent members at positions <= t - window
        ranks = (rank_at((t - window + 1).clamp(min=0)) - cluster_keys).unsqueeze(-1) + steps
        valid = ranks >= 0
    else:  # before the window [t - window / 2, t + window / 2) and after it
        half, first_half = window // 2, cluster_keys // 2
        lower = rank_at((t - half).clamp(min=0)).unsqueeze(-1) - first_half + steps[:first_half]
        upper = rank_at((t + window - half).clamp(max=N)).unsqueeze(-1) + steps[: cluster_keys - first_half]
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


KERNELS = ("auto", "gather", "dense-mask")


def selected_cluster_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_ids: torch.Tensor, selected: torch.Tensor, *,
    num_clusters: int, cluster_keys: int, window: int, causal: bool, key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0, kernel: str = "auto",
) -> torch.Tensor:
    """Softmax attention of each query over its window and its selected clusters' keys (module docstring).

    q, k, v: (B, H, N, D); key_ids (B, H, N) in [0, num_clusters] (num_clusters: padding); selected (B, H, N, S)
    distinct cluster ids. ``kernel``: "gather" (the keys each query reads, O(N M D)), "dense-mask" (the same set as
    an (N, N) boolean mask for one SDPA call: O(N^2 D) but matmul-shaped, faster while N is a few times M), or
    "auto" (dense-mask for N <= 16 M: on the CPU it was 7x faster than the gather at N = 4,096, M = 256). Returns
    (B, H, N, D); a query without any key gets 0."""
    B, H, N, D = q.shape
    positions, allowed = selected_positions(key_ids, selected, num_clusters=num_clusters, cluster_keys=cluster_keys,
                                            window=window, causal=causal, key_padding_mask=key_padding_mask)
    M = positions.shape[-1]
    if kernel == "dense-mask" or (kernel == "auto" and N <= 16 * M):  # docs/benchmarks.md, "cluster-select"
        # scatter True at every allowed position; the entries that are not allowed go to an extra column, dropped
        index = torch.where(allowed, positions, N)
        mask = torch.zeros(B, H, N, N + 1, dtype=torch.bool, device=q.device).scatter_(-1, index, True)[..., :N]
        empty = ~mask.any(-1, keepdim=True)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | empty, dropout_p=dropout_p)
        return out.masked_fill(empty, 0.0)
    index = positions.reshape(B, H, N * M, 1).expand(B, H, N * M, D)
    keys = k.gather(2, index).view(B, H, N, M, D)
    values = v.gather(2, index).view(B, H, N, M, D)
    scores = torch.einsum("bhnd,bhnmd->bhnm", q * D ** -0.5, keys).masked_fill(~allowed, float("-inf"))
    empty = ~allowed.any(-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    if dropout_p:
        weights = F.dropout(weights, dropout_p)
    return torch.einsum("bhnm,bhnmd->bhnd", weights, values)
