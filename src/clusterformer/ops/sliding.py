"""Overlapping sliding windows (Cluster-Former section 3.1): windows of ``window`` rows every ``stride``
rows, full attention inside each window, outputs of rows covered by several windows averaged.

Also the attention of the Cluster-Former layer (section 3.2), which runs the same windows over the
cluster-sorted sequence: ``positions`` carries each row's original position, where the mask (of the original
order) reads its padding and causal order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..masks import NO_MASK, AttentionMask, masked_sdpa

__all__ = ["sliding_window_attention", "window_count"]


def window_count(length: int | torch.Tensor, window: int, stride: int) -> int | torch.Tensor:
    """Windows needed to cover ``length`` rows (an int, or a tensor of lengths): 1 if length <= window, else
    ceil((length - window) / stride) + 1."""
    over = (length - window).clamp(min=0) if isinstance(length, torch.Tensor) else max(length - window, 0)
    return (over + stride - 1) // stride + 1


def sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    stride: int,
    *,
    positions: torch.Tensor | None = None,
    mask: AttentionMask | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Args:
        q, k, v: (B, H, N, D).
        window, stride: window size l and stride m (m <= l); window i covers rows [i m, i m + l).
        positions: (B, N) long original position of every row (default: the row index), a permutation of each
            sequence's positions: row r holds token positions[b, r] of the mask's sequence b.
        mask: the call's :class:`~clusterformer.masks.AttentionMask` (None: none) over the original positions:
            its padding (B, N), True = padding (never a key), and with ``causal`` no key whose position is after
            the query's.
        dropout_p: attention dropout.

    Returns:
        (B, H, N, D): row r's output is the mean of its outputs in the windows that contain it. Rows with
        no allowed key in a window contribute zeros from that window.

    Windows are those of each sequence's own length, not of the padded batch: with padding, a
    sequence whose last real row is row L - 1 uses windows 0 .. window_count(L) - 1 only, so right padding
    (its amount, and so the other sequences of the batch) cannot add windows to a real row's average.

    Under a causal mask every window that *starts* before the end of the sequence is used (starts 0, stride,
    2 stride, ... < L), not only those needed to cover it: the windows holding row t are then fixed by t
    alone, so rows 0..t give the same outputs whether the sequence ends at t or continues (prefix invariance).
    (Windows starting at or after a sequence's end hold none of its rows, so padding adds none either.)
    """
    B, H, N, D = q.shape
    mask = NO_MASK if mask is None else mask
    causal = mask.causal
    window = min(window, N)  # a window's rows past the end are padding: the clamp changes no window's content
    n_w = window_count(N, window, stride)
    if causal:  # every window starting before N
        n_w = max(n_w, (N + stride - 1) // stride)
    L = (n_w - 1) * stride + window  # padded length, >= N
    idx = (torch.arange(n_w, device=q.device).unsqueeze(1) * stride + torch.arange(window, device=q.device)).reshape(-1)

    def windows(t: torch.Tensor) -> torch.Tensor:  # (B, H, N, D) -> (B n_w, H, window, D)
        t = F.pad(t, (0, 0, 0, L - N))
        t = t.index_select(2, idx).view(B, H, n_w, window, D)
        return t.transpose(1, 2).reshape(B * n_w, H, window, D)

    if not causal and mask.padding is None and L == N:  # nothing to mask: the unmasked fused kernel
        out = F.scaled_dot_product_attention(windows(q), windows(k), windows(v), dropout_p=dropout_p)
        return _average(out, idx, B, H, n_w, window, L, N)
    # The mask's row tables over the padded rows, flat b * L + row: row r < N holds token positions[b, r] (flat
    # b * N + position), the rows added to fill the last window hold none (no key; position 0). Its predicate is
    # read at every window's (query row, key row) pairs.
    pos = torch.arange(N, device=q.device).expand(B, N) if positions is None else positions
    tokens = F.pad(pos + torch.arange(B, device=q.device).unsqueeze(1) * N, (0, L - N))  # (B, L)
    tokens[:, N:] = (torch.arange(B, device=q.device) * N).unsqueeze(1)
    real, row_pos = mask.rows(tokens.reshape(-1), N, (torch.arange(L, device=q.device) < N).expand(B, L).reshape(-1))
    rows = (torch.arange(B, device=q.device).unsqueeze(1) * L + idx).view(B * n_w, window)
    allowed = mask.predicate(real, row_pos)(rows.unsqueeze(-1), rows.unsqueeze(-2))
    # (B n_w, H, window, D); a row with no allowed key in a window contributes zeros from it
    out = masked_sdpa(windows(q), windows(k), windows(v), allowed.unsqueeze(1), dropout_p=dropout_p)
    window_used = None
    if mask.padding is not None and not causal:  # each sequence keeps the windows of its own length
        real_rows = real.view(B, L)[:, :N]
        length = torch.where(real_rows, torch.arange(1, N + 1, device=q.device), 0).amax(1)  # last real row + 1
        own = window_count(length, window, stride)
        window_used = torch.arange(n_w, device=q.device) < own.unsqueeze(1)  # (B, n_w)
    return _average(out, idx, B, H, n_w, window, L, N, window_used)


def _average(out: torch.Tensor, idx: torch.Tensor, B: int, H: int, n_w: int, window: int, L: int, N: int,
             window_used: torch.Tensor | None = None):
    """Window outputs (B n_w, H, window, D) -> per-row means over the windows covering each row, (B, H, N, D);
    ``window_used`` (B, n_w) bool leaves windows out of a sequence's means."""
    D = out.shape[-1]
    out = out.view(B, n_w, H, window, D).transpose(1, 2).reshape(B, H, n_w * window, D)
    if window_used is None:
        total = out.new_zeros(B, H, L, D).index_add(2, idx, out)
        ones = torch.ones_like(idx, dtype=out.dtype)
        covered = torch.zeros(L, device=out.device, dtype=out.dtype).index_add(0, idx, ones)
        return (total / covered.view(1, 1, L, 1))[:, :, :N]
    weight = window_used.to(out.dtype).repeat_interleave(window, dim=1)  # (B, n_w window)
    total = out.new_zeros(B, H, L, D).index_add(2, idx, out * weight[:, None, :, None])
    covered = out.new_zeros(B, L).index_add(1, idx, weight)
    return (total / covered.clamp(min=1).view(B, 1, L, 1))[:, :, :N]
