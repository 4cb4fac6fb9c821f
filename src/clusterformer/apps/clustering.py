"""Stand-alone clustering (ClusterFormer paper, appendix A, Table 6): the Neural Clustering Method against
k-means and a self-organising map, scored against labels.

``run_clustering(method, k, x, labels)`` fits one method and returns ``accuracy``, ``purity`` and ``nmi``:

* ``accuracy``: the best one-to-one matching of clusters to labels (Hungarian algorithm,
  ``scipy.optimize.linear_sum_assignment`` on the k x classes contingency table); points in unmatched
  clusters count as errors, so with k > classes it is capped by the largest ``classes`` clusters.
* ``purity``: every cluster labelled with its majority class (many-to-one). This is what a table whose
  accuracy *grows* with k > classes (the paper's Table 6, k = 10 ... 300 on MNIST) can only be measuring.
* ``nmi``: normalised mutual information (scikit-learn, arithmetic mean).

Methods (all on the same centred features; centring changes neither k-means nor the SOM, which are
translation invariant, but matters for the cosine similarity of the neural method):

* ``neural``: :class:`NeuralClusterer` -- the Neural Clustering Method of section 3.1 on its clustering loss
  alone: learnable centroids C (k x d, started at k points chosen by k-means++ on the cosine distance, as
  k-means starts; ``init="random"``: k random points), U = softmax over points of
  ``scale`` * cos(C_i, x_j) (eq. 2), C_hat = U X (eq. 3), I_j = argmax_i U_ij (eq. 4), and L1 = -mean_j
  cos(x_j, C_hat_{I_j}) (eq. 6) minimised with Adam (up to 1,000 steps on mini-batches of 2,048 points in
  float32, stopping early once the smoothed loss stalls; the final assignment over every point); like k-means,
  10 restarts from different initial points, keeping the one of lowest final L1. ``scale`` defaults to 3
  (the attention layer's 10 is too sharp over a whole data set: eq. 2's softmax runs over all n points, so
  C_hat collapses onto the few points nearest each centroid;
  docs/clustering-experiment.md#what-the-neural-methods-options-do has the sweep). No W^C projection by
  default: with the clustering loss alone, L1 has a degenerate minimum (W^C mapping every point to one direction gives
  L1 = -1 whatever the clusters), so the projection only makes sense with a task loss beside it
  (``projection=True`` keeps it; the tests show it lowers L1 further).
* ``kmeans``: scikit-learn ``KMeans(n_clusters=k, n_init=10)``.
* ``som``: :class:`clusterformer.apps.som.SOM`, batch SOM on a near-square grid.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from .._checks import check_choice, check_float, check_int, check_tensor
from ..clustering.kmeans import kmeans_plus_plus
from ..clustering.neural import NeuralClusteringOutput, neural_clustering
from .som import SOM

__all__ = ["METHODS", "NeuralClusterer", "cluster_scores", "digits_784", "hungarian_accuracy", "purity",
           "run_clustering"]

METHODS = ("neural", "kmeans", "som")


class NeuralClusterer:
    """The Neural Clustering Method as a clusterer; ``NeuralClusterer(k).fit(x).labels_``.

    ``n_init`` restarts (different initial centroids: k-means++ seeds, or random points with ``init="random"``)
    are trained side by side, as ``n_init`` centroid sets over the same shared points in one call of
    :func:`neural_clustering` (no loop over restarts, and no per-restart copy of the points: the scores of all
    restarts are one (m, d) x (d, n_init k) product), and the one with the lowest final clustering loss L1 is kept
    -- the analogue of k-means keeping its lowest-inertia restart. ``losses`` records the mean L1 over restarts at
    every step; ``restart_losses`` the final L1 of each restart (over the whole data set).

    Speed. Each step draws ``batch_size`` points (one sample shared by the restarts; None = every
    point, the paper's eq. 2 over the whole data set) and computes eqs. 2-6 on them in ``dtype``; training
    stops after ``steps`` steps, or earlier when the mean loss (smoothed over ``patience`` steps) has not fallen
    by a relative ``tol`` in the last ``patience`` steps (``tol=0``: never). The final assignment and the choice
    of restart use every point (one pass, eq. 4 over the whole data set). With mini-batches, eq. 2 normalises
    over the sampled points: C_hat is then a self-normalised estimate of the same weighted mean."""

    def __init__(self, k: int, *, steps: int = 1000, lr: float = 0.05, scale: float = 3.0,
                 assign: str = "subordinate", projection: bool = False, n_init: int = 10, seed: int = 0,
                 batch_size: int | None = 2048, dtype: str = "float32", tol: float = 1e-4,
                 patience: int = 50, init: str = "k-means++") -> None:
        self.k = check_int("k", k, minimum=1)
        self.steps = check_int("steps", steps, minimum=0)
        self.lr = check_float("lr", lr, minimum=0.0, exclusive_minimum=True)
        self.scale = check_float("scale", scale, minimum=0.0, exclusive_minimum=True)
        self.assign = check_choice("assign", assign, ("subordinate", "nearest"))
        self.projection = projection
        self.n_init = check_int("n_init", n_init, minimum=1)
        self.seed = check_int("seed", seed, minimum=0)
        self.batch_size = None if batch_size is None else check_int("batch_size", batch_size, minimum=1)
        self.dtype = getattr(torch, check_choice("dtype", dtype, ("float32", "float64")))
        self.tol = check_float("tol", tol, minimum=0.0)
        self.patience = check_int("patience", patience, minimum=1)
        self.init = check_choice("init", init, ("k-means++", "random"))
        self.centroids: torch.Tensor | None = None
        self.labels_: torch.Tensor | None = None
        self.losses: list[float] = []
        self.restart_losses: torch.Tensor | None = None
        self.steps_run = 0

    def fit(self, x: torch.Tensor) -> NeuralClusterer:
        check_tensor("x", x, ndim=2, floating=True)
        n, d = x.shape
        if n < self.k:
            raise ValueError(f"x must have at least k={self.k} points, got {n}")
        g = torch.Generator().manual_seed(self.seed)
        R = self.n_init
        x = x.to(self.dtype)  # (n, d), shared by the R restarts (one product for all of them)
        if self.init == "random":  # k distinct random points per restart
            start = torch.rand(R, n, generator=g).argsort(-1)[:, : self.k]
        else:  # k-means++ on the cosine distance that eq. 2 scores by; each restart draws its own seeds
            unit = torch.nn.functional.normalize(x, dim=-1, eps=1e-8)
            start = torch.stack([kmeans_plus_plus(unit, self.k, g) for _ in range(R)])  # R short chains, once
        centroids = torch.nn.Parameter(x[start].clone())  # (R, k, d)
        params = [centroids]
        w = None
        if self.projection:
            w = torch.nn.Parameter(torch.eye(d, dtype=x.dtype).repeat(R, 1, 1))  # (R, d, d)
            params.append(w)
        batch = n if self.batch_size is None else min(self.batch_size, n)

        def step(points: torch.Tensor) -> tuple[torch.Tensor, NeuralClusteringOutput]:
            points = points if w is None else points @ w  # (m, d) shared, or (R, m, d) projected per restart
            return points, neural_clustering(points, centroids, scale=self.scale, assign=self.assign)

        # The loss is a mean over the R restarts, so each restart's gradient is 1/R of its own; Adam's
        # update is invariant to that scale, so the restarts train exactly as if each were alone.
        opt = torch.optim.Adam(params, lr=self.lr)
        smoothed: list[float] = []
        for _ in range(self.steps):
            sample = x if batch == n else x[torch.randperm(n, generator=g)[:batch]]
            _, out = step(sample)
            opt.zero_grad()
            out.clustering_loss.backward()
            opt.step()
            self.losses.append(out.clustering_loss.item())
            self.steps_run += 1
            window = self.losses[-self.patience:]
            smoothed.append(sum(window) / len(window))
            if self.tol and len(smoothed) > self.patience:  # early stopping on the smoothed loss
                before = smoothed[-1 - self.patience]
                if before - smoothed[-1] < self.tol * abs(before):
                    break
        with torch.no_grad():
            points, out = step(x)  # every point: eq. 4 over the whole data set
            self.restart_losses = _per_sequence_clustering_loss(points, out)
        best = int(self.restart_losses.argmin())
        self.centroids = centroids.detach()[best]
        self.labels_ = out.assignments[best]
        return self


def digits_784(n: int = 10_000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """An MNIST-sized (n x 784) data set from scikit-learn's digits (MNIST is not available offline): n images drawn
    with replacement from the 1,797, each 8x8 image upsampled to 28x28 (bilinear), plus Gaussian pixel noise of
    standard deviation 1 (pixels are 0..16). Returns (x float32 (n, 784), labels (n,))."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    g = torch.Generator().manual_seed(seed)
    pick = torch.randint(len(digits.target), (n,), generator=g)
    images = torch.as_tensor(digits.images, dtype=torch.float32)[pick].unsqueeze(1)  # (n, 1, 8, 8)
    big = torch.nn.functional.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False)
    big = big + torch.randn(big.shape, generator=g)
    return big.reshape(n, 784).numpy(), digits.target[pick.numpy()]


def _per_sequence_clustering_loss(points: torch.Tensor, out: NeuralClusteringOutput) -> torch.Tensor:
    """L1 (eq. 6, cosine) of every centroid set separately: (B, N, d) points, or (N, d) shared by the sets -> (B,).
    From the (B, N, k) cosines of every point to every C_hat, not a (B, N, d) gather of the chosen C_hat."""
    unit = torch.nn.functional.normalize
    cosines = unit(points, dim=-1, eps=1e-8) @ unit(out.updated_centroids, dim=-1, eps=1e-8).transpose(-1, -2)
    return -cosines.gather(-1, out.assignments.unsqueeze(-1)).squeeze(-1).mean(-1)


def _contingency(clusters: np.ndarray, labels: np.ndarray) -> np.ndarray:
    _, c = np.unique(clusters, return_inverse=True)
    _, y = np.unique(labels, return_inverse=True)
    table = np.zeros((c.max() + 1, y.max() + 1), dtype=np.int64)
    np.add.at(table, (c, y), 1)
    return table


def hungarian_accuracy(clusters, labels) -> float:
    """Fraction of points whose cluster is matched to their label by the best one-to-one matching."""
    from scipy.optimize import linear_sum_assignment

    table = _contingency(np.asarray(clusters), np.asarray(labels))
    rows, cols = linear_sum_assignment(table, maximize=True)
    return float(table[rows, cols].sum() / table.sum())


def purity(clusters, labels) -> float:
    """Fraction of points carrying their cluster's majority label."""
    table = _contingency(np.asarray(clusters), np.asarray(labels))
    return float(table.max(1).sum() / table.sum())


def cluster_scores(clusters, labels) -> dict[str, float]:
    """accuracy (Hungarian), purity and NMI of a clustering against labels."""
    from sklearn.metrics import normalized_mutual_info_score

    clusters, labels = np.asarray(clusters), np.asarray(labels)
    if clusters.shape != labels.shape:
        raise ValueError(f"labels must have one entry per point: {labels.shape} vs {clusters.shape}")
    return {"accuracy": hungarian_accuracy(clusters, labels), "purity": purity(clusters, labels),
            "nmi": float(normalized_mutual_info_score(labels, clusters))}


def run_clustering(method: str, k: int, x: torch.Tensor | np.ndarray, labels=None, *, seed: int = 0,
                   **options) -> dict:
    """Fit ``method`` with ``k`` clusters on x (n, d); returns labels, scores (if ``labels``), seconds."""
    check_choice("method", method, METHODS)
    check_int("k", k, minimum=1)
    x = torch.as_tensor(np.asarray(x, dtype=np.float64))
    check_tensor("x", x, ndim=2, floating=True)
    if x.shape[0] < k:
        raise ValueError(f"k must be <= the number of points ({x.shape[0]}), got {k}")
    x = x - x.mean(0)
    started = time.perf_counter()
    trained_steps = None
    if method == "neural":
        model = NeuralClusterer(k, seed=seed, **options).fit(x)
        assignments, trained_steps = model.labels_.numpy(), model.steps_run
    elif method == "som":
        assignments = SOM(k, seed=seed, **options).fit(x).labels_.numpy()
    else:
        from sklearn.cluster import KMeans

        kmeans_options = {"n_init": 10, **options}
        assignments = KMeans(n_clusters=k, random_state=seed, **kmeans_options).fit(x.numpy()).labels_
    result = {"method": method, "k": k, "seed": seed, "options": options, "n": int(x.shape[0]),
              "clusters_used": len(np.unique(assignments)), "seconds": time.perf_counter() - started}
    if trained_steps is not None:
        result["steps_run"] = trained_steps  # the neural method may stop early
    if labels is not None:
        result.update(cluster_scores(assignments, labels))
    result["labels"] = assignments.tolist()
    return result
