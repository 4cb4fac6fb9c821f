"""Dense float64 references written straight from the definitions, with Python loops on purpose:
they must be obviously right, not fast. Tests compare the batched implementations against them."""

from __future__ import annotations

import math

import torch


def masked_softmax_attention(q, k, v, allowed):
    """q, k, v: (N, D); allowed: (N, N) bool. Rows with no allowed key give zeros."""
    scores = (q @ k.T) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    weights = torch.where(allowed.any(-1, keepdim=True), weights, torch.zeros_like(weights))
    return weights @ v


def sorted_chunk_allowed(ids, chunk_size, look_back, causal, pad):
    """The N x N allowed mask of sorted_chunk_attention, from its definition. ids: (N,) ints."""
    N = ids.shape[0]
    order = sorted(range(N), key=lambda i: (int(ids[i]), i))  # stable sort by cluster id
    chunk = [0] * N
    for sorted_pos, token in enumerate(order):
        chunk[token] = sorted_pos // chunk_size
    n_c = math.ceil(N / chunk_size)
    allowed = torch.zeros(N, N, dtype=torch.bool)
    for i in range(N):
        reachable = {(chunk[i] - o) % n_c for o in range(look_back + 1)}
        for j in range(N):
            ok = chunk[j] in reachable
            ok = ok and not (pad is not None and bool(pad[j]))
            ok = ok and not (causal and j > i)
            allowed[i, j] = ok
    return allowed


def cluster_causal_allowed(ids, chunk_size, look_back, pad):
    """The N x N allowed mask of cluster_causal_attention: same cluster, block distance in
    [0, look_back] where a token's block is (number of earlier tokens of its cluster) // chunk_size,
    j <= i, j not padding."""
    N = ids.shape[0]
    block = []
    for i in range(N):
        rank = sum(1 for j in range(i) if int(ids[j]) == int(ids[i]))
        block.append(rank // chunk_size)
    allowed = torch.zeros(N, N, dtype=torch.bool)
    for i in range(N):
        for j in range(i + 1):
            same = int(ids[i]) == int(ids[j])
            near = 0 <= block[i] - block[j] <= look_back
            allowed[i, j] = same and near and not (pad is not None and bool(pad[j]))
    return allowed


def dense_reference(q, k, v, allowed_fn):
    """Apply a per-(batch, head) allowed mask. q, k, v: (B, H, N, D); allowed_fn(b, h) -> (N, N)."""
    B, H, N, D = q.shape
    out = torch.zeros(B, H, N, D, dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            out[b, h] = masked_softmax_attention(q[b, h], k[b, h], v[b, h], allowed_fn(b, h))
    return out
