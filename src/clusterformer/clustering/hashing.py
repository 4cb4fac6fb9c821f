"""Random-projection hashes: angular LSH buckets (Reformer) and sign codes (clustered attention)."""

from __future__ import annotations

import torch

__all__ = ["angular_lsh_buckets", "sign_codes"]


def angular_lsh_buckets(
    x: torch.Tensor, rotations: torch.Tensor, num_buckets: torch.Tensor | None = None
) -> torch.Tensor:
    """Reformer's hash h(x) = argmax([xR; -xR]) per round.

    Args:
        x: (B, H, N, D).
        rotations: (H, R, D, n_buckets / 2) random Gaussian matrices, one per head and round.
        num_buckets: optional (B,) even ints <= n_buckets: sequence b hashes with the first
            ``num_buckets[b] / 2`` columns of R only, i.e. into [0, num_buckets[b]) (its own bucket count).

    Returns:
        (B, H, R, N) long bucket ids in [0, n_buckets); with ``num_buckets``, bucket h < n_b / 2 is column h
        of xR and bucket n_b / 2 + h is column h of -xR.
    """
    H, R, D, half = rotations.shape
    B, _, N, _ = x.shape
    flat = rotations.to(x.dtype).permute(0, 2, 1, 3).reshape(1, H, D, R * half)
    rotated = (x @ flat).view(B, H, N, R, half)  # one matmul per head for all rounds
    if num_buckets is not None and bool((num_buckets < 2 * half).any()):  # some sequence uses fewer columns
        own_half = (num_buckets // 2).view(B, 1, 1, 1, 1)
        unused = torch.arange(half, device=x.device) >= own_half  # (B, 1, 1, 1, half)
        top, top_at = rotated.masked_fill(unused, float("-inf")).max(dim=-1)
        low, low_at = rotated.masked_fill(unused, float("inf")).min(dim=-1)
        return torch.where(top >= -low, top_at, low_at + own_half.squeeze(-1)).transpose(2, 3)
    # argmax over [xR; -xR] without building it: the largest of max(xR) and -min(xR).
    top, top_at = rotated.max(dim=-1)
    low, low_at = rotated.min(dim=-1)
    return torch.where(top >= -low, top_at, low_at + half).transpose(2, 3)  # (B, H, R, N)


def sign_codes(x: torch.Tensor, planes: torch.Tensor) -> torch.Tensor:
    """Signs of random projections (clustered attention, section 3.2.2): bit b is x . p_b > 0.

    x: (B, H, N, D); planes: (H, D, bits). Returns (B, H, N, bits) bool."""
    return torch.einsum("bhnd,hdk->bhnk", x, planes.to(x.dtype)) > 0
