"""Clustered and improved-clustered attention (Vyas, Katharopoulos & Fleuret 2020, sections 3.2-3.3).

Given a partition of the queries into C clusters (per batch element and head):

* clustered (eqs. 3-6): centroid queries Q^c_j = mean of the cluster's queries; A^c = softmax(Q^c K^T /
  sqrt(D)) (C x N); V^c = A^c V; every query outputs its cluster's V^c row.
* improved (eqs. 9-11): T_j = the ``topk`` keys with the largest A^c_j; m_j = sum of A^c_j over T_j.
  Query i of cluster j: A^t_il = m_j softmax over l in T_j of (q_i . k_l / sqrt(D)) for l in T_j, and
  A^c_jl elsewhere; output A^t_i V = m_j softmax(q_i K_T^T) V_T + (V^c_j - A^c_{j,T} V_T).

For long sequences the exact top-k products are computed chunk by chunk: queries are laid out so that every
chunk holds one cluster (:func:`clusterformer.ops.layouts.cluster_aligned_slots`), so each chunk multiplies
its queries by its cluster's k keys in one batched matmul -- O(N k D) time and memory, no (N, k, D) gather. Short
sequences (N <= DENSE_TOPK_FACTOR * k) use one dense attention with a (N, N) mask of each query's T_j.
"""

from __future__ import annotations

import math

import torch

from ..masks import NO_MASK, AttentionMask, allow_empty_rows, masked_sdpa
from .layouts import cluster_aligned_slots

__all__ = ["DENSE_TOPK_FACTOR", "clustered_attention"]

# The exact top-k part runs as one masked dense attention when N <= DENSE_TOPK_FACTOR * topk: short sequences
# are cheaper as one N x N product than as chunked copies (the measurement behind the factor is in
# docs/speed-and-memory.md#improved-clustered-dense-or-chunked-top-k).
DENSE_TOPK_FACTOR = 8


def clustered_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    groups: torch.Tensor,
    num_clusters: int,
    *,
    topk: int | None = None,
    mask: AttentionMask | None = None,
) -> torch.Tensor:
    """Args:
        q, k, v: (B, H, N, D).
        groups: (B, H, N) long cluster of every query, in [0, num_clusters).
        num_clusters: C.
        topk: None for clustered attention; an int >= 1 for improved clustered (clamped to N).
        mask: the call's :class:`~clusterformer.masks.AttentionMask` (None: none): its padding (B, N), True =
            padding, is never a key and not part of any centroid; a causal or windowed mask is refused (a
            centroid query mixes every position).

    Returns:
        (B, H, N, D). A query whose cluster has no real member gets its own (padding) cluster's zero
        centroid; outputs at padded positions are unspecified.
    """
    B, H, N, D = q.shape
    C = num_clusters
    scale = 1.0 / math.sqrt(D)
    mask = NO_MASK if mask is None else mask
    if mask.causal or mask.window is not None:
        raise ValueError("mask must be key padding only: a cluster's centroid query mixes every position")
    members = torch.nn.functional.one_hot(groups, C).to(q.dtype)  # (B, H, N, C)
    key_ok = None
    if mask.padding is not None:
        key_ok = mask.allowed(1, N, q.device)  # (B, 1, 1, N)
        members = members * key_ok.transpose(-1, -2).to(q.dtype)
    counts = members.sum(-2)  # (B, H, C)
    q_centroids = (members.transpose(-1, -2) @ q) / counts.clamp(min=1).unsqueeze(-1)  # eq. 3
    scores = (q_centroids @ k.transpose(-1, -2)) * scale  # (B, H, C, N)
    no_key = None
    if key_ok is not None:  # every key padded: no attention at all (the library's rule for a query without keys)
        allowed, no_key = allow_empty_rows(key_ok)
        scores = scores.masked_fill(~allowed, float("-inf"))
    a_c = torch.softmax(scores, dim=-1)  # eq. 4
    if no_key is not None:
        a_c = a_c.masked_fill(no_key, 0.0)
    v_c = a_c @ v  # eq. 5, (B, H, C, D)
    if topk is None:
        return _per_query(v_c, groups)  # eq. 6

    t = min(topk, N)
    top_w, top_i = a_c.topk(t, dim=-1)  # (B, H, C, t)
    mass = top_w.sum(-1)  # eq. 9, m_j
    v_top = _rows(v, top_i)  # (B, H, C, t, D)
    residual = v_c - (top_w.unsqueeze(-2) @ v_top).squeeze(-2)  # clustered attention on keys outside T_j
    if DENSE_TOPK_FACTOR * t >= N:  # short sequence: one masked dense attention is cheaper than the copies
        exact = _top_key_attention_dense(q, k, v, top_i, key_ok, groups, scale)
    else:
        top_ok = None
        if key_ok is not None:
            top_ok = key_ok[:, 0, 0].gather(1, top_i.reshape(B, H * C * t)).view(B, H, C, t)
        exact = _top_key_attention(q, k, v, top_i, top_ok, groups, scale)  # softmax over T_j, (B, H, N, D)
    return _per_query(mass.unsqueeze(-1), groups) * exact + _per_query(residual, groups)  # eq. 10-11


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (B, H, N, E), index (B, H, *S) long in [0, N) -> (B, H, *S, E): x[b, h, index[b, h, ...]].

    One ``index_select`` on the flattened rows: on CPU it is an order of magnitude faster than ``gather``
    with an index expanded over E."""
    B, H, N, E = x.shape
    offset = (torch.arange(B * H, device=x.device) * N).view(B, H, *([1] * (index.dim() - 2)))
    return x.reshape(B * H * N, E).index_select(0, (index + offset).reshape(-1)).view(*index.shape, E)


def _per_query(per_cluster: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """(B, H, C, E) -> (B, H, N, E): each query's cluster row."""
    return _rows(per_cluster, groups)


def _top_key_attention_dense(q, k, v, top_i, key_ok, groups, scale):
    """What :func:`_top_key_attention` computes, as one masked dense attention: query i of cluster j may
    attend to key l iff l is in T_j (and ``key_ok``, the mask's allowed keys (B, 1, 1, N), or None). O(N^2 D),
    no copies of keys -- cheaper when N is within a small factor of topk (short sequences)."""
    N = q.shape[2]
    allowed = torch.zeros((*top_i.shape[:-1], N), dtype=torch.bool, device=q.device)
    allowed.scatter_(-1, top_i, True)  # (B, H, C, N): T_j
    if key_ok is not None:
        allowed &= key_ok
    mask = _rows(allowed, groups)  # (B, H, N, N): each query's cluster row
    return masked_sdpa(q, k, v, mask, scale=scale)  # no allowed key (all padding): zeros


def _top_key_attention(q, k, v, top_i, top_ok, groups, scale):
    """softmax(q_i K_{T_j}^T * scale) V_{T_j} for every query i of cluster j, one cluster per chunk.
    q, k, v (B, H, N, D); top_i (B, H, C, t) the keys T_j; top_ok (B, H, C, t) bool or None."""
    B, H, N, D = q.shape
    C, t = top_i.shape[2], top_i.shape[3]
    blocks = B * H
    w = max(1, min(64, N // C))
    token_slot, num_slots = cluster_aligned_slots(groups.reshape(blocks, N), w, C)
    n_chunks = num_slots // w
    flat_slot = (token_slot + torch.arange(blocks, device=q.device).unsqueeze(1) * num_slots).reshape(-1)
    q_slots = q.new_zeros(blocks * num_slots, D).index_copy(0, flat_slot, q.reshape(blocks * N, D))
    # The cluster of every chunk (-1 for chunks with no token); chunks are cluster-pure by construction.
    slot_cluster = torch.full((blocks * num_slots,), -1, dtype=torch.long, device=q.device)
    slot_cluster.index_copy_(0, flat_slot, groups.reshape(-1))
    chunk_cluster = slot_cluster.view(blocks, n_chunks, w).amax(-1).clamp(min=0)  # (blocks, n_chunks)
    # The keys of every chunk's cluster, gathered straight from K and V: (B, H, n_chunks, t, D).
    chunk_cluster = chunk_cluster.view(B, H, n_chunks)
    chunk_keys = _rows(top_i, chunk_cluster)  # (B, H, n_chunks, t)
    k_chunks = _rows(k, chunk_keys).view(blocks, n_chunks, t, D)
    v_chunks = _rows(v, chunk_keys).view(blocks, n_chunks, t, D)
    scores = (q_slots.view(blocks, n_chunks, w, D) @ k_chunks.transpose(-1, -2)) * scale  # (blocks, n_ch, w, t)
    no_key = None
    if top_ok is not None:
        ok, no_key = allow_empty_rows(_rows(top_ok, chunk_cluster).view(blocks, n_chunks, 1, t))
        scores = scores.masked_fill(~ok, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    if no_key is not None:
        weights = weights.masked_fill(no_key, 0.0)
    out = (weights @ v_chunks).reshape(blocks * num_slots, D)
    return out.index_select(0, flat_slot).view(B, H, N, D)
