"""Attention inside equal chunks of a permuted sequence: the shared primitive of clustering attention.

A clustering mechanism decides *which slot* of a (padded) reordered sequence each token goes to; this
module gathers queries/keys/values into chunks of ``chunk_size`` slots, lets every query chunk attend to
itself and the ``look_back`` previous chunks (wrapping around), masks what must not be seen, and
scatters the result back to the original token order. Everything is batched: one gather, one
``F.scaled_dot_product_attention`` call on 4-D tensors (the layout that keeps the fused CPU kernel),
one gather back. The only Python loop is over the ``look_back + 1`` chunk offsets, a small constant.

Two layouts are built on the same core:

* :func:`sorted_chunk_attention` -- the public primitive used by Neural Clustering Attention (and the
  other sort-then-chunk mechanisms): stable sort by cluster id, consecutive chunks.
* :func:`cluster_causal_attention` -- the strictly causal variant: every cluster starts on a chunk
  boundary and a token's chunk is fixed by its rank among *earlier* tokens of its cluster, so nothing a
  token sees depends on later tokens.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .._checks import check_bool, check_int, check_padding_mask, check_tensor

__all__ = ["cluster_causal_attention", "sorted_chunk_attention"]


def sorted_chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cluster_ids: torch.Tensor,
    chunk_size: int,
    *,
    look_back: int = 1,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Softmax attention restricted to chunks of the cluster-sorted sequence.

    Semantics (exact; the tests build an N x N dense reference from this text):

    * Tokens are ordered by a *stable* sort on ``cluster_ids`` (ties keep the original order) and that
      order is cut into consecutive chunks of ``chunk_size`` tokens; the last chunk may be shorter.
      Let c(i) be token i's chunk and n_c the number of chunks.
    * Query i may attend to key j iff c(j) is one of c(i), c(i)-1, ..., c(i)-look_back modulo n_c
      (the first chunk looks back to the last one), j is not padding, and, when ``causal``, j <= i in
      original positions. This is a set: a chunk reachable twice (n_c <= look_back) counts once.
    * Softmax with scale 1/sqrt(D) over the allowed keys. A query with no allowed key outputs zeros
      (never NaN, in outputs or gradients).

    Args:
        q, k, v: (B, H, N, D) floating tensors of one dtype and device.
        cluster_ids: integer tensor (B, N) shared by all heads, or (B, H, N); non-negative.
        chunk_size: tokens per chunk, >= 1.
        look_back: number of previous chunks each chunk also attends to, >= 0.
        causal: additionally mask keys that come after the query in the original order.
        key_padding_mask: optional bool (B, N), True marks padding (never attended to).
        dropout_p: attention dropout probability (pass 0 in evaluation).

    Returns:
        (B, H, N, D) in the original token order. Outputs at padded query positions are unspecified.
    """
    _check_qkv(q, k, v)
    B, H, N, _ = q.shape
    cluster_ids = _check_cluster_ids(cluster_ids, B, H, N, q.device)
    chunk_size = check_int("chunk_size", chunk_size, minimum=1)
    look_back = check_int("look_back", look_back, minimum=0)
    causal = check_bool("causal", causal)
    key_padding_mask = check_padding_mask(key_padding_mask, B, N, device=q.device)
    if not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return sorted_chunk_attention_unchecked(
        q, k, v, cluster_ids, chunk_size, look_back=look_back, causal=causal,
        key_padding_mask=key_padding_mask, dropout_p=dropout_p,
    )


def sorted_chunk_attention_unchecked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cluster_ids: torch.Tensor,
    chunk_size: int,
    *,
    look_back: int = 1,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """:func:`sorted_chunk_attention` without argument checks (for layers that built the ids themselves;
    skipping the value checks avoids a device sync per call on GPU)."""
    B, H, N, _ = q.shape
    if q.numel() == 0:
        return q * 0  # keeps the autograd graph for empty batches / sequences
    num_chunks = math.ceil(N / chunk_size)
    slots = num_chunks * chunk_size
    ids = cluster_ids.unsqueeze(1) if cluster_ids.dim() == 2 else cluster_ids  # (B, G, N), G in {1, H}
    # Stable sort: slot s of the sorted order holds token `order[..., s]`.
    order = torch.sort(ids, dim=-1, stable=True).indices
    # Inverse permutation: token i sits in slot `token_slot[..., i]`.
    positions = torch.arange(N, device=q.device).expand_as(order)
    token_slot = torch.empty_like(order).scatter_(-1, order, positions)
    if slots > N:  # the last chunk is short: fill it with empty slots (-1)
        order = F.pad(order, (0, slots - N), value=-1)
    return _attend_in_chunks(
        q, k, v, order, token_slot, chunk_size, look_back=look_back, causal=causal,
        key_padding_mask=key_padding_mask, slot_group=None, dropout_p=dropout_p,
    )


def cluster_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cluster_ids: torch.Tensor,
    chunk_size: int,
    num_clusters: int,
    *,
    look_back: int = 1,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Strictly causal clustered chunk attention: output t depends on tokens 0..t only.

    Each cluster is chunked on its own: token i of cluster c with r earlier tokens in c (its rank) is in
    block floor(r / chunk_size) of c. Query i attends to key j iff j is in the same cluster, j's block is
    i's block or one of the ``look_back`` blocks before it, j <= i, and j is not padding. Both the rank
    and the set of allowed keys are fixed by tokens up to i, so changing later tokens cannot change it
    (unlike :func:`sorted_chunk_attention` with ``causal=True``, whose global chunk boundaries move with
    the sizes of *all* clusters).

    Args:
        q, k, v: (B, H, N, D).
        cluster_ids: (B, N) or (B, H, N) ints in [0, num_clusters).
        chunk_size: tokens per block, >= 1.
        num_clusters: upper bound on the ids (sizes the padded layout).
        look_back: previous blocks of the same cluster to attend to.
        key_padding_mask: optional (B, N) bool, True marks padding.

    Returns:
        (B, H, N, D) in the original token order.
    """
    B, H, N, _ = q.shape
    if q.numel() == 0:
        return q * 0
    ids = cluster_ids.unsqueeze(1) if cluster_ids.dim() == 2 else cluster_ids  # (B, G, N)
    G = ids.shape[1]
    order = torch.sort(ids, dim=-1, stable=True).indices
    positions = torch.arange(N, device=q.device).expand_as(order)
    sorted_pos = torch.empty_like(order).scatter_(-1, order, positions)  # token -> sorted position
    counts = torch.zeros(B, G, num_clusters, dtype=torch.long, device=q.device)
    counts.scatter_add_(-1, ids, torch.ones_like(ids))
    start = counts.cumsum(-1) - counts  # first sorted position of each cluster
    rank = sorted_pos - start.gather(-1, ids)  # number of earlier tokens in the same cluster
    # Every cluster begins on a chunk boundary: cluster c starts at slot padded_start[c].
    padded = (counts + chunk_size - 1) // chunk_size * chunk_size
    padded_start = padded.cumsum(-1) - padded
    token_slot = padded_start.gather(-1, ids) + rank  # (B, G, N)
    # Static upper bound on the padded length: each cluster wastes at most chunk_size - 1 slots.
    num_chunks = math.ceil((N + min(num_clusters, N) * (chunk_size - 1)) / chunk_size)
    slots = num_chunks * chunk_size
    slot_token = torch.full((B, G, slots), -1, dtype=torch.long, device=q.device)
    slot_token.scatter_(-1, token_slot, positions)
    slot_group = torch.full((B, G, slots), -1, dtype=torch.long, device=q.device)
    slot_group.scatter_(-1, token_slot, ids)
    return _attend_in_chunks(
        q, k, v, slot_token, token_slot, chunk_size, look_back=look_back, causal=True,
        key_padding_mask=key_padding_mask, slot_group=slot_group, dropout_p=dropout_p,
    )


def _attend_in_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_token: torch.Tensor,
    token_slot: torch.Tensor,
    chunk_size: int,
    *,
    look_back: int,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    slot_group: torch.Tensor | None,
    dropout_p: float,
) -> torch.Tensor:
    """Core: attention between chunks of a slot layout.

    Args:
        q, k, v: (B, H, N, D).
        slot_token: (B, G, S) with G in {1, H}, S a multiple of chunk_size: the token in each slot, or -1
            for an empty slot.
        token_slot: (B, G, N): the slot of each token (inverse of ``slot_token``).
        slot_group: optional (B, G, S): keys are only allowed from slots of the query's group.

    Returns:
        (B, H, N, D).
    """
    B, H, N, D = q.shape
    G, S = slot_token.shape[1], slot_token.shape[2]
    w = chunk_size
    n_c = S // w
    # A chunk reachable twice would count twice in the softmax; the allowed set is a set, so never
    # look further back than the other n_c - 1 chunks.
    hops = min(look_back, n_c - 1) + 1

    empty = slot_token < 0
    gather_index = slot_token.clamp(min=0)
    if key_padding_mask is not None:
        # Zero padded keys/values so that garbage (even NaN) in padding cannot leak through 0 * NaN.
        keep = ~key_padding_mask[:, None, :, None]
        k = k * keep
        v = v * keep

    def to_chunks(t: torch.Tensor) -> torch.Tensor:  # (B, H, N, D) -> (B*H, n_c, w, D)
        idx = gather_index.unsqueeze(-1).expand(B, H, S, D)
        return t.gather(2, idx).reshape(B * H, n_c, w, D)

    def with_look_back(t: torch.Tensor) -> torch.Tensor:  # (..., n_c, w, X) -> (..., n_c, hops*w, X)
        # roll(o) puts chunk c - o (mod n_c) at position c; cat + roll backpropagates far faster than
        # advanced indexing on CPU.
        if hops == 1:
            return t
        return torch.cat([t.roll(o, dims=-3) for o in range(hops)], dim=-2)

    q_c = to_chunks(q)
    k_c = with_look_back(to_chunks(k))
    v_c = with_look_back(to_chunks(v))

    need_mask = causal or key_padding_mask is not None or slot_group is not None or bool(S > N)
    attn_mask = None
    no_key = None
    if need_mask:
        # Per-slot metadata, chunked: (B, G, n_c, w) for queries, (B, G, n_c, hops*w) for keys.
        key_ok = ~empty
        if key_padding_mask is not None:
            pad = key_padding_mask.unsqueeze(1).expand(B, G, N).gather(-1, gather_index)
            key_ok = key_ok & ~pad
        key_ok = with_look_back(key_ok.reshape(B, G, n_c, w, 1)).squeeze(-1)
        allowed = key_ok.unsqueeze(-2)  # (B, G, n_c, 1, hops*w)
        if causal:
            pos_q = gather_index.reshape(B, G, n_c, w, 1)
            pos_k = with_look_back(pos_q).squeeze(-1)
            allowed = allowed & (pos_q >= pos_k.unsqueeze(-2))
        if slot_group is not None:
            grp_q = slot_group.reshape(B, G, n_c, w, 1)
            grp_k = with_look_back(grp_q).squeeze(-1)
            allowed = allowed & (grp_q == grp_k.unsqueeze(-2))
        allowed = allowed.expand(B, G, n_c, w, hops * w)
        # A query with no allowed key: let it see everything (finite softmax), then zero its output,
        # which also zeroes every gradient that flows through that row.
        no_key = ~allowed.any(-1, keepdim=True)
        allowed = allowed | no_key
        attn_mask = allowed.expand(B, H, n_c, w, hops * w).reshape(B * H, n_c, w, hops * w)
        no_key = no_key.expand(B, H, n_c, w, 1).reshape(B * H, n_c, w, 1)

    out = F.scaled_dot_product_attention(q_c, k_c, v_c, attn_mask=attn_mask, dropout_p=dropout_p)
    if no_key is not None:
        out = out.masked_fill(no_key, 0.0)
    out = out.reshape(B, H, S, D)
    back = token_slot.unsqueeze(-1).expand(B, H, N, D)
    return out.gather(2, back)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim=4, floating=True)
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            "q, k and v must all have shape (B, H, N, D); got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device; got {q.device}, {k.device}, {v.device}")


def _check_cluster_ids(ids: torch.Tensor, B: int, H: int, N: int, device: torch.device) -> torch.Tensor:
    check_tensor("cluster_ids", ids, ndim=(2, 3))
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"cluster_ids must be an integer tensor, got dtype {ids.dtype}")
    expected = ((B, N), (B, H, N))
    if tuple(ids.shape) not in expected:
        raise ValueError(
            f"cluster_ids must have shape (B, N) = {(B, N)} or (B, H, N) = {(B, H, N)}, "
            f"got {tuple(ids.shape)}"
        )
    if ids.device != device:
        raise ValueError(f"cluster_ids is on {ids.device} but q is on {device}")
    if ids.numel() and int(ids.min()) < 0:
        raise ValueError(f"cluster_ids must be non-negative, got minimum {int(ids.min())}")
    return ids.long()
