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
    """The N x N allowed mask of sorted_chunk_attention, from its definition. ids: (N,) ints. Only the
    sequence's real tokens are sorted and chunked; padding is in no chunk (and its rows are unspecified)."""
    N = ids.shape[0]
    real = [i for i in range(N) if not (pad is not None and bool(pad[i]))]
    order = sorted(real, key=lambda i: (int(ids[i]), i))  # stable sort by cluster id
    chunk = [None] * N
    for sorted_pos, token in enumerate(order):
        chunk[token] = sorted_pos // chunk_size
    n_c = max(1, math.ceil(len(real) / chunk_size))
    allowed = torch.zeros(N, N, dtype=torch.bool)
    for i in real:
        reachable = {(chunk[i] - o) % n_c for o in range(look_back + 1)}
        for j in range(N):
            ok = chunk[j] is not None and chunk[j] in reachable
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


def bucket_round_reference(qk, v, ids, chunk_size, look_back, causal, pad):
    """One round of shared-QK bucket attention from its definition (Reformer): keys are unit qk, a token
    sees itself only when nothing else is allowed. qk, v: (N, D); ids: (N,) with padding already moved to
    the last bucket. Returns (out (N, D), lse (N,)) with lse = -inf for rows with no key."""
    N, D = qk.shape
    if causal:
        allowed = cluster_causal_allowed(ids, chunk_size, look_back, pad)
    else:
        allowed = sorted_chunk_allowed(ids, chunk_size, look_back, False, pad)
    for i in range(N):
        others = allowed[i].clone()
        others[i] = False
        if others.any():
            allowed[i] = others
    keys = qk / qk.norm(dim=-1, keepdim=True)
    scores = (qk @ keys.T / math.sqrt(D)).masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = masked_softmax_attention(qk, keys, v, allowed)
    return out, lse


def bucket_reference(qk, v, buckets, chunk_size, look_back, causal, pad, num_buckets):
    """All rounds merged with softmax-over-rounds of their lse. buckets: (R, N)."""
    if pad is not None:
        buckets = torch.where(pad, torch.full_like(buckets, num_buckets), buckets)
    outs, lses = [], []
    for r in range(buckets.shape[0]):
        o, lse = bucket_round_reference(qk, v, buckets[r], chunk_size, look_back, causal, pad)
        outs.append(o)
        lses.append(lse)
    out = torch.zeros_like(v)
    lses = torch.stack(lses)  # (R, N)
    for i in range(qk.shape[0]):
        if torch.isfinite(lses[:, i]).any():
            weights = torch.softmax(lses[:, i], dim=0)
            out[i] = sum(weights[r] * outs[r][i] for r in range(len(outs)))
    return out


def clustered_matrices(q, k, groups, C, topk, pad=None):
    """Dense A (full), A^c broadcast to queries, and A^t (eqs. 1, 3-4, 9-10) for one head. q, k: (N, D);
    groups: (N,). Returns three (N, N) matrices."""
    q, k = q.detach(), k.detach()
    N, D = q.shape
    key_ok = torch.ones(N, dtype=torch.bool) if pad is None else ~pad
    full = torch.softmax((q @ k.T / math.sqrt(D)).masked_fill(~key_ok, float("-inf")), dim=-1)
    a_c = torch.zeros(C, N, dtype=q.dtype)
    for j in range(C):
        members = [i for i in range(N) if int(groups[i]) == j and bool(key_ok[i])]
        centroid = sum(q[i] for i in members) / len(members) if members else torch.zeros(D, dtype=q.dtype)
        a_c[j] = torch.softmax((centroid @ k.T / math.sqrt(D)).masked_fill(~key_ok, float("-inf")), dim=-1)
    clustered = torch.stack([a_c[int(groups[i])] for i in range(N)])
    improved = clustered.clone()
    if topk is not None:
        t = min(topk, N)
        for i in range(N):
            j = int(groups[i])
            top = [key for key in a_c[j].topk(t).indices.tolist() if bool(key_ok[key])]
            mass = sum(float(a_c[j, key]) for key in top)
            exp = {key: math.exp(float(q[i] @ k[key]) / math.sqrt(D)) for key in top}
            total = sum(exp.values())
            for key in top:
                improved[i, key] = mass * exp[key] / total
    return full, clustered, improved


def sliding_reference(q, k, v, window, stride, causal, pad, positions=None):
    """Overlapping windows from the definition, for one head. q, k, v: (N, D)."""
    N = q.shape[0]
    window = min(window, N)
    # the windows of the sequence's own length: up to its last real row (right padding adds no window)
    length = N if pad is None else max([i + 1 for i in range(N) if not bool(pad[i])], default=0)
    starts = [0]
    while starts[-1] + window < length:
        starts.append(starts[-1] + stride)
    if causal:  # every window that starts before the end (prefix invariance)
        starts = list(range(0, N, stride))
    pos = list(range(N)) if positions is None else [int(p) for p in positions]
    total = torch.zeros_like(v)
    count = [0] * N
    for s in starts:
        rows = [r for r in range(s, min(s + window, N))]
        allowed = torch.zeros(len(rows), len(rows), dtype=torch.bool)
        for a, i in enumerate(rows):
            for b, j in enumerate(rows):
                allowed[a, b] = not (pad is not None and bool(pad[j])) and not (causal and pos[j] > pos[i])
        out = masked_softmax_attention(q[rows], k[rows], v[rows], allowed)
        for a, i in enumerate(rows):
            total[i] += out[a]
            count[i] += 1
    return total / torch.tensor(count, dtype=v.dtype).unsqueeze(-1)


def water_filled(available, total):
    """Water-filling written plainly (cluster_runs' ``split="fill"``): raise a common level one key at a time while
    the runs, each at most what it has, hold no more than ``total`` together; then one more key each to the first
    runs with more, while any of ``total`` is left."""
    level = 0
    while level < max(available, default=0) and sum(min(a, level + 1) for a in available) <= total:
        level += 1
    lengths = [min(a, level) for a in available]
    for r, a in enumerate(available):
        if sum(lengths) < total and a > level:
            lengths[r] += 1
    return lengths


def run_recorded(module, *args, **kwargs):
    """``module(*args, **kwargs)`` inside :func:`collect_aux_losses` and :func:`record_groups` -> (output, the
    auxiliary losses, the groups published by each module)."""
    from clusterformer.attention import collect_aux_losses, record_groups

    with collect_aux_losses() as aux, record_groups() as groups:
        out = module(*args, **kwargs)
    return out, aux, groups


def groups_of(layer, *args, **kwargs):
    """(output, the groups the layer's inner attention published) of ``layer(*args, **kwargs)``."""
    out, _, groups = run_recorded(layer, *args, **kwargs)
    return out, groups.get(layer.inner)
