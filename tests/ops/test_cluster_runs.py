"""Each query's run of its own cluster's keys (clusterformer.ops.cluster_runs) against the rule written per query."""

from __future__ import annotations

import pytest
import torch

from clusterformer.ops.cluster_runs import cluster_runs, run_attention
from clusterformer.ops.listed_attention import listed_attention_reference
from reference import water_filled
from seeds import fixed_seed


def _expected(query_ids, key_ids, width, causal, query_real, split="each"):
    """The keys each query reads, by the rule: (B, H, N) sorted lists of positions. ``query_ids`` (B, H, N), or
    (B, H, N, R): a run from each of the query's R clusters, of up to ``width`` keys each, or (``split="fill"``)
    of the water-filled share of ``width`` over the R runs."""
    B, H, N = key_ids.shape
    ids = query_ids if query_ids.dim() == 4 else query_ids.unsqueeze(-1)
    out = {}
    for b in range(B):
        w = int(width[b]) if torch.is_tensor(width) else width
        for h in range(H):
            for i in range(N):
                out[b, h, i] = []
                if query_real is not None and not query_real[b, i]:
                    continue
                clusters = ids[b, h, i].tolist()
                members = [[j for j in range(N) if key_ids[b, h, j] == c and (j <= i or not causal)] for c in clusters]
                lengths = [w] * len(clusters) if split == "each" else water_filled([len(m) for m in members], w)
                for run, length in zip(members, lengths, strict=True):
                    if causal:
                        out[b, h, i] += run[-length:] if length else []
                    else:
                        rank = sum(j < i for j in run)
                        start = min(max(0, rank - length // 2), max(0, len(run) - length))
                        out[b, h, i] += run[start:start + length]
                out[b, h, i] = sorted(out[b, h, i])
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("N", "clusters", "width"), [(1, 1, 1), (9, 2, 3), (31, 3, 4), (40, 5, 7), (16, 1, 16),
                                                      (12, 4, 0)])
def test_runs_hold_the_keys_the_rule_names(causal, N, clusters, width):
    """Skewed cluster sizes (one cluster takes most keys, so runs are cut by ``width`` and moved inside their
    cluster), a padding id past the clusters that no query has, and queries marked not real."""
    g = torch.Generator().manual_seed(fixed_seed())
    B, H = 3, 2
    weights = torch.tensor([4.0] + [1.0] * (clusters - 1))
    draw = lambda: torch.multinomial(weights, B * H * N, replacement=True, generator=g).view(B, H, N)  # noqa: E731
    query_ids, key_ids = draw(), draw()
    key_ids[1, :, -2:] = clusters  # padding keys: never read
    query_real = torch.ones(B, N, dtype=torch.bool)
    query_real[2, : N // 3] = False
    runs = cluster_runs(query_ids, key_ids, width, causal=causal, query_real=query_real)
    index = runs.as_index()
    expected = _expected(query_ids, key_ids, width, causal, query_real)
    for (b, h, i), keys in expected.items():
        got = index[b, h, i]
        assert sorted(got[got >= 0].tolist()) == keys, (b, h, i)
    assert runs.capacity == width


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("N", "clusters", "runs", "width"), [(9, 2, 2, 3), (31, 4, 2, 4), (40, 5, 3, 6), (7, 3, 3, 0)])
def test_several_clusters_per_query_read_a_run_from_each(causal, N, clusters, runs, width):
    """query_ids (B, H, N, R): R distinct clusters per query (a random ranking of the clusters), a run of up to
    ``width`` keys from each; skewed sizes, padding keys and queries not real as above."""
    g = torch.Generator().manual_seed(fixed_seed())
    B, H = 3, 2
    weights = torch.tensor([4.0] + [1.0] * (clusters - 1))
    key_ids = torch.multinomial(weights, B * H * N, replacement=True, generator=g).view(B, H, N)
    query_ids = torch.rand(B, H, N, clusters, generator=g).argsort(-1)[..., :runs]  # distinct per query
    key_ids[1, :, -2:] = clusters
    query_real = torch.ones(B, N, dtype=torch.bool)
    query_real[2, : N // 3] = False
    read = cluster_runs(query_ids, key_ids, width, causal=causal, query_real=query_real)
    assert read.first.shape == (B, H, N, runs) and read.capacity == width
    index = read.as_index()
    for (b, h, i), keys in _expected(query_ids, key_ids, width, causal, query_real).items():
        got = index[b, h, i]
        assert sorted(got[got >= 0].tolist()) == keys, (b, h, i)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("N", "clusters", "runs", "width"),
                         [(9, 2, 2, 3), (31, 4, 2, 7), (40, 5, 3, 10), (40, 6, 4, 9), (25, 3, 3, 40), (7, 3, 3, 0)])
def test_fill_shares_the_width_over_a_querys_runs(causal, N, clusters, runs, width):
    """split="fill": ``width`` over the query's R runs together, water-filled -- a run short of the common level
    leaves the rest to the others, the remainder below ``width`` one key each to the nearest runs with more --
    against the rule written per query; skewed sizes, padding keys and queries not real as above. No query reads
    more than ``width`` keys, and a run may take them all (``capacity`` = width)."""
    g = torch.Generator().manual_seed(fixed_seed())
    B, H = 3, 2
    weights = torch.tensor([6.0] + [1.0] * (clusters - 1))
    key_ids = torch.multinomial(weights, B * H * N, replacement=True, generator=g).view(B, H, N)
    query_ids = torch.rand(B, H, N, clusters, generator=g).argsort(-1)[..., :runs]
    key_ids[1, :, -2:] = clusters
    query_real = torch.ones(B, N, dtype=torch.bool)
    query_real[2, : N // 3] = False
    read = cluster_runs(query_ids, key_ids, width, causal=causal, query_real=query_real, split="fill")
    assert read.capacity == width and int(read.length.sum(-1).max()) <= width
    index = read.as_index()
    expected = _expected(query_ids, key_ids, width, causal, query_real, split="fill")
    for (b, h, i), keys in expected.items():
        got = index[b, h, i]
        assert sorted(got[got >= 0].tolist()) == keys, (b, h, i)
    everything = _expected(query_ids, key_ids, N, causal, query_real)  # every key of the query's clusters
    assert max(map(len, expected.values())) == min(width, max(map(len, everything.values())))


def test_a_width_per_sequence():
    g = torch.Generator().manual_seed(fixed_seed())
    query_ids = torch.randint(0, 2, (2, 1, 15), generator=g)
    key_ids = torch.randint(0, 2, (2, 1, 15), generator=g)
    width = torch.tensor([2, 5])
    for causal in (False, True):
        runs = cluster_runs(query_ids, key_ids, width, causal=causal)
        index = runs.as_index()
        for (b, h, i), keys in _expected(query_ids, key_ids, width, causal, None).items():
            got = index[b, h, i]
            assert sorted(got[got >= 0].tolist()) == keys
        assert runs.capacity == 5


def test_run_attention_with_and_without_dropout_matches_the_gathered_definition():
    """Without dropout the fused call equals the gathered reference (float64, ~1e-12) with its gradients; with
    dropout p the expectation over draws is the same output (each weight kept with probability 1 - p and scaled by
    1 / (1 - p)), and a query without keys gets 0."""
    g = torch.Generator().manual_seed(fixed_seed())
    B, H, N, D = 2, 2, 11, 4
    q, k, v = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ids = torch.randint(0, 3, (B, H, N), generator=g)
    runs = cluster_runs(ids, ids.roll(1, -1), 3, causal=True)
    out = run_attention(q, k, v, runs)
    ref, _ = listed_attention_reference(q, k, v, q.new_empty(B, H, N, 0, dtype=torch.long), runs=runs)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    torch.manual_seed(fixed_seed())
    mean = torch.stack([run_attention(q, k, v, runs, dropout_p=0.5) for _ in range(4000)]).mean(0)
    torch.testing.assert_close(mean, ref, rtol=0.0, atol=0.1)
    empty = runs.length[..., 0] == 0
    assert empty.any() and (run_attention(q, k, v, runs, dropout_p=0.5)[empty] == 0).all()


def test_bad_ids_are_refused():
    ids = torch.zeros(1, 1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="key_ids must be"):
        cluster_runs(ids, ids[..., :3], 2, causal=True)
    with pytest.raises(ValueError, match="key_ids must be"):  # R ids per query, but for 3 queries of 4 keys
        cluster_runs(ids[..., :3, None].expand(1, 1, 3, 2), ids, 2, causal=True)
    with pytest.raises(ValueError, match="int64"):
        cluster_runs(ids.int(), ids, 2, causal=True)
    with pytest.raises(ValueError, match="width"):
        cluster_runs(ids, ids, -1, causal=False)
    with pytest.raises(ValueError, match="width"):
        cluster_runs(ids, ids, torch.tensor([2, 3]), causal=False)
    with pytest.raises(ValueError, match="query_real"):
        cluster_runs(ids, ids, 2, causal=True, query_real=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="split"):
        cluster_runs(ids, ids, 2, causal=True, split="even")
