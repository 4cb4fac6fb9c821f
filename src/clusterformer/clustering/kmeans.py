"""K-means variants shared by the mechanisms and usable on their own.

* :func:`spherical_kmeans` -- Lloyd's algorithm on unit vectors (cosine assignment), for Cluster-Former's
  centroids recomputed from its memory bank.
* :func:`greedy_nearest_order` -- Cluster-Former's ``GetCentroids`` ordering: neighbouring ids are similar.
* :func:`ema_centroid_update` -- one online k-means step with exponential moving averages (Routing
  Transformer; learned k-means attention), batched over heads and rounds; :func:`ema_from_sums` the same step from
  per-cluster sums already taken (:mod:`clusterformer.ops.spherical`'s fused assignment).
* :func:`hamming_kmeans` -- K-means on binary hash codes with Hamming distance (clustered attention).
* :func:`euclidean_kmeans` -- batched Lloyd K-means on real vectors with the same deterministic seeding
  (clustered attention with ``query_clustering="euclidean"``: the queries themselves instead of their hashes).
* :func:`kmeans_plus_plus` -- k-means++ seeding on the cosine distance (spherical k-means; the stand-alone
  neural clusterer's restarts).

All are vectorised over points and clusters; the only Python loops run over Lloyd iterations (and, in
:func:`greedy_nearest_order` and :func:`kmeans_plus_plus`, over the k picks of a chain that runs once per
centroid refresh or initialisation).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .._checks import check_int, check_tensor

__all__ = [
    "cluster_sums", "ema_centroid_update", "ema_from_sums", "euclidean_kmeans", "greedy_nearest_order",
    "hamming_kmeans", "kmeans_plus_plus", "spherical_kmeans",
]


def cluster_sums(points: torch.Tensor, assign: torch.Tensor, k: int, weight: torch.Tensor | None = None):
    """Per-cluster sums and counts. points (..., n, d), assign (..., n) in [0, k), weight (..., n) or None.
    Returns sums (..., k, d) and counts (..., k). O(n d), no (n, k) one-hot: one ``index_add_`` over the
    flattened (batch x cluster) rows, several times faster on CPU than ``scatter_add_`` with an index expanded
    over d."""
    *batch, n, d = points.shape
    groups = math.prod(batch)
    rows = assign.reshape(groups, n) + k * torch.arange(groups, device=assign.device).unsqueeze(1)
    rows = rows.reshape(-1)
    flat = points.reshape(groups * n, d)
    if weight is None:
        ones = torch.ones(groups * n, dtype=points.dtype, device=points.device)
    else:
        ones = weight.reshape(-1).to(points.dtype)
        flat = flat * ones.unsqueeze(-1)
    sums = points.new_zeros(groups * k, d).index_add_(0, rows, flat).view(*batch, k, d)
    counts = ones.new_zeros(groups * k).index_add_(0, rows, ones).view(*batch, k)
    return sums, counts


def spherical_kmeans(
    points: torch.Tensor, k: int, *, iterations: int = 10, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Cosine k-means. points (n, d); returns k unit centroids (k, d).

    Initialisation: k-means++ with cosine distance 1 - cos (Arthur & Vassilvitskii 2007), draws from
    ``generator``. Empty clusters keep their previous centroid. Computed in float32 or wider."""
    check_tensor("points", points, ndim=2, floating=True)
    check_int("k", k, minimum=1)
    check_int("iterations", iterations, minimum=0)
    n = points.shape[0]
    if n == 0:
        raise ValueError("points must hold at least one row to compute centroids from")
    x = F.normalize(points.to(torch.promote_types(points.dtype, torch.float32)), dim=-1)
    centroids = x[kmeans_plus_plus(x, k, generator)]
    for _ in range(iterations):
        assign = (x @ centroids.T).argmax(-1)
        sums, counts = cluster_sums(x, assign, k)
        centroids = torch.where(counts.unsqueeze(-1) > 0, F.normalize(sums, dim=-1), centroids)
    return centroids


def kmeans_plus_plus(x: torch.Tensor, k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """The indices (k,) of k seeds among unit rows x (n, d), k-means++ on the cosine distance (1 - cos = half the
    squared Euclidean distance of unit vectors): the first uniformly, each next with probability proportional to
    its distance to the nearest seed so far (uniform again if every point is already a seed). Sequential over
    the k seeds by definition; each step is one (n, d) x (d,) product."""
    n = x.shape[0]
    first = int(torch.randint(n, (1,), generator=generator))
    seeds = [first]
    nearest = 1.0 - x @ x[first]
    for _ in range(k - 1):
        weights = nearest.clamp(min=0).double().cpu()
        if float(weights.sum()) <= 0:
            weights = torch.ones(n, dtype=torch.float64)
        pick = int(torch.multinomial(weights, 1, generator=generator))
        seeds.append(pick)
        nearest = torch.minimum(nearest, 1.0 - x @ x[pick])
    return torch.tensor(seeds, device=x.device)


def greedy_nearest_order(centroids: torch.Tensor) -> torch.Tensor:
    """Cluster-Former's GetCentroids: start from centroid 0, repeatedly append the unused centroid with the
    largest cosine similarity to the last one appended. centroids (k, d) -> the same rows reordered.

    Sorting tokens by the resulting ids puts similar clusters next to each other, so uniform chunks that
    straddle a cluster boundary still hold similar states. Runs once per centroid refresh (k small steps),
    never per forward."""
    k = centroids.shape[0]
    sim = F.normalize(centroids, dim=-1) @ F.normalize(centroids, dim=-1).T
    used = torch.zeros(k, dtype=torch.bool, device=centroids.device)
    order = [0]
    used[0] = True
    for _ in range(k - 1):
        nxt = int(sim[order[-1]].masked_fill(used, float("-inf")).argmax())
        order.append(nxt)
        used[nxt] = True
    return centroids[torch.tensor(order, device=centroids.device)]


@torch.no_grad()
def ema_centroid_update(
    centroids: torch.Tensor, points: torch.Tensor, assign: torch.Tensor, *, decay: float,
    valid: torch.Tensor | None = None, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """One online spherical k-means step: c <- normalise(decay c + (1 - decay) mean of its unit points).

    centroids (G, k, d); points (G, n, d) (normalised here); assign (G, n); valid (G, n) bool or None.
    ``reduce``: applied to the per-cluster sums and counts before the means are taken, e.g.
    :func:`clusterformer.distributed.all_reduce_sum` to use the points of every rank of a distributed run.
    Clusters with no point this step keep their centroid. Returns the new centroids (G, k, d)."""
    k = centroids.shape[-2]
    x = F.normalize(points.to(centroids.dtype), dim=-1)
    sums, counts = cluster_sums(x, assign, k, valid)
    if reduce is not None:
        sums, counts = reduce(sums), reduce(counts)
    return ema_from_sums(centroids, sums, counts, decay=decay)


def ema_from_sums(centroids: torch.Tensor, sums: torch.Tensor, counts: torch.Tensor, *, decay: float) -> torch.Tensor:
    """:func:`ema_centroid_update` from the per-cluster sums (G, k, d) of the unit points and their counts (G, k),
    already summed over whatever ranks take part: c <- normalise(decay c + (1 - decay) sums / counts); clusters
    without points keep their centroid."""
    sums, counts = sums.to(centroids.dtype), counts.to(centroids.dtype)
    means = sums / counts.clamp(min=1).unsqueeze(-1)
    updated = F.normalize(decay * centroids + (1.0 - decay) * means, dim=-1)
    return torch.where(counts.unsqueeze(-1) > 0, updated, centroids)


def _evenly_spaced_seeds(points: torch.Tensor, C: int, valid: torch.Tensor | None) -> torch.Tensor:
    """Initial centroids (G, C, d) for the batched Lloyd K-means below: the points at ranks c * n_valid // C
    (c = 0..C-1) among the *valid* points of each row, in order. Deterministic, and independent of how much
    padding follows the sequence. points (G, n, d); valid (G, n) bool or None (all valid)."""
    n = points.shape[1]
    if valid is None:
        start = torch.div(torch.arange(C, device=points.device) * n, C, rounding_mode="floor")
        return points[:, start]
    order = torch.sort((~valid).to(torch.uint8), dim=1, stable=True).indices  # valid points first, in order
    n_valid = valid.sum(1, keepdim=True).clamp(min=1)  # (G, 1); an all-padding row seeds from padding
    rank = torch.div(torch.arange(C, device=points.device) * n_valid, C, rounding_mode="floor")  # (G, C)
    start = order.gather(1, rank)
    return points.gather(1, start.unsqueeze(-1).expand(-1, -1, points.shape[-1]))


def hamming_kmeans(
    codes: torch.Tensor, clusters: int, *, iterations: int = 10, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """K-means in Hamming space (clustered attention, section 3.2.2).

    Args:
        codes: (G, n, bits) bool hash codes.
        clusters: C; clamped to n.
        iterations: Lloyd iterations L.
        valid: (G, n) bool, points that take part in the centroid updates (padding excluded).

    Returns:
        (G, n) long assignments in [0, min(C, n)).

    Centroids start at the codes of evenly spaced *valid* points (the (c * n_valid // C)-th valid point for
    c = 0..C-1; deterministic, and independent of how much padding follows the sequence); each iteration
    assigns every point to the centroid at the smallest Hamming distance (ties to the lowest index) and
    sets each centroid bit to the majority bit of its members (a tie or an empty cluster keeps the bit).
    With C = n and distinct codes every point is its own cluster."""
    check_tensor("codes", codes, ndim=3)
    _G, n, _bits = codes.shape
    C = max(1, min(check_int("clusters", clusters, minimum=1), n))
    x = codes.to(torch.float32)  # 0/1
    centroids = _evenly_spaced_seeds(x, C, valid)
    weight = None if valid is None else valid.to(x.dtype)

    def assign_to(c: torch.Tensor) -> torch.Tensor:
        # Hamming distance = |x| + |c| - 2 x.c; |x| is the same for every centroid, so the nearest
        # centroid maximises 2 x.c - |c| (one fused baddbmm; exact in float32 for bits < 2^24).
        score = torch.baddbmm(-c.sum(-1).unsqueeze(1), x, c.transpose(1, 2), alpha=2)
        return score.max(-1).indices  # first maximum = lowest index among ties (documented; faster than argmax)

    assign = assign_to(centroids)
    for _ in range(iterations):
        sums, counts = cluster_sums(x, assign, C, weight)
        ones, zeros = 2 * sums, counts.unsqueeze(-1)
        centroids = torch.where(ones > zeros, 1.0, torch.where(ones < zeros, 0.0, centroids))
        assign = assign_to(centroids)
    return assign


def euclidean_kmeans(
    points: torch.Tensor, clusters: int, *, iterations: int = 10, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Batched Lloyd K-means with squared Euclidean distance on real vectors.

    The clustered-attention paper (section 3.2.2) names K-means on the queries as the grouping its analysis
    wants and hashes them only to make the distances cheap (O(N C B) instead of O(N C D_k) per iteration).
    When the head dimension D_k is no larger than the hash's B bits that saving is gone, and clustering the
    queries directly groups them better (measured inside a pretrained MiniLM:
    docs/papers.md#clustered-attention-vyas-et-al-2020-approximating-a-pretrained-model).

    Args:
        points: (G, n, d) floating.
        clusters: C; clamped to n.
        iterations: Lloyd iterations L.
        valid: (G, n) bool, points that take part in the centroid updates (padding excluded).

    Returns:
        (G, n) long assignments in [0, min(C, n)).

    Same seeding as :func:`hamming_kmeans` (evenly spaced valid points); each iteration assigns every point to
    the nearest centroid (ties to the lowest index) and moves each centroid to the mean of its valid members
    (an empty cluster keeps its centroid). Computed in float32 or wider. With fewer valid points than C the
    seeds repeat; a point then equally near two identical centroids may take either (same partition, other
    labels), since the distances come from one matmul whose rounding can differ between columns."""
    check_tensor("points", points, ndim=3, floating=True)
    _G, n, _d = points.shape
    C = max(1, min(check_int("clusters", clusters, minimum=1), n))
    check_int("iterations", iterations, minimum=0)
    x = points.to(torch.promote_types(points.dtype, torch.float32))
    centroids = _evenly_spaced_seeds(x, C, valid)
    weight = None if valid is None else valid.to(x.dtype)

    def assign_to(c: torch.Tensor) -> torch.Tensor:
        # |x - c|^2 = |x|^2 - 2 x.c + |c|^2; |x|^2 is the same for every centroid: maximise 2 x.c - |c|^2.
        score = torch.baddbmm(-(c * c).sum(-1).unsqueeze(1), x, c.transpose(1, 2), alpha=2)
        return score.max(-1).indices  # first maximum = lowest index among ties

    assign = assign_to(centroids)
    for _ in range(iterations):
        sums, counts = cluster_sums(x, assign, C, weight)
        centroids = torch.where(counts.unsqueeze(-1) > 0, sums / counts.clamp(min=1).unsqueeze(-1), centroids)
        assign = assign_to(centroids)
    return assign
