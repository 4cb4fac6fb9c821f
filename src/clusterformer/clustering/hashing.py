"""Random-projection hashes: angular LSH buckets (Reformer) and sign codes (clustered attention)."""

from __future__ import annotations

import torch

__all__ = ["angular_lsh_buckets", "sign_codes"]


def angular_lsh_buckets(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """Reformer's hash h(x) = argmax([xR; -xR]) per round.

    Args:
        x: (B, H, N, D).
        rotations: (H, R, D, n_buckets / 2) random Gaussian matrices, one per head and round.

    Returns:
        (B, H, R, N) long bucket ids in [0, n_buckets).
    """
    rotated = torch.einsum("bhnd,hrdk->bhrnk", x, rotations.to(x.dtype))
    return torch.cat([rotated, -rotated], dim=-1).argmax(dim=-1)


def sign_codes(x: torch.Tensor, planes: torch.Tensor) -> torch.Tensor:
    """Signs of random projections (clustered attention, section 3.2.2): bit b is x . p_b > 0.

    x: (B, H, N, D); planes: (H, D, bits). Returns (B, H, N, bits) bool."""
    return torch.einsum("bhnd,hdk->bhnk", x, planes.to(x.dtype)) > 0
