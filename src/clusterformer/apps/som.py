"""Self-organising map (Kohonen), batch algorithm: the soft-clustering baseline of the ClusterFormer paper's
appendix A (Table 6).

Units sit on a ``rows x cols`` grid (``rows * cols = k``). One epoch of the batch SOM:

1. best-matching unit b(j) = argmin_i ||x_j - w_i|| for every point;
2. neighbourhood h_ij = exp(-||g_i - g_b(j)||^2 / (2 sigma^2)) on grid coordinates g;
3. w_i = sum_j h_ij x_j / sum_j h_ij (a unit no point reaches keeps its weights).

sigma decays geometrically from ``sigma_start`` (default: half the larger grid side) to ``sigma_end`` over
the epochs; the last epochs with a small sigma make it k-means-like. Units start at ``k`` distinct data
points drawn with ``seed``. Clusters are the best-matching units.
"""

from __future__ import annotations

import math

import torch

from .._checks import check_float, check_int, check_tensor

__all__ = ["SOM", "grid_shape", "som_step"]


def grid_shape(k: int) -> tuple[int, int]:
    """The most square ``rows x cols = k`` grid (rows <= cols)."""
    check_int("k", k, minimum=1)
    rows = max(r for r in range(1, math.isqrt(k) + 1) if k % r == 0)
    return rows, k // rows


def som_step(x: torch.Tensor, weights: torch.Tensor, grid: torch.Tensor, sigma: float) -> torch.Tensor:
    """One batch-SOM epoch (steps 1-3 above). x (n, d), weights (k, d), grid (k, 2) -> new weights (k, d)."""
    bmu = torch.cdist(x, weights).argmin(-1)  # (n,)
    grid_d2 = torch.cdist(grid, grid).pow(2)  # (k, k)
    h = torch.exp(-grid_d2[:, bmu] / (2 * sigma**2))  # (k, n): unit i, point j
    mass = h.sum(-1, keepdim=True)
    return torch.where(mass > 0, (h @ x) / mass.clamp(min=torch.finfo(x.dtype).tiny), weights)


class SOM:
    """``SOM(k).fit(x)`` then ``.labels_`` (n,) and ``.weights`` (k, d); scikit-learn-like."""

    def __init__(self, k: int, *, epochs: int = 100, sigma_start: float | None = None, sigma_end: float = 0.3,
                 seed: int = 0) -> None:
        self.k = check_int("k", k, minimum=1)
        self.epochs = check_int("epochs", epochs, minimum=1)
        self.shape = grid_shape(k)
        self.sigma_start = check_float("sigma_start", sigma_start if sigma_start is not None
                                       else max(1.0, max(self.shape) / 2), minimum=0.0, exclusive_minimum=True)
        self.sigma_end = check_float("sigma_end", sigma_end, minimum=0.0, exclusive_minimum=True)
        self.seed = check_int("seed", seed, minimum=0)
        rows, cols = self.shape
        r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        self.grid = torch.stack([r.flatten(), c.flatten()], -1).double()  # (k, 2)
        self.weights: torch.Tensor | None = None
        self.labels_: torch.Tensor | None = None

    def fit(self, x: torch.Tensor) -> SOM:
        check_tensor("x", x, ndim=2, floating=True)
        if x.shape[0] < self.k:
            raise ValueError(f"x must have at least k={self.k} points, got {x.shape[0]}")
        x = x.double()
        g = torch.Generator().manual_seed(self.seed)
        weights = x[torch.randperm(x.shape[0], generator=g)[: self.k]].clone()
        ratio = (self.sigma_end / self.sigma_start) ** (1 / max(1, self.epochs - 1))
        for epoch in range(self.epochs):
            weights = som_step(x, weights, self.grid, self.sigma_start * ratio**epoch)
        self.weights = weights
        self.labels_ = torch.cdist(x, weights).argmin(-1)
        return self
