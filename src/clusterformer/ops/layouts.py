"""Slot layouts of the window buffer: where each token of a reordered sequence sits, chunk by chunk.

Part of the chunked-attention primitive (:mod:`clusterformer.ops.chunked` is its public face;
:mod:`clusterformer.ops.windows` attends over the buffer these layouts describe).

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

from ..masks import AttentionMask, real_lengths

__all__ = ["ChunkLayout", "cluster_aligned_slots", "cluster_causal_layout", "group_ranks", "sorted_layout"]


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
    mask: AttentionMask | None = None,
) -> ChunkLayout:
    """Layout of :func:`sorted_chunk_attention`: per block, a stable sort of its *real* tokens by id, cut into
    consecutive chunks.

    Args:
        cluster_ids: (blocks, N) integers.
        chunk_size: an int, or a (blocks,) integer tensor (each block's own chunk size, e.g. ceil(L_b / k_b)
            from its real length L_b); clamped to [1, L_b] (a chunk longer than the sequence is the sequence).
        look_back: previous chunks each chunk attends to (wrapping around within the block's real chunks).
        mask: the call's :class:`~clusterformer.masks.AttentionMask` (None: no padding), whose padding (B, N)
            every block b * repeat .. b * repeat + repeat - 1 reads (blocks = B * repeat: one per head, or per
            head and round; :meth:`~clusterformer.masks.AttentionMask.block_padding`). Padding takes no part in
            the sort or the chunks and no place in the buffer (its outputs are unspecified), so the chunks, their
            number and the wrap-around of a block are those of its real tokens alone, whatever the amount of
            padding (batch invariance), and padded batches cost only their real tokens' chunks.

    The buffer's chunks are ``max_b chunk_size_b`` slots wide; a block with a smaller chunk size leaves the
    rest of each chunk empty (masked)."""
    blocks, N = cluster_ids.shape
    device = cluster_ids.device
    padding = None if mask is None else mask.block_padding(mask.repeats(blocks))  # (blocks, N)
    if padding is None and not isinstance(chunk_size, torch.Tensor):
        # Every block has N real tokens and one chunk size: the slots are the sorted positions.
        chunk_size = min(chunk_size, max(N, 1))
        n_c = max(1, math.ceil(N / chunk_size))
        token_slot = _sorted_positions(cluster_ids)  # token -> slot
        return _layout_from_slots(token_slot, n_c * chunk_size, chunk_size, look_back)
    lengths = real_lengths(padding, blocks, N, device)
    key = cluster_ids
    if padding is not None:
        key = cluster_ids.masked_fill(padding, torch.iinfo(torch.long).max)  # padding sorts last
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


def group_ranks(ids: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (blocks, N) in [0, num_groups) -> (each token's rank among the earlier tokens of its group (blocks, N),
    the size of every group (blocks, num_groups)), by one stable sort."""
    sorted_pos = _sorted_positions(ids)
    counts = torch.zeros(ids.shape[0], num_groups, dtype=torch.long, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids))
    return sorted_pos - (counts.cumsum(1) - counts).gather(1, ids), counts


def cluster_aligned_slots(cluster_ids: torch.Tensor, chunk_size: int, num_clusters: int) -> tuple[torch.Tensor, int]:
    """Slots in which every cluster starts on a chunk boundary. cluster_ids (blocks, N) in [0, num_clusters).

    Token i of cluster c goes to slot start[c] + r, r = the number of earlier tokens of c; start[c] is the
    sum over earlier clusters of their sizes rounded up to a multiple of ``chunk_size``. So every chunk
    holds tokens of one cluster only. Returns (token_slot (blocks, N), num_slots) where num_slots is a
    static bound (each non-empty cluster wastes at most chunk_size - 1 slots), a multiple of chunk_size."""
    N = cluster_ids.shape[1]
    w = chunk_size
    rank, counts = group_ranks(cluster_ids, num_clusters)
    padded = (counts + w - 1) // w * w
    token_slot = (padded.cumsum(1) - padded).gather(1, cluster_ids) + rank
    n_c = max(1, math.ceil((N + min(num_clusters, N) * (w - 1)) / w))
    return token_slot, n_c * w
