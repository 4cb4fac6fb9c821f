"""Attention inside equal chunks of a reordered sequence: the shared primitive of clustering attention.

A clustering mechanism decides which *slot* of a reordered sequence each token goes to; chunks are runs of
``chunk_size`` consecutive slots, and each chunk attends to itself and the ``look_back`` chunks before it
(wrapping around). This module is the public face of the primitive; its parts are

* :mod:`clusterformer.ops.layouts` -- where each token sits (:func:`sorted_layout`: stable sort by cluster id,
  Neural Clustering Attention eqs. 5 and 8; :func:`cluster_causal_layout`: strictly causal, each cluster on
  chunk boundaries, a token's slot its rank among *earlier* tokens of its cluster), with padding taking no
  place (batch invariance);
* :mod:`clusterformer.ops.windows` -- attention of each chunk to its key window over the buffer (views, one
  SDPA call, or the fused kernel), with masks from :mod:`clusterformer.masks`' predicates;
* here -- :func:`sorted_chunk_attention` and :func:`cluster_causal_attention` on (B, H, N, D) tensors, with
  input validation.

No Python loop over tokens, chunks or clusters; the only loops run over the L + 1 chunk offsets.
"""

from __future__ import annotations

import torch

from .._checks import check_int, check_tensor
from ..masks import CAUSAL_MASK, AttentionMask, check_mask
from .layouts import ChunkLayout, cluster_causal_layout, sorted_layout
from .windows import windowed_attention

__all__ = ["cluster_causal_attention", "sorted_chunk_attention"]


def _attend_per_head(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: ChunkLayout, *,
    mask: AttentionMask, dropout_p: float, kernel: str,
) -> torch.Tensor:
    """(B, H, N, D) inputs with one block per (batch, head) -> (B, H, N, D)."""
    B, H, N, D = q.shape
    W, w = layout.num_windows, layout.chunk_size

    def rows_of(t: torch.Tensor) -> torch.Tensor:  # (B, H, N, D) -> (R, 1, D)
        return t.reshape(B * H * N, 1, D).index_select(0, layout.rows)

    q_win = layout.query_rows(rows_of(q)).view(W, w, 1, D).transpose(1, 2)
    out = windowed_attention(q_win, rows_of(k), rows_of(v), layout, mask=mask, dropout_p=dropout_p, kernel=kernel)
    return out.view(B, H, N, D)


def _blocks_ids(cluster_ids: torch.Tensor, B: int, H: int, N: int) -> torch.Tensor:
    """(B, N) or (B, H, N) ids -> (B * H, N): one block per (batch, head)."""
    if cluster_ids.dim() == 2:
        cluster_ids = cluster_ids.unsqueeze(1).expand(B, H, N)
    return cluster_ids.reshape(B * H, N)


def sorted_chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cluster_ids: torch.Tensor,
    chunk_size: int | torch.Tensor,
    *,
    look_back: int = 1,
    mask: AttentionMask | None = None,
    dropout_p: float = 0.0,
    kernel: str = "auto",
) -> torch.Tensor:
    """Softmax attention restricted to chunks of the cluster-sorted sequence.

    Semantics (exact; the tests build an N x N dense reference from this text):

    * Per sequence, its real (non-padding) tokens are ordered by a *stable* sort on ``cluster_ids`` (ties
      keep the original order) and that order is cut into consecutive chunks of ``chunk_size`` tokens
      (that sequence's entry when ``chunk_size`` is a tensor); the last chunk may be shorter. Let c(i) be
      token i's chunk and n_c the sequence's number of chunks. Padding is in no chunk.
    * Query i may attend to key j iff c(j) is one of c(i), c(i)-1, ..., c(i)-look_back modulo n_c
      (the first chunk looks back to the sequence's last one), j is not padding, and, when the mask is
      causal, j <= i in original positions. This is a set: a chunk reachable twice (n_c <= look_back) counts once.
    * So a sequence's outputs on its real tokens do not depend on the amount of padding or on the other
      sequences of the batch.
    * Softmax with scale 1/sqrt(D) over the allowed keys. A query with no allowed key outputs zeros
      (never NaN, in outputs or gradients).

    Args:
        q, k, v: (B, H, N, D) floating tensors of one dtype and device.
        cluster_ids: integer tensor (B, N) shared by all heads, or (B, H, N); non-negative.
        chunk_size: tokens per chunk, >= 1: an int, or a (B,) integer tensor with one per sequence (e.g.
            ceil(L_b / k_b) from each sequence's real length L_b).
        look_back: number of previous chunks each chunk also attends to, >= 0.
        mask: the call's :class:`~clusterformer.masks.AttentionMask` (None: none): its padding (B, N), True =
            padding (never attended to), and with ``causal`` no key after the query in the original order.
        dropout_p: attention dropout probability (pass 0 in evaluation).
        kernel: ``"auto"``, ``"fused"`` or ``"sdpa"``; see :func:`windowed_attention`.

    Returns:
        (B, H, N, D) in the original token order. Outputs at padded query positions are unspecified.
    """
    _check_qkv(q, k, v)
    B, H, N, _ = q.shape
    cluster_ids = _check_cluster_ids(cluster_ids, B, H, N, q.device)
    chunk_size = _check_chunk_sizes(chunk_size, B, q.device)
    look_back = check_int("look_back", look_back, minimum=0)
    mask = check_mask(mask, B, N, device=q.device)
    _check_dropout(dropout_p)
    if q.numel() == 0:
        return q * 0  # keeps the autograd graph for empty batches / sequences
    if isinstance(chunk_size, torch.Tensor):
        chunk_size = chunk_size.repeat_interleave(H)  # one block per (batch, head)
    layout = sorted_layout(_blocks_ids(cluster_ids, B, H, N), chunk_size, look_back, mask=mask)
    return _attend_per_head(q, k, v, layout, mask=mask, dropout_p=dropout_p, kernel=kernel)


def cluster_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cluster_ids: torch.Tensor,
    chunk_size: int,
    num_clusters: int,
    *,
    look_back: int = 1,
    mask: AttentionMask | None = None,
    dropout_p: float = 0.0,
    kernel: str = "auto",
) -> torch.Tensor:
    """Strictly causal clustered chunk attention: output t depends on tokens 0..t only.

    Each cluster is chunked on its own: token i of cluster c with r earlier tokens in c (its rank) is in
    block floor(r / chunk_size) of c. Query i attends to key j iff j is in the same cluster, j's block is
    i's block or one of the ``look_back`` blocks before it, j <= i, and j is not padding. Both the rank
    and the set of allowed keys are fixed by tokens up to i, so changing later tokens cannot change them
    (unlike :func:`sorted_chunk_attention` under a causal mask, whose global chunk boundaries move with
    the sizes of *all* clusters).

    Args:
        q, k, v: (B, H, N, D).
        cluster_ids: (B, N) or (B, H, N) ints in [0, num_clusters).
        chunk_size: tokens per block, >= 1.
        num_clusters: upper bound on the ids (sizes the padded layout).
        look_back: previous blocks of the same cluster to attend to.
        mask: the call's causal :class:`~clusterformer.masks.AttentionMask` (its padding (B, N), True marks
            padding), or None (no padding); a mask that is not causal is refused.
        kernel: ``"auto"``, ``"fused"`` or ``"sdpa"``; see :func:`windowed_attention`.

    Returns:
        (B, H, N, D) in the original token order.
    """
    _check_qkv(q, k, v)
    B, H, N, _ = q.shape
    cluster_ids = _check_cluster_ids(cluster_ids, B, H, N, q.device)
    chunk_size = check_int("chunk_size", chunk_size, minimum=1)
    num_clusters = check_int("num_clusters", num_clusters, minimum=1)
    look_back = check_int("look_back", look_back, minimum=0)
    mask = CAUSAL_MASK if mask is None else check_mask(mask, B, N, device=q.device)
    if not mask.causal:
        raise ValueError("mask must be causal: cluster_causal_attention is strictly causal")
    _check_dropout(dropout_p)
    if cluster_ids.numel() and int(cluster_ids.max()) >= num_clusters:
        raise ValueError(f"cluster_ids must be < num_clusters={num_clusters}, got {int(cluster_ids.max())}")
    if q.numel() == 0:
        return q * 0
    layout = cluster_causal_layout(_blocks_ids(cluster_ids, B, H, N), chunk_size, num_clusters, look_back)
    return _attend_per_head(q, k, v, layout, mask=mask, dropout_p=dropout_p, kernel=kernel)


def _check_chunk_sizes(chunk_size: int | torch.Tensor, B: int, device: torch.device) -> int | torch.Tensor:
    """An int >= 1, or a (B,) integer tensor of values >= 1 on ``device``."""
    if not isinstance(chunk_size, torch.Tensor):
        return check_int("chunk_size", chunk_size, minimum=1)
    if chunk_size.is_floating_point() or chunk_size.dtype == torch.bool or tuple(chunk_size.shape) != (B,):
        raise ValueError(f"chunk_size must be an int or a (B,) = ({B},) integer tensor, got {chunk_size.dtype} "
                         f"tensor of shape {tuple(chunk_size.shape)}")
    if chunk_size.device != device:
        raise ValueError(f"chunk_size is on {chunk_size.device} but q is on {device}")
    if chunk_size.numel() and int(chunk_size.min()) < 1:
        raise ValueError(f"chunk_size must be >= 1, got minimum {int(chunk_size.min())}")
    return chunk_size.long()


def _check_dropout(p: float) -> None:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= float(p) < 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {p!r}")


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
