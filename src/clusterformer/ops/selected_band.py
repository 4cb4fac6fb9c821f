"""The chunk bands of ``"cluster-select"``'s ``"banded"`` kernel (:mod:`clusterformer.ops.selected`), which the
summaries' selection (:func:`clusterformer.ops.selected_ranking.summary_selection`) reads too.

The banded kernel computes the softmax from matmuls over chunks, O(N (window + L + M + C) D) without any (N, N) or
(N, C, D) tensor. Positions are cut into chunks of L <= 128 keys (:func:`band_chunk`); query t in chunk i sees its
whole window inside the *band* of the fewest chunks around i that hold every window of the chunk (causal: i -
ceil((window - 1) / L) .. i), and every other key of the band lies outside the window, in the band's first chunk or
two (and last, non-causal). A summary is then the members in whole chunks beyond the band -- one row of per-chunk
prefix sums of the clusters' keys and values, (B, H, N / L + 1, C, D), summed in position order -- plus the members
in the band outside the window, read from the band's own scores through the band's one-hot clusters on those
columns only, less the members the query reads alone (their scores are computed anyway). One band per layer call
(:func:`chunk_band`) serves the summaries' selection and the attention.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..masks import AttentionMask
from .recompute import recompute_saved

__all__ = ["BAND_CHUNK", "ChunkBand", "band_chunk", "chunk_band", "from_chunks", "to_chunks"]


def to_chunks(x: torch.Tensor, L: int, fill: float | bool = 0) -> torch.Tensor:
    """(B, H, N, X) -> (B, H, ceil(N / L), L, X): positions in chunks of L, the last one padded with ``fill``."""
    N = x.shape[2]
    chunks = -(-N // L)
    return F.pad(x, (0, 0, 0, chunks * L - N), value=fill).view(*x.shape[:2], chunks, L, x.shape[-1])


def from_chunks(x: torch.Tensor, N: int) -> torch.Tensor:
    """(B, H, chunks, L, X) -> (B, H, N, X): the first N positions (:func:`to_chunks` undone)."""
    return x.flatten(2, 3)[:, :, :N]


BAND_CHUNK = 128  # the banded kernel's chunk length, at most (smaller windows: the window's own span)


def band_chunk(window: int, causal: bool) -> int:
    """The chunk length L of the ``"banded"`` kernel: the keys a query's window holds on its past side (causal:
    ``window``; otherwise ``window / 2``), at most :data:`BAND_CHUNK` = 128. A band spans the window plus less than
    one chunk, (window + L) keys per query rather than 2 window, while the per-chunk cluster sums, (N / L, C, D),
    grow as L shrinks. Measured on one CPU thread (one causal layer's forward and backward, 64 clusters, 96 keys
    read alone; docs/scripts/band_kernel_ab.py): with a window of 512 at N = 4,096, chunks of 128 took 0.64x the time of
    chunks of 512 (64: 0.78x, 256: 0.60-0.67x, the machine shared); with a window of 96 at N = 1,024, chunks of 96
    were faster than 48 or 32."""
    return min(window if causal else window // 2, BAND_CHUNK)


class ChunkBand(NamedTuple):
    """The chunk bands of the ``"banded"`` kernel (module docstring; :func:`chunk_band`), with Np = chunks * L >= N
    padded positions and R = (before + 1 + after) L band keys per chunk.

    scores: (B, H, chunks, L, R) q . k / sqrt(D) of each query against its band (q as given: scaled by the caller);
    window: (B, H, chunks, L, R) bool, the band key is in the query's window and real; outside: (L, R) 1 where the
    band key is outside the window and not after the query (causal), else 0, in q's dtype; spans: the (start, stop)
    column ranges of the band that hold any such key (one causal, two otherwise) -- the summaries' products read
    only those; members: (B, H, chunks, R, C) the band keys' one-hot clusters (padding in none); values: (B, H,
    chunks, R, D), or None when no values were given (a selection only scores); beyond_keys, beyond_values: (B, H,
    chunks, C, D) per query chunk, the sums of each cluster's members in the whole chunks outside its band (causal:
    before it; otherwise before and after); summary_dots: (B, H, N, C) q . (sum of each cluster's members outside
    the window). A band built without summaries holds the window's parts alone: members, beyond_keys,
    beyond_values and summary_dots are None."""

    scores: torch.Tensor
    window: torch.Tensor
    outside: torch.Tensor
    spans: tuple[tuple[int, int], ...]
    members: torch.Tensor | None
    values: torch.Tensor | None
    beyond_keys: torch.Tensor | None
    beyond_values: torch.Tensor | None
    summary_dots: torch.Tensor | None
    values_recipe: Callable[[], torch.Tensor] | None = None  # rebuilds ``values`` from v (ops/recompute.py)


def chunk_band(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, key_ids: torch.Tensor,
               mask: AttentionMask, *, num_clusters: int, window: int, summaries: bool) -> ChunkBand:
    """The bands of chunks around every query chunk (:class:`ChunkBand`); q already scaled. Chunks of L =
    :func:`band_chunk` positions; the band of chunk i is chunks i - before .. i + after, the fewest that hold every
    query's window. Built once per layer call, it serves both the summaries' selection and the attention
    (``summaries``: also the summaries' dots, with the gradient when q and k have one). ``mask``: the call's mask,
    its causal order (the window (t - window, t]) and padding (B, N) or None."""
    B, N = key_ids.shape[0], key_ids.shape[2]
    causal = mask.causal
    C = num_clusters
    L = band_chunk(window, causal)
    half = window // 2
    # query t = i L + a reads (t - window, t] (causal) or [t - half, t + window - half): the band must reach
    # window - 1 (or half) positions before a = 0 and window - half - 1 after a = L - 1
    before = -(-(window - 1) // L) if causal else -(-half // L)
    after = 0 if causal else -(-(window - half - 1) // L)
    width = before + 1 + after
    chunks = -(-N // L)

    def band(x: torch.Tensor) -> torch.Tensor:  # (B, H, chunks, L, X) -> (B, H, chunks, R, X)
        shifted = F.pad(x, (0, 0, 0, 0, before, after))
        return torch.cat([shifted[:, :, s:s + chunks] for s in range(width)], dim=3)

    real = mask.real(B, N, q.device)
    band_real = band(to_chunks(real[:, None, :, None], L, False)).squeeze(-1)  # (B, 1, chunks, R)
    keys = to_chunks(k, L)
    band_keys = band(keys)
    # the product's backward needs the band's copy of the keys (width x K): shift them into it again then, from the
    # chunked keys, which the cluster sums below keep anyway and which cost N x K without them (a recipe on k itself
    # would keep the fused QKV output)
    with recompute_saved(band_keys, lambda: band(keys)):
        scores = to_chunks(q, L) @ band_keys.transpose(-1, -2)  # (B, H, chunks, L, R)
    del band_keys

    # key j = (i - before) L + r of the band against query t = i L + a: j - t = r - before L - a, in every chunk
    a = torch.arange(L, device=q.device)[:, None]
    offset = torch.arange(width * L, device=q.device)[None, :] - before * L - a  # (L, R)
    if causal:
        in_window, outside = (offset > -window) & (offset <= 0), offset <= -window
        # offset <= -window somewhere in column r: r <= before L - window + (L - 1)
        spans = ((0, before * L - window + L),)
    else:
        in_window = (offset >= -half) & (offset < window - half)
        outside = ~in_window
        # offset < -half somewhere in column r: r < before L - half + L - 1; offset >= window - half: r >= before
        # L + window - half
        spans = ((0, before * L - half + L - 1), (before * L + window - half, width * L))
    spans = tuple((lo, hi) for lo, hi in spans if hi > lo)

    outside = outside.to(q.dtype)
    values = None if v is None else to_chunks(v, L)
    window_real = in_window & band_real.unsqueeze(-2)
    if not summaries:  # the window alone: no cluster sums, (N / L, C, D) prefix sums and their products
        return ChunkBand(scores, window_real, outside, spans, None, None if values is None else band(values), None,
                         None, None, None if values is None else lambda: band(values))

    members = to_chunks(F.one_hot(key_ids, C + 1)[..., :C].to(q.dtype), L)  # padding (id C): in no cluster

    # per-chunk sums of each cluster's keys and values, summed over chunks: upto[m] = chunks 0 .. m; shifted by
    # slices (an index would scatter in its backward)
    def beyond(x: torch.Tensor) -> torch.Tensor:
        upto = (members.transpose(-1, -2) @ x).cumsum(2)  # (B, H, chunks, C, D)
        sums = F.pad(upto, (0, 0, 0, 0, before + 1, 0))[:, :, :chunks]  # row i: the chunks before i - before
        if not causal:  # and the chunks after i + after: all, less upto[min(i + after, chunks - 1)]
            last = upto[:, :, -1:]
            reach = torch.cat([upto[:, :, after:], last.expand(-1, -1, min(after, chunks), -1, -1)], dim=2)
            sums = sums + (last - reach)
        return sums

    band_members = band(members)
    beyond_keys = beyond(keys)
    # the whole chunks beyond the band by one (L, D) x (D, C) product per chunk, the band's own members outside
    # the window from its scores, over the spans that hold any
    dots = to_chunks(q, L) @ beyond_keys.transpose(-1, -2)
    for lo, hi in spans:
        dots = dots + (scores[..., lo:hi] * outside[:, lo:hi]) @ band_members[..., lo:hi, :]
    dots = from_chunks(dots, N)
    return ChunkBand(scores, window_real, outside, spans, band_members,
                     None if values is None else band(values), beyond_keys,
                     None if values is None else beyond(values), dots,
                     None if values is None else lambda: band(values))  # ``values``: kept by beyond(values)
