"""The clustering-attention family against dense float64 references written from the papers' equations."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from clusterformer.attention import build
from clusterformer.attention.kmeans import vote_buckets
from clusterformer.clustering import (
    angular_lsh_buckets,
    ema_centroid_update,
    euclidean_kmeans,
    greedy_nearest_order,
    hamming_kmeans,
    sign_codes,
    spherical_kmeans,
)
from clusterformer.masks import AttentionMask
from reference import (
    bucket_reference,
    clustered_matrices,
    groups_of,
    masked_softmax_attention,
    run_recorded,
    sliding_reference,
)
from seeds import fixed_seed


def _fresh_seed() -> int:
    return fixed_seed()


def _layer(name, dim=16, heads=2, **options):
    torch.manual_seed(_fresh_seed())
    return build(name, dim=dim, heads=heads, **options).double()


def _split(layer, t):
    return t.view(t.shape[0], layer.heads, layer.head_dim).transpose(0, 1)  # (N, dim) -> (H, N, D)


def _shared_heads(layer, x):
    """qk, v (H, N, D) of a shared-QK layer for one sequence x (N, dim)."""
    qk_w, v_w = layer.to_qkv.weight.split(layer.dim)
    qk_b, v_b = layer.to_qkv.bias.split(layer.dim)
    return _split(layer, x @ qk_w.T + qk_b), _split(layer, x @ v_w.T + v_b)


def _heads(layer, x):
    w_q, w_k, w_v = layer.to_qkv.weight.split(layer.dim)
    b_q, b_k, b_v = layer.to_qkv.bias.split(layer.dim)
    return _split(layer, x @ w_q.T + b_q), _split(layer, x @ w_k.T + b_k), _split(layer, x @ w_v.T + b_v)


def _project_out(layer, heads_out):
    """(H, N, D) -> (N, dim) through the output projection."""
    merged = heads_out.transpose(0, 1).reshape(heads_out.shape[1], layer.dim)
    return merged @ layer.to_out.weight.T + layer.to_out.bias


def _pad_mask(B, N, pad_last):
    pad = torch.zeros(B, N, dtype=torch.bool)
    if pad_last and N > 2:
        pad[-1, N - pad_last:] = True
    return pad


# ---------------------------------------------------------------------------------------------------------
# lsh, routing, kmeans: shared-QK bucket attention


@pytest.mark.parametrize(("N", "bucket_size", "n_hashes", "look_back", "causal", "pad_last"), [
    (16, 4, 2, 1, False, 0), (23, 5, 3, 1, False, 4), (9, 16, 2, 1, False, 0), (30, 4, 2, 2, True, 0),
    (19, 3, 1, 1, True, 5), (1, 4, 2, 1, False, 0),
])
def test_lsh_matches_dense_reference(N, bucket_size, n_hashes, look_back, causal, pad_last):
    # causal chunks differ from bucket_size, so a forward that used the wrong one cannot match the reference
    chunk = bucket_size + 1 if causal else bucket_size
    layer = _layer("lsh", bucket_size=bucket_size, n_hashes=n_hashes, look_back=look_back, causal_chunk_size=chunk,
                   seed=_fresh_seed() % 1000)
    B = 2
    x = torch.randn(B, N, layer.dim, dtype=torch.float64)
    pad = _pad_mask(B, N, pad_last)
    y, buckets = groups_of(layer, x, key_padding_mask=pad if pad_last else None, causal=causal)  # (B, H, R, N)
    n_buckets = layer.options.causal_clusters if causal else layer.inner.buckets_for(N)  # causal: fixed (prefixes)
    assert int(buckets.max()) < n_buckets
    for b in range(B):
        qk, v = _shared_heads(layer, x[b])
        heads = torch.stack([
            bucket_reference(qk[h], v[h], buckets[b, h], min(chunk, N), look_back, causal,
                             pad[b] if pad_last else None, n_buckets)
            for h in range(layer.heads)
        ])
        expected = _project_out(layer, heads)
        real = ~pad[b]
        torch.testing.assert_close(y[b][real], expected[real], atol=1e-10, rtol=1e-8)


def test_lsh_hash_is_argmax_of_rotations():
    layer = _layer("lsh", n_hashes=3, n_buckets=6, seed=7).eval()
    x = torch.randn(1, 20, layer.dim, dtype=torch.float64)
    _, buckets = groups_of(layer, x)
    rotations = layer.inner.rotations(3)  # evaluation: drawn from the seed alone
    qk, _ = _shared_heads(layer, x[0])
    for h in range(layer.heads):
        for r in range(3):
            rotated = qk[h] @ rotations[h, r].double()
            expected = torch.cat([rotated, -rotated], dim=-1).argmax(-1)
            assert torch.equal(buckets[0, h, r], expected)


def test_lsh_buckets_follow_each_sequence_length():
    """n_buckets="auto" per sequence: a 9-token sequence padded beside a 20-token one hashes into its own
    2 * ceil(9 / 8) = 4 buckets with the first 2 columns of the rotations, which are those it gets alone."""
    layer = _layer("lsh", n_hashes=2, bucket_size=4, seed=3).eval()
    x = torch.randn(2, 20, layer.dim, dtype=torch.float64)
    pad = torch.zeros(2, 20, dtype=torch.bool)
    pad[0, 9:] = True
    _, buckets = groups_of(layer, x, key_padding_mask=pad)
    assert layer.inner.buckets_for(9) == 4 and layer.inner.buckets_for(20) == 6
    wide = layer.inner.rotations(3)
    torch.testing.assert_close(wide[..., :2], layer.inner.rotations(2), atol=0, rtol=0)
    for b, n in ((0, 4), (1, 6)):
        qk, _ = _shared_heads(layer, x[b])
        for h in range(layer.heads):
            for r in range(2):
                rotated = qk[h] @ wide[h, r, :, : n // 2]
                expected = torch.cat([rotated, -rotated], dim=-1).argmax(-1)
                real = ~pad[b]
                assert torch.equal(buckets[b, h, r][real], expected[real])


def test_lsh_training_redraws_rotations_and_seed_fixes_them():
    a = _layer("lsh", n_hashes=2, seed=3)
    initial = {k: v.clone() if torch.is_tensor(v) else v for k, v in a.state_dict().items()}
    x = torch.randn(1, 40, a.dim, dtype=torch.float64)
    first = groups_of(a, x)[1]
    assert not torch.equal(first, groups_of(a, x)[1]), "training forwards must draw new rotations"
    b = build("lsh", dim=a.dim, heads=a.heads, n_hashes=2, seed=3).double()
    b.load_state_dict(initial)
    assert torch.equal(first, groups_of(b, x)[1]), "the same seed must give the same first rotations"
    c = build("lsh", dim=a.dim, heads=a.heads, n_hashes=2, seed=3).double()
    c.load_state_dict(a.state_dict())  # the generator state travels with the state_dict
    assert torch.equal(groups_of(a, x)[1], groups_of(c, x)[1])


@pytest.mark.parametrize(("N", "window", "causal", "pad_last"), [(24, 4, False, 0), (17, 5, True, 3), (6, 8, False, 2)])
def test_routing_matches_dense_reference(N, window, causal, pad_last):
    chunk = window - 2 if causal else window  # causal=True chunks by causal_chunk_size
    layer = _layer("routing", num_clusters=3, window_size=window, causal_chunk_size=chunk, seed=1)
    B = 2
    x = torch.randn(B, N, layer.dim, dtype=torch.float64)
    pad = _pad_mask(B, N, pad_last)
    mu = layer.inner.centroids.clone()
    y, aux, groups = run_recorded(layer, x, key_padding_mask=pad if pad_last else None, causal=causal)
    clusters = groups[layer.inner]
    commitment, count = 0.0, 0
    for b in range(B):
        qk, v = _shared_heads(layer, x[b])
        heads = []
        for h in range(layer.heads):
            unit = F.normalize(qk[h], dim=-1)
            ids = (unit @ mu[h].T).argmax(-1)
            assert torch.equal(clusters[b, h][~pad[b]], ids[~pad[b]])
            heads.append(bucket_reference(qk[h], v[h], ids[None], min(chunk, N), 1, causal,
                                          pad[b] if pad_last else None, 3))
            for i in range(N):
                if not pad[b, i] or not pad_last:
                    commitment += float((unit[i] - mu[h, ids[i]]).pow(2).sum().detach())
                    count += 1
        expected = _project_out(layer, torch.stack(heads))
        real = ~pad[b]
        torch.testing.assert_close(y[b][real], expected[real], atol=1e-10, rtol=1e-8)
    assert aux["commitment"].item() == pytest.approx(commitment / count, rel=1e-9)


def test_routing_centroids_follow_ema_of_members_on_the_next_forward():
    layer = _layer("routing", num_clusters=4, decay=0.9, seed=2)
    x = torch.randn(1, 30, layer.dim, dtype=torch.float64)
    before = layer.inner.centroids.clone()
    ids = groups_of(layer, x)[1][0]
    assert torch.equal(layer.inner.centroids, before), "the update is applied at the start of the next forward"
    qk, _ = _shared_heads(layer, x[0])
    expected = before.clone()
    for h in range(layer.heads):
        unit = F.normalize(qk[h], dim=-1)
        for c in range(4):
            members = unit[ids[h] == c]
            if len(members):
                expected[h, c] = F.normalize(0.9 * before[h, c] + 0.1 * members.mean(0), dim=0)
    layer(x)  # applies the pending update first
    torch.testing.assert_close(layer.inner.centroids, expected)
    layer.eval()
    frozen = layer.inner.centroids.clone()
    layer(x)
    layer(x)
    assert torch.equal(layer.inner.centroids, frozen), "evaluation must not move the centroids"


def test_vote_buckets_is_the_mode_in_round_zero_labels():
    m, H, k, D, N = 3, 2, 4, 5, 11
    centroids = F.normalize(torch.randn(m, H, k, D, dtype=torch.float64), dim=-1)
    round_ids = torch.randint(k, (m, 1, H, N))
    got = vote_buckets(round_ids, centroids)
    for h in range(H):
        to0 = [[int((centroids[r, h, c] @ centroids[0, h].T).argmax()) for c in range(k)] for r in range(m)]
        for i in range(N):
            votes = [to0[r][int(round_ids[r, 0, h, i])] for r in range(m)]
            counts = [votes.count(c) for c in range(k)]
            assert int(got[0, h, i]) == counts.index(max(counts))


@pytest.mark.parametrize(("N", "causal", "pad_last"), [(21, False, 0), (26, True, 4), (5, False, 0)])
def test_kmeans_matches_dense_reference(N, causal, pad_last):
    chunk = 3 if causal else 4  # causal=True chunks by causal_chunk_size
    layer = _layer("kmeans", num_clusters=3, n_rounds=3, bucket_size=4, causal_chunk_size=chunk, seed=4)
    B = 2
    x = torch.randn(B, N, layer.dim, dtype=torch.float64)
    pad = _pad_mask(B, N, pad_last)
    mu = layer.inner.centroids.clone()
    y, all_buckets = groups_of(layer, x, key_padding_mask=pad if pad_last else None, causal=causal)
    for b in range(B):
        qk, v = _shared_heads(layer, x[b])
        unit = F.normalize(qk, dim=-1)  # (H, N, D)
        round_ids = torch.stack([(unit @ mu[r].transpose(-1, -2)).argmax(-1) for r in range(3)])  # (m, H, N)
        buckets = vote_buckets(round_ids.unsqueeze(1), mu)[0]
        assert torch.equal(all_buckets[b][:, ~pad[b]], buckets[:, ~pad[b]])
        heads = torch.stack([
            bucket_reference(qk[h], v[h], buckets[h][None], min(chunk, N), 1, causal, pad[b] if pad_last else None,
                             3)
            for h in range(layer.heads)
        ])
        expected = _project_out(layer, heads)
        real = ~pad[b]
        torch.testing.assert_close(y[b][real], expected[real], atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize(("N", "causal", "pad_last"), [(19, True, 0), (23, True, 5), (11, False, 3)])
def test_kmeans_with_one_covering_cluster_is_dense_shared_qk_attention(N, causal, pad_last):
    """One cluster, one round and a chunk holding every key (``look_back=0``) make kmeans dense attention with the
    Reformer's shared-QK rules: keys are the unit queries, a token reads itself only when it has no other key.
    The MQAR curriculum trains the shared-QK mechanisms' stage 1 this way
    (docs/recall-and-aggregation.md#how-the-models-at-n--1024-are-trained-a-length-curriculum)."""
    chunk = 32  # >= N: every real key of a sequence falls in the query's own chunk
    layer = _layer("kmeans", num_clusters=1, num_rounds=1, chunk_size=chunk, causal_chunk_size=chunk, look_back=0)
    B = 2
    x = torch.randn(B, N, layer.dim, dtype=torch.float64)
    pad = _pad_mask(B, N, pad_last)
    y = layer(x, key_padding_mask=pad if pad_last else None, causal=causal)
    for b in range(B):
        qk, v = _shared_heads(layer, x[b])  # (H, N, D)
        scores = qk @ F.normalize(qk, dim=-1).transpose(-1, -2) / math.sqrt(qk.shape[-1])
        allowed = ~pad[b][None, :].expand(N, N)
        if causal:
            allowed = allowed & torch.ones(N, N, dtype=torch.bool).tril()
        others = allowed & ~torch.eye(N, dtype=torch.bool)
        allowed = torch.where(others.any(-1, keepdim=True), others, allowed)  # itself only when nothing else
        expected = _project_out(layer, scores.masked_fill(~allowed, -math.inf).softmax(-1) @ v)
        real = ~pad[b]
        torch.testing.assert_close(y[b][real], expected[real], atol=1e-12, rtol=0)


def test_ema_centroid_update_formula():
    c = F.normalize(torch.randn(2, 3, 4, dtype=torch.float64), dim=-1)
    pts = torch.randn(2, 9, 4, dtype=torch.float64)
    assign = torch.randint(3, (2, 9))
    valid = torch.rand(2, 9) > 0.3
    got = ema_centroid_update(c, pts, assign, decay=0.5, valid=valid)
    for g in range(2):
        for j in range(3):
            members = [F.normalize(pts[g, i], dim=0) for i in range(9) if assign[g, i] == j and valid[g, i]]
            expected = c[g, j] if not members else F.normalize(0.5 * c[g, j] + 0.5 * sum(members) / len(members), dim=0)
            torch.testing.assert_close(got[g, j], expected)


# ---------------------------------------------------------------------------------------------------------
# clustered and improved-clustered


def test_hamming_kmeans_matches_loop_reference():
    G, n, bits, C, iters = 2, 17, 6, 4, 3
    codes = torch.rand(G, n, bits) > 0.5
    valid = torch.rand(G, n) > 0.2
    got = hamming_kmeans(codes, C, iterations=iters, valid=valid)
    for g in range(G):
        x = codes[g].int()
        real = [i for i in range(n) if valid[g, i]]  # seeds: evenly spaced among the valid points
        cent = [x[real[(j * len(real)) // C]].clone() for j in range(C)]

        def assign(cent):
            return [min(range(C), key=lambda j: (int((x[i] != cent[j]).sum()), j)) for i in range(n)]

        a = assign(cent)
        for _ in range(iters):
            for j in range(C):
                members = [i for i in range(n) if a[i] == j and valid[g, i]]
                ones = sum((x[i] for i in members), torch.zeros(bits, dtype=torch.int))
                for b in range(bits):
                    if 2 * ones[b] > len(members):
                        cent[j][b] = 1
                    elif 2 * ones[b] < len(members):
                        cent[j][b] = 0
            a = assign(cent)
        assert got[g].tolist() == a


@pytest.mark.parametrize(("G", "n", "d", "C", "iters"), [(2, 17, 3, 4, 3), (1, 9, 5, 9, 2), (3, 30, 4, 7, 6)])
def test_euclidean_kmeans_matches_loop_reference(G, n, d, C, iters):
    points = torch.randn(G, n, d, dtype=torch.float64)
    valid = torch.rand(G, n) > 0.2
    # at least C valid points, so the seeds are distinct points: with repeated seeds two centroids coincide and
    # which of them takes a point is up to the matmul's rounding (an equivalent partition, other labels)
    valid[:, torch.randperm(n)[:C]] = True
    got = euclidean_kmeans(points, C, iterations=iters, valid=valid)
    for g in range(G):
        x = points[g]
        real = [i for i in range(n) if valid[g, i]] or list(range(n))  # seeds: evenly spaced valid points
        cent = [x[real[(j * len(real)) // C]].clone() for j in range(C)]

        def assign(cent):
            return [min(range(C), key=lambda j: (float(((x[i] - cent[j]) ** 2).sum()), j)) for i in range(n)]

        a = assign(cent)
        for _ in range(iters):
            for j in range(C):
                members = [i for i in range(n) if a[i] == j and valid[g, i]]
                if members:
                    cent[j] = sum(x[i] for i in members) / len(members)
            a = assign(cent)
        assert got[g].tolist() == a


def test_euclidean_kmeans_recovers_planted_clusters_and_ignores_padding():
    G, per, C, d = 3, 12, 4, 6
    centres = torch.randn(G, C, d, dtype=torch.float64) * 10
    # contiguous blocks, so the evenly spaced seeds start one per planted cluster (Lloyd from seeds that share
    # a cluster can stop in a local minimum -- that is K-means, not a bug)
    truth = torch.arange(C * per) // per
    points = centres[:, truth] + 0.1 * torch.randn(G, C * per, d, dtype=torch.float64)
    groups = euclidean_kmeans(points, C, iterations=10)
    for g in range(G):  # the partition is the planted one (labels may be permuted)
        pairs = set(zip(groups[g].tolist(), truth.tolist(), strict=True))
        assert len(pairs) == C and len({a for a, _ in pairs}) == C
    padded = torch.cat([points, 1e3 * torch.randn(G, 5, d, dtype=torch.float64)], 1)
    valid = torch.ones(G, C * per + 5, dtype=torch.bool)
    valid[:, C * per:] = False
    torch.testing.assert_close(euclidean_kmeans(padded, C, iterations=10, valid=valid)[:, : C * per], groups,
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match="points"):
        euclidean_kmeans(torch.randn(5, 3), 2)


@pytest.mark.parametrize("name", ["clustered", "improved-clustered"])
def test_euclidean_query_clustering_clusters_the_queries_and_matches_the_reference(name):
    options = {"clusters": 4, "iterations": 4, "query_clustering": "euclidean"}
    if name == "improved-clustered":
        options["topk"] = 3
    layer = _layer(name, **options)
    N, B = 19, 2
    x = torch.randn(B, N, layer.dim, dtype=torch.float64)
    pad = _pad_mask(B, N, 4)
    y, layer_groups = groups_of(layer, x, key_padding_mask=pad)
    for b in range(B):
        q, k, v = _heads(layer, x[b])
        groups = euclidean_kmeans(q, 4, iterations=4, valid=(~pad[b]).expand(layer.heads, N))
        real = ~pad[b]  # padded queries are not clustered from x (their outputs are zero)
        assert torch.equal(layer_groups[b][:, real], groups[:, real])
        which = 2 if "topk" in options else 1  # A^t for improved, A^c broadcast for plain
        heads = [clustered_matrices(q[h], k[h], groups[h], 4, options.get("topk"), pad[b])[which] @ v[h]
                 for h in range(layer.heads)]
        expected = _project_out(layer, torch.stack(heads))
        torch.testing.assert_close(y[b][real], expected[real], atol=1e-10, rtol=1e-8)
    longer = torch.cat([x, torch.randn(B, 6, layer.dim, dtype=torch.float64)], 1)
    longer_pad = torch.cat([pad, torch.ones(B, 6, dtype=torch.bool)], 1)
    torch.testing.assert_close(layer(longer, key_padding_mask=longer_pad)[:, :N][~pad], y[~pad], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="query_clustering"):
        build(name, dim=16, heads=2, query_clustering="cosine")


def test_sign_codes():
    x = torch.randn(1, 2, 5, 3, dtype=torch.float64)
    planes = torch.randn(2, 3, 4)
    codes = sign_codes(x, planes)
    for h in range(2):
        assert torch.equal(codes[0, h], (x[0, h] @ planes[h].double()) > 0)


# The exact top-k part of improved clustered has two implementations (a masked dense attention for short
# sequences, cluster-aligned chunks for long ones); DENSE_TOPK_FACTOR picks between them, so forcing it to 0
# (always chunked) or to a huge value (always dense) tests both on every size.
EXACT_PATHS = {"chunked": 0, "dense": 10**9}


@pytest.mark.parametrize("improved", ["", "chunked", "dense"])
@pytest.mark.parametrize(("N", "clusters", "topk", "pad_last"),
                         [(20, 4, 3, 0), (13, 5, 4, 3), (7, 10, 2, 0), (33, 3, 8, 6), (70, 4, 3, 5)])
def test_clustered_matches_dense_reference(improved, N, clusters, topk, pad_last, monkeypatch):
    from clusterformer.ops import clustered as clustered_ops

    if improved:
        monkeypatch.setattr(clustered_ops, "DENSE_TOPK_FACTOR", EXACT_PATHS[improved])
    name = "improved-clustered" if improved else "clustered"
    options = {"clusters": clusters, "bits": 8, "iterations": 3, "seed": 5}
    if improved:
        options["topk"] = topk
    layer = _layer(name, **options)
    B = 2
    x = torch.randn(B, N, layer.dim, dtype=torch.float64)
    pad = _pad_mask(B, N, pad_last)
    y, layer_groups = groups_of(layer, x, key_padding_mask=pad if pad_last else None)
    C = min(clusters, N)
    # The query clusters, recomputed here from the definition (section 3.2.2): per head, the signs of the
    # *queries* projected on that head's planes, drawn from the layer's seed, then Hamming k-means (itself
    # tested against a loop reference). A wiring bug (hashing K, another head's planes) fails here.
    planes = torch.randn(layer.heads, layer.head_dim, 8, generator=torch.Generator().manual_seed(5))
    for b in range(B):
        q, k, v = _heads(layer, x[b])
        heads = []
        for h in range(layer.heads):
            codes = (q[h] @ planes[h].double()) > 0
            valid = None if not pad_last else ~pad[b][None]
            groups = hamming_kmeans(codes[None], clusters, iterations=3, valid=valid)[0]
            real = ~pad[b]
            assert torch.equal(layer_groups[b, h][real], groups[real])
            _, a_c, a_t = clustered_matrices(q[h], k[h], groups, C, topk if improved else None,
                                             pad[b] if pad_last else None)
            heads.append((a_t if improved else a_c) @ v[h])
        expected = _project_out(layer, torch.stack(heads))
        real = ~pad[b]
        torch.testing.assert_close(y[b][real], expected[real], atol=1e-10, rtol=1e-8)


def _full_twin(layer):
    full = build("full", dim=layer.dim, heads=layer.heads).double()
    full.to_qkv.load_state_dict(layer.to_qkv.state_dict())
    full.to_out.load_state_dict(layer.to_out.state_dict())
    return full


@pytest.mark.parametrize(("N", "pad_last"), [(9, 0), (31, 5), (64, 0)])
@pytest.mark.parametrize("exact_path", sorted(EXACT_PATHS))
def test_improved_clustered_with_topk_at_least_n_is_full_attention(N, pad_last, exact_path, monkeypatch):
    from clusterformer.ops import clustered as clustered_ops

    monkeypatch.setattr(clustered_ops, "DENSE_TOPK_FACTOR", EXACT_PATHS[exact_path])
    layer = _layer("improved-clustered", clusters=3, topk=N + 3)
    x = torch.randn(2, N, layer.dim, dtype=torch.float64)
    pad = _pad_mask(2, N, pad_last) if pad_last else None
    expected = _full_twin(layer)(x, key_padding_mask=pad)
    torch.testing.assert_close(layer(x, key_padding_mask=pad), expected, atol=1e-10, rtol=0)  # float64


@pytest.mark.parametrize("N", [6, 25])
def test_clustered_with_one_cluster_per_query_is_full_attention(N):
    layer = _layer("clustered", clusters=N, bits=62, iterations=2)
    x = torch.randn(2, N, layer.dim, dtype=torch.float64)
    y, layer_groups = groups_of(layer, x)
    for b in range(2):
        for h in range(layer.heads):
            assert len(set(layer_groups[b, h].tolist())) == N, "random 62-bit codes should be distinct"
    torch.testing.assert_close(y, _full_twin(layer)(x), atol=1e-10, rtol=0)  # float64


def _attention_matrix(name, w_q, w_k, seed, **options):
    """The (N, N) attention matrix a library layer computes: with dim = N, V = identity, identity output
    projection, no biases and x = I (so Q = W_q, K = W_k), the layer's output *is* its attention matrix."""
    N = w_q.shape[0]
    layer = build(name, dim=N, heads=1, seed=seed, **options).double() if options else build(
        name, dim=N, heads=1).double()
    with torch.no_grad():
        layer.to_qkv.weight.copy_(torch.cat([w_q.T, w_k.T, torch.eye(N, dtype=torch.float64)]))
        layer.to_qkv.bias.zero_()
        layer.to_out.weight.copy_(torch.eye(N, dtype=torch.float64))
        layer.to_out.bias.zero_()
    out, groups = groups_of(layer, torch.eye(N, dtype=torch.float64)[None])
    return out[0], groups


@pytest.mark.parametrize("trial", range(5))
def test_proposition_2_improved_is_closer_to_full_than_clustered(trial):
    """Proposition 2 of the clustered-attention paper, on matrices computed by the library's layers: with the
    same query clusters, every row of improved clustered attention is at least as close (L1) to full
    attention as clustered attention's row."""
    N, D = 40, 8
    g = torch.Generator().manual_seed(100 + trial)
    # rows of W are the queries / keys (x = I); D informative columns, the rest zero
    w_q = torch.zeros(N, N, dtype=torch.float64)
    w_k = torch.zeros(N, N, dtype=torch.float64)
    w_q[:, :D] = 2 * torch.randn(N, D, generator=g, dtype=torch.float64)
    w_k[:, :D] = 2 * torch.randn(N, D, generator=g, dtype=torch.float64)
    options = {"clusters": 5, "bits": 8, "iterations": 5}
    full, _ = _attention_matrix("full", w_q, w_k, seed=None)
    a_c, groups_c = _attention_matrix("clustered", w_q, w_k, seed=trial, **options)
    a_t, groups_t = _attention_matrix("improved-clustered", w_q, w_k, seed=trial, topk=6, **options)
    assert torch.equal(groups_c, groups_t), "same seed and options must give the same query clusters"
    assert len(set(groups_c.flatten().tolist())) > 1
    torch.testing.assert_close(full.sum(-1), torch.ones(N, dtype=torch.float64), atol=1e-12, rtol=0)
    err_t = (a_t - full).abs().sum(-1)
    err_c = (a_c - full).abs().sum(-1)
    assert torch.all(err_t <= err_c + 1e-12)
    assert torch.any(err_t < err_c - 1e-6), "top-k should strictly help somewhere"


@pytest.mark.parametrize("name", ["clustered", "improved-clustered"])
def test_clustered_refuses_causal(name):
    layer = build(name, dim=16, heads=2)
    with pytest.raises(ValueError, match="causal"):
        layer(torch.randn(1, 5, 16), causal=True)


# ---------------------------------------------------------------------------------------------------------
# sliding-window and cluster-former


@pytest.mark.parametrize(("N", "window", "stride", "causal", "pad_last"), [
    (20, 8, 4, False, 0), (23, 8, 5, True, 3), (5, 8, 4, False, 0), (16, 4, 4, False, 2), (17, 6, 1, True, 0),
    (30, 8, 4, False, 17), (40, 8, 3, True, 31),  # padding long enough to add windows of the padded length
])
def test_sliding_window_matches_dense_reference(N, window, stride, causal, pad_last):
    layer = _layer("sliding-window", window=window, stride=stride)
    x = torch.randn(2, N, layer.dim, dtype=torch.float64)
    pad = _pad_mask(2, N, pad_last)
    y = layer(x, key_padding_mask=pad if pad_last else None, causal=causal)
    for b in range(2):
        q, k, v = _heads(layer, x[b])
        heads = torch.stack([sliding_reference(q[h], k[h], v[h], window, stride, causal, pad[b] if pad_last else None)
                             for h in range(layer.heads)])
        expected = _project_out(layer, heads)
        real = ~pad[b]
        torch.testing.assert_close(y[b][real], expected[real], atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize(("N", "causal", "pad_last"), [(30, False, 0), (27, True, 4), (7, False, 0)])
def test_cluster_former_matches_dense_reference(N, causal, pad_last):
    layer = _layer("cluster-former", num_clusters=4, window=6, stride=3, memory_size=50, update_every=2)
    x = torch.randn(2, N, layer.dim, dtype=torch.float64)
    pad = _pad_mask(2, N, pad_last)
    layer(torch.randn(2, N, layer.dim, dtype=torch.float64))  # a training step fills the bank, sets centroids
    layer.eval()
    y = layer(x, key_padding_mask=pad if pad_last else None, causal=causal)
    centroids = layer.inner.centroids
    for b in range(2):
        sims = F.normalize(x[b], dim=-1) @ F.normalize(centroids, dim=-1).T
        ids = [4 if (pad_last and pad[b, i]) else int(sims[i].argmax()) for i in range(N)]
        order = sorted(range(N), key=lambda i: (ids[i], i))
        q, k, v = _heads(layer, x[b])
        p = pad[b][order] if pad_last else None
        heads_sorted = torch.stack([
            sliding_reference(q[h][order], k[h][order], v[h][order], 6, 3, causal, p, positions=order)
            for h in range(layer.heads)
        ])
        heads = torch.empty_like(heads_sorted)
        heads[:, order] = heads_sorted
        expected = _project_out(layer, heads)
        real = ~pad[b]
        torch.testing.assert_close(y[b][real], expected[real], atol=1e-10, rtol=1e-8)


def test_cluster_former_memory_bank_is_a_fifo_and_centroids_refresh_on_schedule():
    layer = build("cluster-former", dim=8, heads=2, num_clusters=2, memory_size=10, update_every=3)
    a, b = torch.randn(1, 6, 8), torch.randn(1, 7, 8)
    layer(a)
    assert int(layer.inner.memory_filled) == 6 and bool(layer.inner.centroids_ready)
    first = layer.inner.centroids.clone()
    layer(b)  # 13 states into a bank of 10: the 3 oldest fall out
    assert int(layer.inner.memory_filled) == 10
    kept = torch.cat([a[0, 3:], b[0]])
    bank, next_slot = layer.inner.memory, int(layer.inner.memory_next)
    stored = torch.cat([bank[next_slot:], bank[:next_slot]])
    torch.testing.assert_close(stored, kept)
    assert torch.equal(layer.inner.centroids, first), "step 2 of update_every=3 must not refresh"
    layer(b)
    assert not torch.equal(layer.inner.centroids, first), "step 3 must refresh"
    state = layer.state_dict()
    assert {f"inner.{name}" for name in ("centroids", "memory", "memory_filled", "memory_next", "steps")} <= set(state)
    twin = build("cluster-former", dim=8, heads=2, num_clusters=2, memory_size=10, update_every=3)
    twin.load_state_dict(state)
    twin.eval()
    layer.eval()
    torch.testing.assert_close(twin(a), layer(a))


def test_cluster_former_padding_is_not_remembered():
    layer = build("cluster-former", dim=8, heads=2, num_clusters=2, memory_size=100)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, 2:] = True
    layer(torch.randn(2, 5, 8), key_padding_mask=pad)
    assert int(layer.inner.memory_filled) == 7


def test_greedy_nearest_order_chains_by_cosine():
    c = F.normalize(torch.randn(7, 5, dtype=torch.float64), dim=-1)
    got = greedy_nearest_order(c)
    chain, left = [0], set(range(1, 7))
    while left:
        nxt = max(left, key=lambda j: float(c[chain[-1]] @ c[j]))
        chain.append(nxt)
        left.remove(nxt)
    torch.testing.assert_close(got, c[chain])


def test_spherical_kmeans_recovers_planted_directions():
    g = torch.Generator().manual_seed(0)
    directions = F.normalize(torch.randn(3, 16, generator=g), dim=-1)
    points = torch.cat([d + 0.05 * torch.randn(50, 16, generator=g) for d in directions])
    found = spherical_kmeans(points, 3, iterations=20, generator=torch.Generator().manual_seed(1))
    best = (found @ directions.T).max(0).values
    assert torch.all(best > 0.99), best


def test_angular_lsh_buckets_shapes_and_range():
    x = torch.randn(2, 3, 10, 4)
    rot = torch.randn(3, 5, 4, 4)
    b = angular_lsh_buckets(x, rot)
    assert b.shape == (2, 3, 5, 10) and int(b.max()) < 8 and int(b.min()) >= 0


def test_merge_rounds_is_exact_attention_over_the_union_of_disjoint_rounds():
    # Two rounds that see disjoint key sets merge into attention over their union (the lse weighting).
    N, D = 6, 4
    q = torch.randn(N, D, dtype=torch.float64)
    k = torch.randn(N, D, dtype=torch.float64)
    v = torch.randn(N, D, dtype=torch.float64)
    from clusterformer.ops import merge_rounds
    halves = [torch.arange(N) < 3, torch.arange(N) >= 3]
    outs, lses = [], []
    for keep in halves:
        allowed = keep.expand(N, N)
        outs.append(masked_softmax_attention(q, k, v, allowed))
        lses.append(torch.logsumexp((q @ k.T / math.sqrt(D)).masked_fill(~allowed, float("-inf")), -1))
    merged = merge_rounds(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(merged, masked_softmax_attention(q, k, v, torch.ones(N, N, dtype=torch.bool)))


@pytest.mark.parametrize("exact_path", sorted(EXACT_PATHS))
def test_gradcheck_of_the_family_ops(exact_path, monkeypatch):
    from clusterformer.ops import bucketed_attention, clustered_attention, sliding_window_attention
    from clusterformer.ops import clustered as clustered_ops

    monkeypatch.setattr(clustered_ops, "DENSE_TOPK_FACTOR", EXACT_PATHS[exact_path])

    g = torch.Generator().manual_seed(0)
    B, H, N, D = 1, 2, 9, 3
    q, k, v = (torch.randn(B, H, N, D, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(3))
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[0, -2:] = True
    buckets = torch.randint(3, (B, H, 2, N), generator=g)
    groups = torch.randint(3, (B, H, N), generator=g)
    assert torch.autograd.gradcheck(
        lambda a, b: bucketed_attention(a, b, buckets, 3, num_buckets=3, mask=AttentionMask(pad, causal=True)),
        (q, v))
    assert torch.autograd.gradcheck(
        lambda a, b, c: clustered_attention(a, b, c, groups, 3, topk=4, mask=AttentionMask(pad)), (q, k, v))
    assert torch.autograd.gradcheck(
        lambda a, b, c: sliding_window_attention(a, b, c, 4, 2, mask=AttentionMask(pad, causal=True)), (q, k, v))


@pytest.mark.parametrize("name", ["cluster-retrieval", "sink-window", "oracle", "quest"])
@pytest.mark.parametrize("causal", [False, True])
def test_cache_readers_attend_a_sequence_to_itself_densely_and_refuse_native_decoding(name, causal):
    """The cache readers change how a decoder reads its cache (hf); a sequence's attention to
    itself -- a prefill -- is full attention, exactly (float64, padding in the middle, a budget of 3 keys that would
    bite if it applied). Native cached decoding would step sparsely where the forward is dense: refused."""
    g = torch.Generator().manual_seed(fixed_seed())
    q, k, v = (torch.randn(2, 3, 19, 5, generator=g, dtype=torch.float64) for _ in range(3))
    pad = torch.zeros(2, 19, dtype=torch.bool)
    pad[1, 4:7] = True
    pad[1, 15:] = True
    inner = build(name, dim=15, heads=3, budget=3).inner.double().eval()
    want = build("full", dim=15, heads=3).inner.double().eval()(q, k, v, AttentionMask(pad, causal))
    got = inner(q, k, v, AttentionMask(pad, causal))
    real = ~pad[:, None, :, None]
    torch.testing.assert_close(got * real, want * real, rtol=0, atol=1e-12)
    assert (want - inner(q, k, v, AttentionMask(None, causal))).abs().max() > 1e-3  # the padding mattered
    with pytest.raises(ValueError, match="no cached decoding"):
        inner.prefill(q, k, v, AttentionMask(causal=True))


@pytest.mark.parametrize("name", ["cluster-retrieval", "sink-window", "oracle", "quest"])
def test_lower_layers_read_their_own_budget(name):
    """lower_layers=2, lower_budget=20 over budget=6: a decoding step of layers 0-1 reads up to 20 keys and of
    layers 2+ up to 6, each key counted by one-hot values (a key read puts weight on its own coordinate); layer 1
    at 20 equals the mechanism built with budget=20. A layer's number is required, as for dense_layers."""
    g = torch.Generator().manual_seed(fixed_seed())
    n = 48
    q, k = (torch.randn(1, s, 1 if s == 4 else n, 8, generator=g, dtype=torch.float64) for s in (4, 2))
    v = torch.eye(n, dtype=torch.float64).expand(1, 2, n, n)
    extra = {"num_clusters": 4, "window": 3, "sink": 2} if name == "cluster-retrieval" else {}
    layered = build(name, dim=16, heads=4, budget=6, lower_layers=2, lower_budget=20, **extra).inner.double()
    with pytest.raises(ValueError, match="layer is required when lower_layers=2"):
        layered.attend_cache(q, k, v, None, 0.3)
    read = {layer: (layered.attend_cache(q, k, v, None, 0.3, layer=layer)[0] > 0).sum(-1) for layer in (0, 1, 2, 7)}
    for layer, keys in read.items():
        assert int(keys.max()) <= (20 if layer < 2 else 6), (layer, keys)
    assert int(read[1].min()) > 6 and int(read[2].max()) >= 5  # each budget used, not only bounded
    plain = build(name, dim=16, heads=4, budget=20, **extra).inner.double()
    torch.testing.assert_close(layered.attend_cache(q, k, v, None, 0.3, layer=1)[0],
                               plain.attend_cache(q, k, v, None, 0.3)[0], rtol=0, atol=1e-12)
    for bad in ({"lower_layers": 2}, {"lower_budget": 0.2}, {"lower_layers": 1, "lower_budget": 1.5}):
        with pytest.raises(ValueError, match="lower_"):
            build(name, dim=16, heads=4, **bad)


def test_cache_reader_needs_the_layer_for_dense_layers():
    inner = build("cluster-retrieval", dim=8, heads=2, budget=2, dense_layers=1).inner
    q, k, v = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 9, 4), torch.randn(1, 2, 9, 4)
    with pytest.raises(ValueError, match="layer is required when dense_layers=1"):
        inner.attend_cache(q, k, v, None, 0.5)
    out, index = inner.attend_cache(q, k, v, None, 0.5, layer=0)  # layer 0 of 1 dense layer: dense, no index
    assert index is None
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, scale=0.5), rtol=0, atol=1e-6)
