"""Attention inside equal chunks of a reordered sequence: the shared primitive of clustering attention.

A clustering mechanism decides which *slot* of a reordered sequence each token goes to; chunks are runs of
``chunk_size`` consecutive slots, and each chunk attends to itself and the ``look_back`` chunks before it
(wrapping around). Two slot layouts exist:

* :func:`sorted_layout` -- stable sort by cluster id (Neural Clustering Attention, eqs. 5 and 8).
* :func:`cluster_causal_layout` -- strictly causal: each cluster starts on a chunk boundary and a token's
  slot within its cluster is its rank among *earlier* tokens of that cluster.

Padding. :func:`sorted_layout` sorts and chunks each sequence's *real* tokens only, with its own chunk size if
asked (a tensor), and the first chunk looks back to the sequence's own last real chunk; padding takes no row
of the buffer. So the chunks a real token sees never depend on the amount of padding or on the other
sequences of a batch (batch invariance; ``docs/ARCHITECTURE.md``), and padding costs nothing.

Window buffer. Each sequence ("block") is written into one flat buffer of rows as
``[last L chunks | chunk 0 | chunk 1 | ... | chunk n_c-1]`` (L = effective look-back), blocks one after
another, plus L chunks of tail. The lead holds the block's own last L real chunks (fewer when it has fewer
chunks, so that no window holds a chunk twice). Then the keys of chunk c of a block -- chunks c-L..c, wrapped -- are the
*contiguous* rows starting L chunks before it, so every key window is a strided view of the buffer
(``unfold``), never a copy; queries are a plain view. One ``index_select`` fills the buffer, one
``F.scaled_dot_product_attention`` call on 4-D tensors attends all windows of all blocks (the fused CPU
kernel needs 4-D), one ``index_select`` returns outputs to token order. The windows that straddle two
blocks are computed and dropped (an overhead of L / n_c). No Python loop over tokens, chunks or clusters;
the only loops run over the L + 1 chunk offsets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .._checks import check_bool, check_choice, check_int, check_padding_mask, check_tensor
from .masks import allow_empty_rows, real_lengths

__all__ = [
    "ChunkLayout",
    "cluster_causal_attention",
    "cluster_causal_layout",
    "sorted_chunk_attention",
    "sorted_layout",
    "use_fused_kernel",
    "windowed_attention",
    "windowed_attention_lse",
]


@dataclass
class ChunkLayout:
    """Where each token of ``blocks`` sequences of length N sits in the window buffer.

    Attributes:
        rows: (R,) long -- flat token index (block * N + position) held by each buffer row; rows holding no
            token point at index 0 and are marked in ``row_valid``.
        row_valid: (R,) bool -- the row holds a token.
        out_rows: (blocks * N,) long -- the buffer row of each token's query, counted from the first
            query row (the row of its output).
        row_group: (R,) long or None -- keys only count when their group equals the query's (strict mode).
        chunk_size: w.
        hops: effective look-back + 1 (number of chunks per key window).
        num_windows: W = blocks * (n_c + hops - 1).
        length: N.
        has_empty_slots: some in-block rows hold no token (the last chunk is short, or clusters are padded).
    """

    rows: torch.Tensor
    row_valid: torch.Tensor
    out_rows: torch.Tensor
    row_group: torch.Tensor | None
    chunk_size: int
    hops: int
    num_windows: int
    length: int
    has_empty_slots: bool

    def query_rows(self, t: torch.Tensor) -> torch.Tensor:
        """The part of a buffer-shaped tensor (R, ...) that holds queries: (W * w, ...)."""
        start = (self.hops - 1) * self.chunk_size
        return t[start : start + self.num_windows * self.chunk_size]


def _layout_from_slots(
    token_slot: torch.Tensor, num_slots: int, chunk_size: int, look_back: int,
    token_group: torch.Tensor | None = None, real_chunks: torch.Tensor | None = None,
) -> ChunkLayout:
    """Build the window buffer from each token's slot. token_slot: (blocks, N), distinct slots in
    [0, num_slots) per block, or ``num_slots`` for a token that takes no slot (padding: it is never a key, and
    its output, read from its block's first row, is unspecified); num_slots a multiple of chunk_size.

    ``real_chunks`` (blocks,): the chunks of each block that hold its tokens (chunks 0..n_b - 1; empty chunks
    follow). The wrap-around of a block's first chunks then reaches *its own* last chunks, not the buffer's
    last chunks. Default: every chunk of the buffer."""
    blocks, N = token_slot.shape
    device = token_slot.device
    w = chunk_size
    n_c = num_slots // w
    per_block_chunks = real_chunks is not None
    if real_chunks is None:
        real_chunks = torch.full((blocks,), n_c, dtype=torch.long, device=device)
        longest = n_c
    else:
        longest = max(1, int(real_chunks.max())) if blocks else 1
    hops = min(look_back, longest - 1) + 1
    lead = (hops - 1) * w  # rows copied from the end of each block to its front
    period = num_slots + lead
    positions = torch.arange(N, device=device).expand(blocks, N)
    slot_token = torch.full((blocks, num_slots + 1), -1, dtype=torch.long, device=device)
    slot_token = slot_token.scatter_(1, token_slot, positions)[:, :num_slots]  # column num_slots: no slot
    # Lead chunk j of a block is read by the windows of its chunks 0..j. With n_b >= hops real chunks it holds
    # chunk n_b - (hops - 1) + j (the wrap-around); a block with fewer chunks (n_b < hops: every chunk sees
    # every other) holds chunk j + 1 there, or nothing, so that each window holds each chunk exactly once.
    j = torch.arange(hops - 1, device=device)
    n_b = real_chunks.unsqueeze(1)
    lead_chunk = torch.where(n_b >= hops, n_b - (hops - 1) + j, torch.where(j + 1 < n_b, j + 1, -1))
    lead_slot = (lead_chunk.clamp(min=0).unsqueeze(-1) * w + torch.arange(w, device=device)).reshape(blocks, lead)
    lead_ok = (lead_chunk >= 0).repeat_interleave(w, dim=1)
    block_rows = torch.cat([slot_token.gather(1, lead_slot).masked_fill(~lead_ok, -1), slot_token], dim=1)
    valid = block_rows >= 0  # (blocks, period)
    offset = (torch.arange(blocks, device=device) * N).unsqueeze(1)
    flat = torch.where(valid, block_rows + offset, torch.zeros_like(block_rows))
    tail = torch.zeros(lead, dtype=torch.long, device=device)
    rows = torch.cat([flat.reshape(-1), tail])
    row_valid = torch.cat([valid.reshape(-1), tail.bool()])
    own_slot = token_slot.masked_fill(token_slot >= num_slots, 0)
    out_rows = (own_slot + (torch.arange(blocks, device=device) * period).unsqueeze(1)).reshape(-1)
    row_group = None
    if token_group is not None:
        slot_group = torch.full((blocks, num_slots + 1), -1, dtype=torch.long, device=device)
        slot_group = slot_group.scatter_(1, token_slot, token_group)[:, :num_slots]
        group_rows = torch.cat([slot_group.gather(1, lead_slot).masked_fill(~lead_ok, -1), slot_group], dim=1)
        row_group = torch.cat([group_rows.reshape(-1), tail - 1])
    return ChunkLayout(
        rows=rows, row_valid=row_valid, out_rows=out_rows, row_group=row_group, chunk_size=w,
        hops=hops, num_windows=blocks * (n_c + hops - 1), length=N,
        # without real_chunks every slot up to N holds a token and every lead chunk is filled
        has_empty_slots=num_slots > N or (per_block_chunks and bool((~valid).any())),
    )


def sorted_layout(
    cluster_ids: torch.Tensor, chunk_size: int | torch.Tensor, look_back: int = 1, *,
    key_padding_mask: torch.Tensor | None = None,
) -> ChunkLayout:
    """Layout of :func:`sorted_chunk_attention`: per block, a stable sort of its *real* tokens by id, cut into
    consecutive chunks.

    Args:
        cluster_ids: (blocks, N) integers.
        chunk_size: an int, or a (blocks,) integer tensor (each block's own chunk size, e.g. ceil(L_b / k_b)
            from its real length L_b); clamped to [1, L_b] (a chunk longer than the sequence is the sequence).
        look_back: previous chunks each chunk attends to (wrapping around within the block's real chunks).
        key_padding_mask: (blocks, N) bool, True = padding. Padding takes no part in the sort or the chunks
            and no place in the buffer (its outputs are unspecified), so the chunks, their number and the
            wrap-around of a block are those of its real tokens alone, whatever the amount of padding (batch
            invariance), and padded batches cost only their real tokens' chunks.

    The buffer's chunks are ``max_b chunk_size_b`` slots wide; a block with a smaller chunk size leaves the
    rest of each chunk empty (masked)."""
    blocks, N = cluster_ids.shape
    device = cluster_ids.device
    if key_padding_mask is None and not isinstance(chunk_size, torch.Tensor):
        # Every block has N real tokens and one chunk size: the slots are the sorted positions.
        chunk_size = min(chunk_size, max(N, 1))
        n_c = max(1, math.ceil(N / chunk_size))
        token_slot = _sorted_positions(cluster_ids)  # token -> slot
        return _layout_from_slots(token_slot, n_c * chunk_size, chunk_size, look_back)
    lengths = real_lengths(key_padding_mask, blocks, N, device)
    key = cluster_ids
    if key_padding_mask is not None:
        key = cluster_ids.masked_fill(key_padding_mask, torch.iinfo(torch.long).max)  # padding sorts last
    sizes = torch.as_tensor(chunk_size, dtype=torch.long, device=device).expand(blocks)
    sizes = torch.minimum(sizes, lengths.clamp(min=1)).clamp(min=1)
    w = int(sizes.max()) if blocks else 1
    n_real = (lengths + sizes - 1) // sizes  # each block's real chunks (0 for a block of padding only)
    sorted_pos = _sorted_positions(key)
    n_c = max(1, int(n_real.max())) if blocks else 1
    size = sizes.unsqueeze(1)
    token_slot = torch.where(
        sorted_pos < lengths.unsqueeze(1),
        torch.div(sorted_pos, size, rounding_mode="floor") * w + sorted_pos % size,  # chunk c, place in chunk
        n_c * w,  # padding takes no slot
    )
    return _layout_from_slots(token_slot, n_c * w, w, look_back, real_chunks=n_real)


def _sorted_positions(key: torch.Tensor) -> torch.Tensor:
    """(blocks, N) -> each token's position in its block's stable sort by ``key`` (ties in token order)."""
    order = torch.sort(key, dim=-1, stable=True).indices  # position -> token
    positions = torch.arange(key.shape[1], device=key.device).expand_as(order)
    return torch.empty_like(order).scatter_(1, order, positions)


def cluster_causal_layout(
    cluster_ids: torch.Tensor, chunk_size: int, num_clusters: int, look_back: int = 1
) -> ChunkLayout:
    """Layout of :func:`cluster_causal_attention`. cluster_ids: (blocks, N) in [0, num_clusters).

    Token i of cluster c with r earlier tokens in c goes to slot start[c] + r, where every cluster starts
    on a chunk boundary; its chunk is therefore fixed by tokens 0..i alone."""
    # no cluster has more than N tokens: the same blocks, a smaller buffer
    chunk_size = min(chunk_size, max(cluster_ids.shape[1], 1))
    token_slot, num_slots = cluster_aligned_slots(cluster_ids, chunk_size, num_clusters)
    return _layout_from_slots(token_slot, num_slots, chunk_size, look_back, token_group=cluster_ids)


def cluster_aligned_slots(cluster_ids: torch.Tensor, chunk_size: int, num_clusters: int) -> tuple[torch.Tensor, int]:
    """Slots in which every cluster starts on a chunk boundary. cluster_ids (blocks, N) in [0, num_clusters).

    Token i of cluster c goes to slot start[c] + r, r = the number of earlier tokens of c; start[c] is the
    sum over earlier clusters of their sizes rounded up to a multiple of ``chunk_size``. So every chunk
    holds tokens of one cluster only. Returns (token_slot (blocks, N), num_slots) where num_slots is a
    static bound (each non-empty cluster wastes at most chunk_size - 1 slots), a multiple of chunk_size."""
    blocks, N = cluster_ids.shape
    device = cluster_ids.device
    w = chunk_size
    sorted_pos = _sorted_positions(cluster_ids)
    counts = torch.zeros(blocks, num_clusters, dtype=torch.long, device=device)
    counts.scatter_add_(1, cluster_ids, torch.ones_like(cluster_ids))
    rank = sorted_pos - (counts.cumsum(1) - counts).gather(1, cluster_ids)  # earlier tokens in cluster
    padded = (counts + w - 1) // w * w
    token_slot = (padded.cumsum(1) - padded).gather(1, cluster_ids) + rank
    n_c = max(1, math.ceil((N + min(num_clusters, N) * (w - 1)) / w))
    return token_slot, n_c * w


class _KeyWindows(torch.autograd.Function):
    """rows (R, H, D) -> windows (W, H, hops * w, D), window i = rows [i w, i w + hops w), as a view.

    ``unfold`` gives the same view, but its generic backward is several times slower on CPU than adding
    the hops shifted gradient slices in place, which is all the backward is."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, w: int, hops: int, num_windows: int) -> torch.Tensor:
        ctx.meta = (rows.shape, w, hops, num_windows)
        span = num_windows * w + (hops - 1) * w
        return rows[:span].unfold(0, hops * w, w).permute(0, 1, 3, 2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, w, hops, W = ctx.meta
        out = grad.new_zeros(shape)
        H, D = shape[1], shape[2]
        for o in range(hops):  # a constant number of chunk offsets, not a loop over chunks
            out[o * w : o * w + W * w].view(W, w, H, D).add_(grad[:, :, o * w : (o + 1) * w].transpose(1, 2))
        return out, None, None, None


def _window_meta(layout: ChunkLayout, per_row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row metadata (R,) -> query part (W, w, 1) and key windows (W, 1, hops * w)."""
    w, W = layout.chunk_size, layout.num_windows
    q_part = layout.query_rows(per_row).view(W, w, 1)
    k_part = per_row[: W * w + (layout.hops - 1) * w].unfold(0, layout.hops * w, w).unsqueeze(1)
    return q_part, k_part


def windowed_attention(
    q: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    layout: ChunkLayout,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    kernel: str = "auto",
) -> torch.Tensor:
    """Attention of every chunk's queries to its key window.

    Args:
        q: (W, H, w, D) queries (any strides with unit last stride), e.g. a view of the query rows.
        k_rows, v_rows: (R, H, D) keys and values for every buffer row.
        layout: the :class:`ChunkLayout` the rows were gathered with.
        causal: mask keys at later original positions.
        key_padding_mask: (blocks, N) bool, True marks padding.
        kernel: ``"auto"`` (the fused Triton kernel where :func:`use_fused_kernel` says so, else SDPA over
            key-window views), ``"fused"`` (require the kernel) or ``"sdpa"``.

    Returns:
        (blocks * N, H, D): each token's output, in flat token order.
    """
    W, H, w, D = q.shape
    if use_fused_kernel(q, dropout_p, kernel):
        return _fused_windowed(q, k_rows, v_rows, layout, causal, key_padding_mask, False, 1.0 / math.sqrt(D))[0]
    k = _KeyWindows.apply(k_rows, w, layout.hops, W)
    v = _KeyWindows.apply(v_rows, w, layout.hops, W)
    attn_mask, no_key = _window_mask(layout, w, causal, key_padding_mask, exclude_self=False)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
    if no_key is not None:
        out = out.masked_fill(no_key, 0.0)
    out = out.transpose(1, 2).reshape(W * w, H, D)
    return out.index_select(0, layout.out_rows)


KERNELS = ("auto", "fused", "sdpa")


def use_fused_kernel(q: torch.Tensor, dropout_p: float, kernel: str = "auto") -> bool:
    """Whether windowed attention runs the fused Triton kernel (:mod:`clusterformer.ops.fused_chunked`).

    ``"auto"``: on CUDA tensors of float16/bfloat16/float32 when Triton is installed and there is no
    attention dropout (the kernel does not fuse dropout). ``"fused"``: always, or a ``ValueError`` saying
    why not; on CPU this needs Triton's interpreter (``TRITON_INTERPRET=1``, for tests). ``"sdpa"``: never.
    """
    check_choice("kernel", kernel, KERNELS)
    if kernel == "sdpa":
        return False
    from .fused_chunked import fused_available

    available = fused_available(q)
    if kernel == "auto":  # the interpreter is for tests: "auto" never sends CPU tensors to it
        return available and q.is_cuda and not dropout_p
    if not available:
        raise ValueError(
            "kernel='fused' needs Triton and a CUDA tensor of float16/bfloat16/float32 (or TRITON_INTERPRET=1 "
            f"on CPU); got a {q.dtype} tensor on {q.device}"
        )
    if dropout_p:
        raise ValueError(f"kernel='fused' does not support attention dropout; got dropout_p={dropout_p}")
    return True


def _fused_windowed(
    q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, layout: ChunkLayout, causal: bool,
    key_padding_mask: torch.Tensor | None, exclude_self: bool, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Windowed attention by the fused kernel: (out (blocks * N, H, D), lse (blocks * N, H)) in token order."""
    from .fused_chunked import fused_chunk_attention

    W, H, w, D = q.shape
    key_ok, positions = _row_meta(layout, causal, key_padding_mask)
    out, lse = fused_chunk_attention(
        q.transpose(1, 2).reshape(W * w, H, D), k_rows, v_rows, key_ok, w, layout.hops,
        positions=positions, groups=layout.row_group, exclude_self=exclude_self, scale=scale,
    )
    return out.index_select(0, layout.out_rows), lse.index_select(0, layout.out_rows)


def _row_meta(
    layout: ChunkLayout, causal: bool, key_padding_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per buffer row: may it be attended to (holds a token, not padding), and its position when causal."""
    key_ok = layout.row_valid
    if key_padding_mask is not None:
        key_ok = key_ok & ~key_padding_mask.reshape(-1)[layout.rows]
    positions = layout.rows % max(layout.length, 1) if causal else None
    return key_ok, positions


def _needs_mask(layout: ChunkLayout, causal: bool, key_padding_mask: torch.Tensor | None) -> bool:
    """Whether any key of any window can be disallowed (besides a shared-QK query's own key)."""
    return bool(causal or key_padding_mask is not None or layout.row_group is not None or layout.has_empty_slots)


def _window_mask(
    layout: ChunkLayout, w: int, causal: bool, key_padding_mask: torch.Tensor | None, exclude_self: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The SDPA mask of every window, (W, 1, w, hops w) bool (True = attend), and the queries with no
    allowed key, (W, 1, w, 1); (None, None) when every key of every window is allowed.

    A query with no allowed key follows the package's one rule (:func:`clusterformer.ops.masks.allow_empty_rows`):
    allowed everything, reported in ``no_key``, zeroed by the caller. Never NaN.
    With ``exclude_self`` a query may attend to its own token only when it has no other allowed key
    (Reformer's shared-QK rule, where q.k_self would dominate)."""
    if not _needs_mask(layout, causal, key_padding_mask):
        return None, None
    W = layout.num_windows
    key_ok, positions = _row_meta(layout, causal, key_padding_mask)
    _, allowed = _window_meta(layout, key_ok)  # (W, 1, hops w)
    if causal:
        pos_q, pos_k = _window_meta(layout, positions)
        allowed = allowed & (pos_q >= pos_k)
    if layout.row_group is not None:
        grp_q, grp_k = _window_meta(layout, layout.row_group)
        allowed = allowed & (grp_q == grp_k)
    allowed = allowed.expand(W, w, layout.hops * w)
    if exclude_self:
        tok_q, tok_k = _window_meta(layout, torch.where(layout.row_valid, layout.rows, -1))
        others = allowed & (tok_q != tok_k)
        allowed = torch.where(others.any(-1, keepdim=True), others, allowed)
    return allow_empty_rows(allowed.unsqueeze(1))


def windowed_attention_lse(
    q: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    layout: ChunkLayout,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    exclude_self: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    kernel: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`windowed_attention` with explicit scores, also returning each query's log-sum-exp.

    Used where rounds of attention are merged (Reformer: ``o = sum_r softmax_r(lse_r) o_r``) and for the
    shared-QK rule ``exclude_self``. Memory O(N hops w) per head for the scores.

    ``scale``: None applies 1/sqrt(D) to the scores; pass the scale you already folded into ``q`` (it is then
    not applied again; only documentation of what the caller did). ``kernel``: as in
    :func:`windowed_attention`.

    Returns:
        out (blocks * N, H, D) and lse (blocks * N, H); lse is -inf for a query with no allowed key
        (its output is zero).
    """
    W, H, w, D = q.shape
    if use_fused_kernel(q, dropout_p, kernel):
        out, lse = _fused_windowed(q, k_rows, v_rows, layout, causal, key_padding_mask, exclude_self,
                                   1.0 / math.sqrt(D) if scale is None else 1.0)
        return out, lse.to(q.dtype)
    k = _KeyWindows.apply(k_rows, w, layout.hops, W)
    v = _KeyWindows.apply(v_rows, w, layout.hops, W)
    scores = q @ k.transpose(-1, -2)  # (W, H, w, hops w)
    if scale is None:
        scores = scores * (1.0 / math.sqrt(D))
    if exclude_self and not _needs_mask(layout, causal, key_padding_mask) and layout.hops * w > 1:
        # Every slot holds a token and each chunk appears once per window, so a query's own key sits at
        # column (hops - 1) w + i of its row i: mask that diagonal in place (autograd-tracked; the product's
        # backward does not need its output) instead of building a (W, w, hops w) mask.
        scores.diagonal(offset=(layout.hops - 1) * w, dim1=-2, dim2=-1).fill_(float("-inf"))
        attn_mask = no_key = None
    else:
        attn_mask, no_key = _window_mask(layout, w, causal, key_padding_mask, exclude_self)
    weights, lse = _SoftmaxLSE.apply(scores, attn_mask)
    if dropout_p:
        weights = F.dropout(weights, p=dropout_p)
    out = weights @ v
    if no_key is not None:
        out = out.masked_fill(no_key, 0.0)
        lse = lse.masked_fill(no_key, float("-inf"))
    out = out.transpose(1, 2).reshape(W * w, H, D).index_select(0, layout.out_rows)
    lse = lse.squeeze(-1).transpose(1, 2).reshape(W * w, H).index_select(0, layout.out_rows)
    return out, lse


class _SoftmaxLSE(torch.autograd.Function):
    """(scores, mask) -> (softmax over allowed keys, log-sum-exp), keeping only the softmax for the backward.

    d scores = p * (g_p - sum(g_p p) + g_lse): the softmax backward plus the log-sum-exp's (whose gradient is
    p itself); masked scores get p = 0 and hence zero gradient.
    Every row must have an allowed key (callers allow all keys in rows without one and zero them after).
    Saves memory and passes over the (W, H, w, hops w) scores compared with ``masked_fill`` + ``softmax`` +
    ``logsumexp``."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, mask: torch.Tensor | None):
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        # lse = s_j - log p_j for any allowed j; j = the argmax keeps p_j >= 1 / n, so the log is safe. Two
        # reductions instead of a second exp pass over the scores.
        lse = scores.amax(dim=-1, keepdim=True) - torch.log(p.amax(dim=-1, keepdim=True))
        ctx.save_for_backward(p)
        return p, lse

    @staticmethod
    def backward(ctx, g_p: torch.Tensor | None, g_lse: torch.Tensor | None):
        (p,) = ctx.saved_tensors
        grad = torch.zeros_like(p) if g_p is None else torch._softmax_backward_data(g_p, p, -1, p.dtype)
        if g_lse is not None:
            grad = grad.addcmul_(p, g_lse)  # d lse / d s = p
        return grad, None


def _attend_per_head(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: ChunkLayout, *,
    causal: bool, key_padding_mask: torch.Tensor | None, dropout_p: float, kernel: str,
) -> torch.Tensor:
    """(B, H, N, D) inputs with one block per (batch, head) -> (B, H, N, D)."""
    B, H, N, D = q.shape
    W, w = layout.num_windows, layout.chunk_size

    def rows_of(t: torch.Tensor) -> torch.Tensor:  # (B, H, N, D) -> (R, 1, D)
        return t.reshape(B * H * N, 1, D).index_select(0, layout.rows)

    q_win = layout.query_rows(rows_of(q)).view(W, w, 1, D).transpose(1, 2)
    pad = None
    if key_padding_mask is not None:
        pad = key_padding_mask.unsqueeze(1).expand(B, H, N).reshape(B * H, N)
    out = windowed_attention(q_win, rows_of(k), rows_of(v), layout, causal=causal,
                             key_padding_mask=pad, dropout_p=dropout_p, kernel=kernel)
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
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
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
      (the first chunk looks back to the sequence's last one), j is not padding, and, when ``causal``,
      j <= i in original positions. This is a set: a chunk reachable twice (n_c <= look_back) counts once.
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
        causal: additionally mask keys that come after the query in the original order.
        key_padding_mask: optional bool (B, N), True marks padding (never attended to).
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
    causal = check_bool("causal", causal)
    key_padding_mask = check_padding_mask(key_padding_mask, B, N, device=q.device)
    _check_dropout(dropout_p)
    if q.numel() == 0:
        return q * 0  # keeps the autograd graph for empty batches / sequences
    pad = None if key_padding_mask is None else key_padding_mask.repeat_interleave(H, dim=0)
    if isinstance(chunk_size, torch.Tensor):
        chunk_size = chunk_size.repeat_interleave(H)  # one block per (batch, head)
    layout = sorted_layout(_blocks_ids(cluster_ids, B, H, N), chunk_size, look_back, key_padding_mask=pad)
    return _attend_per_head(q, k, v, layout, causal=causal, key_padding_mask=key_padding_mask,
                            dropout_p=dropout_p, kernel=kernel)


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
    kernel: str = "auto",
) -> torch.Tensor:
    """Strictly causal clustered chunk attention: output t depends on tokens 0..t only.

    Each cluster is chunked on its own: token i of cluster c with r earlier tokens in c (its rank) is in
    block floor(r / chunk_size) of c. Query i attends to key j iff j is in the same cluster, j's block is
    i's block or one of the ``look_back`` blocks before it, j <= i, and j is not padding. Both the rank
    and the set of allowed keys are fixed by tokens up to i, so changing later tokens cannot change them
    (unlike :func:`sorted_chunk_attention` with ``causal=True``, whose global chunk boundaries move with
    the sizes of *all* clusters).

    Args:
        q, k, v: (B, H, N, D).
        cluster_ids: (B, N) or (B, H, N) ints in [0, num_clusters).
        chunk_size: tokens per block, >= 1.
        num_clusters: upper bound on the ids (sizes the padded layout).
        look_back: previous blocks of the same cluster to attend to.
        key_padding_mask: optional (B, N) bool, True marks padding.
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
    key_padding_mask = check_padding_mask(key_padding_mask, B, N, device=q.device)
    _check_dropout(dropout_p)
    if cluster_ids.numel() and int(cluster_ids.max()) >= num_clusters:
        raise ValueError(f"cluster_ids must be < num_clusters={num_clusters}, got {int(cluster_ids.max())}")
    if q.numel() == 0:
        return q * 0
    layout = cluster_causal_layout(_blocks_ids(cluster_ids, B, H, N), chunk_size, num_clusters, look_back)
    return _attend_per_head(q, k, v, layout, causal=True, key_padding_mask=key_padding_mask,
                            dropout_p=dropout_p, kernel=kernel)


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
