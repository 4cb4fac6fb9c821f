"""Stand-alone clustering: metrics against brute force, the batch SOM step against its definition, recovery
of planted clusters by every method, and the `clusterformer cluster` command."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

pytest.importorskip("sklearn")
pytest.importorskip("scipy")

from clusterformer.apps.clustering import (
    NeuralClusterer,
    hungarian_accuracy,
    purity,
    run_clustering,
)
from clusterformer.apps.som import SOM, grid_shape, som_step
from clusterformer.cli import main
from clusterformer.clustering.neural import neural_clustering
from clusterformer.masks import AttentionMask
from seeds import fixed_seed


def _blobs(n_per: int, centres: int, dim: int, seed: int, spread: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(centres, dim, generator=g, dtype=torch.float64) * 4
    labels = torch.arange(centres).repeat_interleave(n_per)
    x = means[labels] + spread * torch.randn(len(labels), dim, generator=g, dtype=torch.float64)
    return x, labels


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hungarian_accuracy_and_purity_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    clusters, labels = rng.integers(0, 4, 50), rng.integers(0, 4, 50)
    best = max(np.mean([perm[c] == y for c, y in zip(clusters, labels, strict=True)])
               for perm in itertools.permutations(range(4)))
    assert hungarian_accuracy(clusters, labels) == pytest.approx(best)
    majority = sum(np.bincount(labels[clusters == c]).max() for c in np.unique(clusters)) / 50
    assert purity(clusters, labels) == pytest.approx(majority)
    # more clusters than labels: one-to-one accuracy never exceeds purity
    many = rng.integers(0, 9, 50)
    assert hungarian_accuracy(many, labels) <= purity(many, labels)


def test_som_step_matches_its_definition():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(13, 3, generator=g, dtype=torch.float64), torch.randn(6, 3, generator=g, dtype=torch.float64)
    grid = SOM(6).grid
    sigma = 0.8
    new = som_step(x, w, grid, sigma)
    for i in range(6):
        num, den = torch.zeros(3, dtype=torch.float64), 0.0
        for j in range(13):
            b = min(range(6), key=lambda u: float((x[j] - w[u]).norm()))
            h = float(torch.exp(-((grid[i] - grid[b]) ** 2).sum() / (2 * sigma**2)))
            num, den = num + h * x[j], den + h
        torch.testing.assert_close(new[i], num / den)
    assert grid_shape(10) == (2, 5) and grid_shape(100) == (10, 10) and grid_shape(7) == (1, 7)


@pytest.mark.parametrize("method", ["neural", "kmeans", "som"])
def test_every_method_recovers_planted_clusters(method):
    x, labels = _blobs(40, 5, 6, seed=3)
    options = {"steps": 200, "n_init": 3} if method == "neural" else {}  # CI-sized
    result = run_clustering(method, 5, x, labels.numpy(), seed=0, **options)
    assert result["accuracy"] > 0.95 and result["nmi"] > 0.9, result


def test_neural_clusterer_lowers_its_loss_and_a_free_projection_lowers_it_further():
    x, _ = _blobs(30, 4, 5, seed=4)
    x = x - x.mean(0)
    model = NeuralClusterer(4, steps=100, n_init=1, seed=0).fit(x)
    assert model.losses[-1] < model.losses[0]
    projected = NeuralClusterer(4, steps=100, n_init=1, seed=0, projection=True).fit(x)
    assert projected.losses[-1] < model.losses[-1]  # W^C gives L1 another way down (towards one direction)


def test_neural_clusterer_restarts_train_independently_and_the_lowest_loss_is_kept():
    x, _ = _blobs(25, 5, 6, seed=6)
    x = x - x.mean(0)
    single = NeuralClusterer(5, steps=60, n_init=1, seed=2).fit(x)
    several = NeuralClusterer(5, steps=60, n_init=4, seed=2).fit(x)
    assert several.restart_losses.shape == (4,)
    # restart 0 starts from the same points as the single run and trains the same way (Adam is invariant
    # to the 1/R scale of the batched loss), so it ends at the same loss
    torch.testing.assert_close(several.restart_losses[0], single.restart_losses[0], atol=1e-6, rtol=0)
    best = int(several.restart_losses.argmin())
    assert several.restart_losses[best] <= single.restart_losses[0] + 1e-9
    # the kept labels are those of the best restart: recompute its loss from them
    points = x.float().unsqueeze(0)  # the clusterer's dtype (float32 by default)
    out = neural_clustering(points, several.centroids.unsqueeze(0), scale=several.scale)
    torch.testing.assert_close(out.assignments[0], several.labels_)
    torch.testing.assert_close(out.clustering_loss, several.restart_losses[best])
    with pytest.raises(ValueError, match="n_init"):
        NeuralClusterer(3, n_init=0)


def test_cluster_command_digits_and_npy(tmp_path, capsys):
    out = tmp_path / "digits.json"
    assert main(["cluster", "--method", "kmeans", "--k", "10", "--dataset", "digits", "--seeds", "0,1",
                 "--options", '{"n_init": 1}', "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert len(record["runs"]) == 2 and 0.5 < record["accuracy"] <= 1 and 0.5 < record["nmi"] <= 1
    assert record["accuracy_std"] >= 0 and "labels" not in record["runs"][0]
    x, labels = _blobs(20, 3, 4, seed=5)
    np.save(tmp_path / "x.npy", x.numpy())
    np.save(tmp_path / "y.npy", labels.numpy())
    assert main(["cluster", "--method", "kmeans", "--k", "3", "--data", str(tmp_path / "x.npy"), "--labels",
                 str(tmp_path / "y.npy"), "--keep-labels"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["accuracy"] > 0.95 and len(record["runs"][0]["labels"]) == 60
    for argv, message in [
        (["--data", str(tmp_path / "missing.npy")], "no such file"),
        (["--data", str(tmp_path / "x.npy"), "--labels", str(tmp_path / "x.npy")], "one label per point"),
        (["--dataset", "digits", "--data", str(tmp_path / "x.npy")], "exactly one of"),
    ]:
        with pytest.raises(SystemExit):
            main(["cluster", "--method", "kmeans", "--k", "3", *argv])
        assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="k must be <="):
        run_clustering("kmeans", 100, x, labels)


def test_neural_clusterer_mini_batches_and_early_stopping():
    """Mini-batches of points and early stopping keep the clustering of planted blobs, and stop early."""
    x, labels = _blobs(200, 5, 8, seed=7)
    x = x - x.mean(0)
    fast = NeuralClusterer(5, steps=1000, n_init=3, seed=0, batch_size=128, tol=1e-3, patience=20).fit(x)
    assert fast.steps_run < 1000 and len(fast.losses) == fast.steps_run
    assert fast.labels_.shape == (1000,)  # the assignment covers every point, not the last batch
    assert hungarian_accuracy(fast.labels_.numpy(), labels.numpy()) > 0.95
    exact = NeuralClusterer(5, steps=50, n_init=1, seed=0, batch_size=None, dtype="float64", tol=0).fit(x)
    assert exact.steps_run == 50 and exact.centroids.dtype == torch.float64
    with pytest.raises(ValueError, match="batch_size"):
        NeuralClusterer(3, batch_size=0)
    with pytest.raises(ValueError, match="dtype"):
        NeuralClusterer(3, dtype="float16")


@pytest.mark.parametrize("assign", ["subordinate", "nearest"])
@pytest.mark.parametrize("per_set_k", [False, True])
def test_shared_points_give_what_expanded_points_give(assign, per_set_k):
    """neural_clustering on (N, d) points shared by B centroid sets (the clusterer's restarts, one product) equals
    the same points expanded to (B, N, d): assignments, C_hat, both losses and the gradients of points and
    centroids, float64 to 1e-10."""
    g = torch.Generator().manual_seed(fixed_seed())
    B, N, k, d = 3, 37, 5, 7
    base = torch.randn(N, d, generator=g, dtype=torch.float64)
    cents = torch.randn(B, k, d, generator=g, dtype=torch.float64)
    num_clusters = torch.tensor([5, 2, 4]) if per_set_k else None
    weights = torch.randn(B, k, d, generator=g, dtype=torch.float64)  # a probe of C_hat for the gradients
    results = []
    for shared in (True, False):
        points, centroids = base.clone().requires_grad_(), cents.clone().requires_grad_()
        out = neural_clustering(points if shared else points.expand(B, N, d), centroids, scale=3.0, assign=assign,
                                num_clusters=num_clusters)
        (out.clustering_loss + out.sorting_loss + (out.updated_centroids * weights).sum()).backward()
        results.append((out, points.grad, centroids.grad))
    (a, ga_p, ga_c), (b, gb_p, gb_c) = results
    assert torch.equal(a.assignments, b.assignments)
    for x, y in ((a.updated_centroids, b.updated_centroids), (a.clustering_loss, b.clustering_loss),
                 (a.sorting_loss, b.sorting_loss), (ga_p, gb_p), (ga_c, gb_c)):
        torch.testing.assert_close(x, y, atol=1e-10, rtol=0)
    with pytest.raises(ValueError, match="mask: padding is not supported"):
        neural_clustering(base, cents, mask=AttentionMask(torch.zeros(cents.shape[0], N, dtype=torch.bool)))
    with pytest.raises(ValueError, match="centroids"):
        neural_clustering(base, cents[0])


def test_neural_clusterer_starts_from_cosine_kmeans_plus_plus_seeds():
    """The default start is k-means++ on the cosine distance, drawn from the clusterer's seeded generator (steps=0
    keeps the start); init="random" starts elsewhere; a bad init is refused by name."""
    from clusterformer.clustering.kmeans import kmeans_plus_plus

    x, _ = _blobs(30, 4, 5, seed=8)
    x = (x - x.mean(0)).float()
    start = NeuralClusterer(4, steps=0, n_init=1, seed=3).fit(x).centroids
    seeds = kmeans_plus_plus(torch.nn.functional.normalize(x, dim=-1), 4, torch.Generator().manual_seed(3))
    assert len(set(seeds.tolist())) == 4
    torch.testing.assert_close(start, x[seeds], atol=0, rtol=0)
    random = NeuralClusterer(4, steps=0, n_init=1, seed=3, init="random").fit(x).centroids
    assert not torch.equal(random, start)
    with pytest.raises(ValueError, match="init"):
        NeuralClusterer(4, init="kmeans")


def test_updated_centroids_of_empty_softmax_rows_are_zero_and_finite():
    """Eq. 3's C_hat = U X W^C with U of eq. 2 a softmax over the real positions: a centroid a sequence does not
    use, and every centroid of a sequence of padding only, has no positions -- the library's rule for a row
    without entries (clusterformer.masks.allow_empty_rows) makes its U row 0, so its C_hat is 0 -- while the other
    rows are the softmax over the real positions alone (float64, to 1e-12), and every gradient is finite."""
    g = torch.Generator().manual_seed(fixed_seed())
    B, N, k, d = 3, 11, 4, 5
    points = torch.randn(B, N, d, generator=g, dtype=torch.float64, requires_grad=True)
    centroids = torch.randn(B, k, d, generator=g, dtype=torch.float64, requires_grad=True)
    padding = torch.zeros(B, N, dtype=torch.bool)
    padding[1, 7:] = True
    padding[2] = True  # padding only
    num_clusters = torch.tensor([4, 3, 4])  # sequence 1 leaves its last centroid unused
    out = neural_clustering(points, centroids, mask=AttentionMask(padding), similarity="dot", scale=1.0,
                            num_clusters=num_clusters)
    for b, i in itertools.product(range(B), range(k)):
        real = ~padding[b]
        if not bool(real.any()) or i >= int(num_clusters[b]):
            assert torch.equal(out.updated_centroids[b, i], torch.zeros(d, dtype=torch.float64))
            continue
        u = torch.softmax(points[b, real] @ centroids[b, i], dim=0)  # eq. 2 with phi the inner product
        torch.testing.assert_close(out.updated_centroids[b, i], u @ points[b, real], atol=1e-12, rtol=0)
    (out.updated_centroids.sum() + out.clustering_loss + out.sorting_loss).backward()
    assert bool(torch.isfinite(points.grad).all()) and bool(torch.isfinite(centroids.grad).all())
