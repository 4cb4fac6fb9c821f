"""The registered attention layers against dense float64 references written from the paper's equations."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from clusterformer.attention import build, collect_aux_losses, describe, fitting_centroids, names, record_groups
from clusterformer.clustering.kmeans import spherical_kmeans
from clusterformer.masks import CAUSAL_MASK
from clusterformer.ops.listed_attention import extension_available
from reference import (
    cluster_causal_allowed,
    groups_of,
    masked_softmax_attention,
    run_recorded,
    sorted_chunk_allowed,
    water_filled,
)
from seeds import fixed_seed

_fused_ready = pytest.mark.skipif(not extension_available(), reason="cluster-select's fused kernel is not built here")
FUSED = pytest.param("fused", marks=_fused_ready)  # cluster-select's C++ kernel
# cluster-select's own group and sink, on by default in version 2 of its defaults: off where a test names the
# configuration before them (its references add them only when asked)
OFF = {"own_group": False, "sink": 0}


def _layer(name, dim=16, heads=2, **options):
    torch.manual_seed(fixed_seed())
    return build(name, dim=dim, heads=heads, **options).double()


def _heads(layer, x):
    """Q, K, V of a layer, (H, N, D) each, for one sequence x (N, dim) -- straight from the weights."""
    w_q, w_k, w_v = layer.to_qkv.weight.split(layer.dim)
    b_q, b_k, b_v = layer.to_qkv.bias.split(layer.dim)
    split = lambda t: t.view(-1, layer.heads, layer.head_dim).transpose(0, 1)  # noqa: E731
    return split(x @ w_q.T + b_q), split(x @ w_k.T + b_k), split(x @ w_v.T + b_v)


def _reference_output(layer, x, allowed):
    """Per-head masked softmax attention with a given (N, N) allowed mask, then the output projection."""
    q, k, v = _heads(layer, x)
    heads = torch.stack([masked_softmax_attention(q[h], k[h], v[h], allowed) for h in range(layer.heads)])
    merged = heads.transpose(0, 1).reshape(x.shape[0], layer.dim)
    return merged @ layer.to_out.weight.T + layer.to_out.bias


def _shared_qk_output(layer, x, allowed):
    """The shared-QK form of :func:`_reference_output`: one projection for queries and keys, keys scaled to unit
    length per head, and a query's own key allowed only when no other key is."""
    w_qk, w_v = layer.to_qkv.weight.split(layer.dim)
    b_qk, b_v = layer.to_qkv.bias.split(layer.dim)
    split = lambda t: t.view(-1, layer.heads, layer.head_dim).transpose(0, 1)  # noqa: E731
    qk, v = split(x @ w_qk.T + b_qk), split(x @ w_v.T + b_v)
    keys = qk / qk.norm(dim=-1, keepdim=True)
    N = x.shape[0]
    others = allowed & ~torch.eye(N, dtype=torch.bool)
    allowed = torch.where(others.any(1, keepdim=True), others, allowed)
    heads = torch.stack([masked_softmax_attention(qk[h], keys[h], v[h], allowed) for h in range(layer.heads)])
    return heads.transpose(0, 1).reshape(N, layer.dim) @ layer.to_out.weight.T + layer.to_out.bias


def _padded_inside_and_at_the_end(B, N, dim):
    """x (B, N, dim) float64 and its padding: sequence 1 padded at the end, sequence 2 inside (when N > 4), so that
    some queries' local blocks and some clusters hold no other real key."""
    x = torch.randn(B, N, dim, dtype=torch.float64)
    pad = torch.zeros(B, N, dtype=torch.bool)
    if N > 4:
        pad[1, -2:] = True
        pad[2, 1:3] = True
    return x, pad


def _reference_clustering(layer, x, real, strict):
    """Eqs. 2-4, 6, 11 with cosine phi, for one sequence x (N, dim) whose real tokens are ``real``."""
    scale = layer.options.similarity_scale
    N = x.shape[0]
    o = layer.options
    L = int(real.sum())  # the sequence's own length, not the padded N
    # strict causal mode: k and the block size are fixed options (prefix invariance); otherwise from L
    k = (o.num_clusters if o.num_clusters != "sqrt" else min(o.causal_clusters, o.max_clusters)) if strict else (
        o.clusters_for(L))
    C = layer.inner.centroids[:k]
    if o.cluster_on == "shared-qk":  # the shared query/key projection, heads side by side
        P = x @ layer.to_qkv.weight[:layer.dim].T + layer.to_qkv.bias[:layer.dim]
    else:
        P = x @ layer.inner.to_cluster.weight.T  # X W^C
    phi = torch.zeros(k, N, dtype=x.dtype)
    for i in range(k):
        for j in range(N):
            phi[i, j] = F.cosine_similarity(C[i], P[j], dim=0)
    logits = (scale * phi).masked_fill(~real, float("-inf"))
    U = torch.softmax(logits, dim=1)  # eq. 2: normalised over positions
    C_hat = U @ P  # eq. 3
    ids = (phi if strict else U).argmax(0)  # eq. 4 (strict: nearest centroid)
    if strict and o.causal_assign == "prefix":  # eq. 4 with U normalised over the real positions up to j
        for j in range(N):
            earlier = torch.logsumexp(logits[:, : j + 1], dim=1)  # (k,); padding is -inf
            ids[j] = (scale * phi[:, j] - earlier).argmax()
    ids = torch.where(real, ids, torch.full_like(ids, k))
    reals = [j for j in range(N) if real[j]]
    L1 = -sum(F.cosine_similarity(P[j], C_hat[ids[j]], dim=0) for j in reals) / len(reals)  # eq. 6
    ring = sum(F.cosine_similarity(C_hat[i], C_hat[i - 1], dim=0) for i in range(1, k))
    L2 = -(ring + F.cosine_similarity(C_hat[0], C_hat[k - 1], dim=0)) / k  # eq. 11
    return ids, L1, L2, o.causal_chunk_size if strict else max(1, math.ceil(L / k))


@pytest.mark.parametrize(("N", "num_clusters", "look_back"), [(12, 3, 1), (13, 4, 1), (10, 3, 2), (9, "sqrt", 1),
                                                              (13, "sqrt", 1), (5, 8, 1), (1, 2, 1)])
@pytest.mark.parametrize("mode", ["none", "paper", "strict"])
def test_neural_clustering_matches_paper_equations(N, num_clusters, look_back, mode):
    layer = _layer("neural-clustering", num_clusters=num_clusters, look_back=look_back,
                   causal_mode="strict" if mode == "strict" else "paper", causal_clusters=3, causal_chunk_size=2)
    B = 3
    x = torch.randn(B, N, layer.dim, dtype=torch.float64)
    pad = torch.zeros(B, N, dtype=torch.bool)
    if N > 2:
        pad[1, -2:] = True  # a padded sequence next to full ones
    causal = mode != "none"
    y, aux, _ = run_recorded(layer, x, key_padding_mask=pad, causal=causal)
    L1s, L2s = [], []
    for b in range(B):
        real = ~pad[b]
        ids, L1, L2, chunk = _reference_clustering(layer, x[b] * real[:, None], real, strict=mode == "strict")
        if mode == "strict":
            allowed = cluster_causal_allowed(ids, chunk, look_back, pad[b])
        else:
            allowed = sorted_chunk_allowed(ids, chunk, look_back, causal, pad[b])
        ref = _reference_output(layer, x[b] * real[:, None], allowed)
        torch.testing.assert_close(y[b][real], ref[real], rtol=1e-9, atol=1e-9)
        assert (y[b][~real] == 0).all()
        L1s.append(L1)
        L2s.append(L2)
    # L1 is the mean over all real tokens of the batch, L2 the mean over sequences.
    counts = (~pad).sum(1).double()
    torch.testing.assert_close(aux["clustering"], (torch.stack(L1s) * counts).sum() / counts.sum())
    torch.testing.assert_close(aux["centroid_sorting"], torch.stack(L2s).mean())


def _local_allowed(N, block, causal, pad):
    """Keys in the query's position block of ``block`` or the one before (not after it under a causal mask)."""
    allowed = torch.zeros(N, N, dtype=torch.bool)
    for i in range(N):
        for j in range(N):
            allowed[i, j] = 0 <= i // block - j // block <= 1 and not bool(pad[j]) and not (causal and j > i)
    return allowed


@pytest.mark.parametrize(("N", "num_clusters", "local_window"), [(13, 3, 4), (20, 4, 6), (9, "sqrt", 2), (5, 2, 8)])
@pytest.mark.parametrize("mode", ["none", "paper", "strict"])
def test_neural_clustering_local_window_is_the_union_of_clusters_and_local_blocks(N, num_clusters, local_window, mode):
    """With ``local_window`` a query attends, in one softmax, to the union of its cluster chunks (eqs. 8-9) and
    its local blocks, each key once: the dense reference's allowed mask is the OR of the two masks."""
    layer = _layer("neural-clustering", num_clusters=num_clusters, causal_clusters=3, causal_chunk_size=2,
                   causal_mode="strict" if mode == "strict" else "paper", local_window=local_window)
    B = 3
    x = torch.randn(B, N, layer.dim, dtype=torch.float64)
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[1, -2:] = True
    pad[2, 1:3] = True  # padding inside a sequence must not shift its position blocks
    causal = mode != "none"
    y, _, _ = run_recorded(layer, x, key_padding_mask=pad, causal=causal)
    overlap = 0
    for b in range(B):
        real = ~pad[b]
        ids, _, _, chunk = _reference_clustering(layer, x[b] * real[:, None], real, strict=mode == "strict")
        if mode == "strict":
            clusters = cluster_causal_allowed(ids, chunk, 1, pad[b])
        else:
            clusters = sorted_chunk_allowed(ids, chunk, 1, causal, pad[b])
        local = _local_allowed(N, local_window // 2, causal, pad[b])
        overlap += int((clusters & local)[real].sum())
        ref = _reference_output(layer, x[b] * real[:, None], clusters | local)
        torch.testing.assert_close(y[b][real], ref[real], rtol=1e-10, atol=1e-10)
        assert (y[b][~real] == 0).all()
    assert overlap > 0, "the case has keys in both sets: counting them twice would change the output"


@pytest.mark.parametrize(("N", "num_clusters", "local_window"), [
    (13, 3, 0), (12, 2, 0), (13, 3, 4), (20, 4, 2), (9, "sqrt", 6), (9, 3, 6), (13, 3, 6), (9, "sqrt", 2), (1, 2, 2)])
@pytest.mark.parametrize("mode", ["none", "paper", "strict"])
def test_neural_clustering_on_shared_qk_matches_dense_reference(N, num_clusters, local_window, mode):
    """``cluster_on="shared-qk"``: the tokens are clustered by the layer's shared query/key projection (eqs. 2-4
    with P = x W^QK), attention reads unit keys, and a query's own key counts only when it has no other key in
    the union of its cluster chunks and local blocks. Padding in the middle and at the end, so that some
    queries' local blocks hold no other real key."""
    layer = _layer("neural-clustering", num_clusters=num_clusters, causal_clusters=3, causal_chunk_size=2,
                   causal_mode="strict" if mode == "strict" else "paper", local_window=local_window,
                   cluster_on="shared-qk")
    assert layer.to_qkv.weight.shape[0] == 2 * layer.dim and layer.inner.to_cluster is None
    B = 3
    x, pad = _padded_inside_and_at_the_end(B, N, layer.dim)
    causal = mode != "none"
    y, aux, _ = run_recorded(layer, x, key_padding_mask=pad, causal=causal)
    L1s = []
    for b in range(B):
        real = ~pad[b]
        ids, L1, _, chunk = _reference_clustering(layer, x[b] * real[:, None], real, strict=mode == "strict")
        L1s.append(L1)
        if mode == "strict":
            allowed = cluster_causal_allowed(ids, chunk, 1, pad[b])
        else:
            allowed = sorted_chunk_allowed(ids, chunk, 1, causal, pad[b])
        if local_window:
            allowed = allowed | _local_allowed(N, local_window // 2, causal, pad[b])
        ref = _shared_qk_output(layer, x[b] * real[:, None], allowed)
        torch.testing.assert_close(y[b][real], ref[real], rtol=1e-10, atol=1e-10)
        assert (y[b][~real] == 0).all()
    counts = (~pad).sum(1).double()  # eq. 6 on P = x W^QK, the mean over the batch's real tokens
    torch.testing.assert_close(aux["clustering"], (torch.stack(L1s) * counts).sum() / counts.sum())
    # the clustering losses train the centroids, never the attention's shared projection
    layer.zero_grad()
    losses = run_recorded(layer, x, key_padding_mask=pad, causal=causal)[1]
    (losses["clustering"] + losses["centroid_sorting"]).backward()
    assert layer.to_qkv.weight.grad is None or not layer.to_qkv.weight.grad.any()
    if N > 1:  # (one token is its own C_hat whatever C is)
        assert layer.inner.centroids.grad is not None and layer.inner.centroids.grad.any()


def _losses_reference(o, C, q, kk, real, k):
    """The paper's two losses' terms for centroids C (k, E) over the points they are fitted to: the real queries
    and keys q, kk (N, E) (2 L points), or the real keys alone (L)."""
    points = kk[real] if o.centroid_fit == "keys" else torch.cat([q[real], kk[real]])
    U = torch.softmax(o.similarity_scale * F.cosine_similarity(C[:, None], points[None], dim=-1), dim=1)
    C_hat = U @ points  # eqs. 2-3 over the points
    ids = F.cosine_similarity(points[:, None], C[None], dim=-1).argmax(1)
    l1 = [-F.cosine_similarity(points[j], C_hat[ids[j]], dim=0) for j in range(len(points))]
    ring = sum(F.cosine_similarity(C_hat[i], C_hat[i - 1], dim=0) for i in range(1, k))
    return l1, -(ring + F.cosine_similarity(C_hat[0], C_hat[k - 1], dim=0)) / k


def _query_key_reference(layer, x, real, causal, strict):
    """cluster_on="query-key" written plainly for one sequence x (N, dim) with real tokens ``real``: per head h, each
    query to its ``query_clusters`` nearest centroids and each real key to its nearest, by cosine (the layer's k x
    dim centroids split by heads); query i reads, from each of its clusters, W keys of that cluster -- under a
    causal mask the latest at positions <= i, otherwise W consecutive ones in position order from its rank r (the
    cluster's keys before i) less W // 2, moved inside the cluster -- with W = (look_back + 1) x the chunk //
    query_clusters, or (reach_split="fill") W per cluster water-filled from the whole reach. With
    head_clusters="shared" the ids are computed once, for every head: a token's query (key) is its heads' unit
    queries (keys) side by side, against the whole k x dim centroids. Returns (the layer's output
    (N, dim), the per-point losses' terms: a list over heads (shared: one entry) of (-cos(point, C_hat[its id]) for
    the real points the centroids are fitted to, the ring loss))."""
    o, H, D = layer.options, layer.heads, layer.head_dim
    N, L = x.shape[0], int(real.sum())
    k = o.strict_causal_clusters() if strict else o.clusters_for(L)
    if strict:
        width = (o.look_back + 1) * o.causal_chunk_size
    else:
        chunk = math.ceil(L / k)
        width = (min(o.look_back, math.ceil(L / chunk) - 1) + 1) * chunk
    q, kk, v = _heads(layer, x)
    terms = []
    centroids = layer.inner.centroids[:k].view(k, H, D)
    runs = min(o.query_clusters, k)
    shared = o.head_clusters == "shared"
    if shared:  # the heads' unit vectors side by side, against whole centroids
        side_by_side = lambda P: torch.cat([F.normalize(P[h], dim=-1) for h in range(H)], dim=-1)  # noqa: E731
        whole = layer.inner.centroids[:k]
        cos = lambda P: F.cosine_similarity(P[:, None, :], whole[None, :, :], dim=-1)  # noqa: E731  (N, k)
        shared_q_ids, shared_k_ids = cos(side_by_side(q)).topk(runs, dim=1).indices, cos(side_by_side(kk)).argmax(1)
        terms.append(_losses_reference(o, whole, side_by_side(q), side_by_side(kk), real, k))
    outputs = []
    for h in range(H):
        C = centroids[:, h]
        cos = lambda P: F.cosine_similarity(P[:, None, :], C[None, :, :], dim=-1)  # noqa: E731  (N, k)
        if shared:
            q_ids, k_ids = shared_q_ids, shared_k_ids
        else:  # a query's R nearest, a key's one
            q_ids, k_ids = cos(q[h]).topk(runs, dim=1).indices, cos(kk[h]).argmax(1)
            terms.append(_losses_reference(o, C, q[h], kk[h], real, k))
        allowed = torch.zeros(N, N, dtype=torch.bool)
        for i in range(N):
            clusters = q_ids[i].tolist()
            members = [[j for j in range(N) if real[j] and k_ids[j] == c and (j <= i or not causal)]
                       for c in clusters]
            if o.reach_split == "equal":  # each run's share of the reach
                shares = [width // o.query_clusters] * len(clusters)
            else:  # water-filled: a common level, each run at most what it has, the reach at most together
                shares = water_filled([len(m) for m in members], width)
            for run, w in zip(members, shares, strict=True):
                if causal:
                    chosen = run[-w:] if w else []
                else:
                    rank = sum(j < i for j in run)
                    start = min(max(0, rank - w // 2), max(0, len(run) - w))
                    chosen = run[start:start + w]
                allowed[i, chosen] = True
        outputs.append(masked_softmax_attention(q[h], kk[h], v[h], allowed))
    merged = torch.stack(outputs).transpose(0, 1).reshape(N, layer.dim)
    return merged @ layer.to_out.weight.T + layer.to_out.bias, terms


@pytest.mark.parametrize(("N", "num_clusters", "look_back"), [(13, 3, 1), (20, 4, 1), (17, 3, 2), (9, "sqrt", 1),
                                                              (1, 2, 1), (6, 8, 1)])
@pytest.mark.parametrize("mode", ["none", "strict"])
@pytest.mark.parametrize(("centroid_fit", "query_clusters", "head_clusters", "reach_split"),
                         [("queries-keys", 1, "own", "equal"), ("keys", 1, "own", "equal"),
                          ("queries-keys", 2, "own", "equal"), ("queries-keys", 2, "shared", "equal"),
                          ("keys", 1, "shared", "equal"), ("keys", 3, "own", "fill"),
                          ("queries-keys", 2, "shared", "fill")])
def test_neural_clustering_on_query_key_matches_dense_reference(N, num_clusters, look_back, mode, centroid_fit,
                                                                 query_clusters, head_clusters, reach_split):
    """``cluster_on="query-key"``: queries and keys assigned apart, each by its own projection to its head's share
    of the centroids (or, ``head_clusters="shared"``, once for every head, by the heads' unit vectors side by side
    against the whole centroids); each query reads its cluster's latest (causal) or nearest-ranked keys, W of them;
    the two losses over each head's (or the side-by-side) queries and keys together (or keys alone) train the
    centroids only. Padding at the end and inside."""
    layer = _layer("neural-clustering", num_clusters=num_clusters, look_back=look_back, causal_clusters=3,
                   causal_chunk_size=2, cluster_on="query-key", centroid_fit=centroid_fit,
                   query_clusters=query_clusters, head_clusters=head_clusters, reach_split=reach_split)
    assert layer.inner.to_cluster is None
    B = 3
    x, pad = _padded_inside_and_at_the_end(B, N, layer.dim)
    causal = mode == "strict"
    y, aux, _ = run_recorded(layer, x, key_padding_mask=pad, causal=causal)
    l1_terms, rings = [], []
    for b in range(B):
        real = ~pad[b]
        ref, terms = _query_key_reference(layer, x[b], real, causal, strict=causal)
        torch.testing.assert_close(y[b][real], ref[real], rtol=1e-10, atol=1e-10)
        assert (y[b][~real] == 0).all()
        l1_terms += [t for head_terms, _ in terms for t in head_terms]
        rings += [ring for _, ring in terms]
    torch.testing.assert_close(aux["clustering"], torch.stack(l1_terms).mean(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(aux["centroid_sorting"], torch.stack(rings).mean(), rtol=1e-10, atol=1e-10)
    layer.zero_grad()
    losses = run_recorded(layer, x, key_padding_mask=pad, causal=causal)[1]
    (losses["clustering"] + losses["centroid_sorting"]).backward()
    assert layer.to_qkv.weight.grad is None or not layer.to_qkv.weight.grad.any()
    if N > 1:
        assert layer.inner.centroids.grad is not None and layer.inner.centroids.grad.any()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("centroid_fit", ["keys", "queries-keys"])
@pytest.mark.parametrize("head_clusters", ["own", "shared"])
def test_query_key_ema_centroids_follow_the_means_of_their_real_points(causal, centroid_fit, head_clusters):
    """``centroid_update="ema"``: a training forward keeps pending, per head, c <- normalise(decay c / |c| + (1 -
    decay) mean of the unit points nearest c) over the real keys (and queries, at their nearest), a centroid without
    points kept (as a unit vector); the centroids past the k in use untouched; no clustering losses. With
    ``head_clusters="shared"`` the same for whole centroids over the heads' unit vectors side by side. The next
    training forward applies it first; an evaluation forward neither applies nor computes one. Padding far off
    changes nothing."""
    layer = _layer("neural-clustering", num_clusters="sqrt", max_clusters=6, causal_clusters=3, causal_chunk_size=2,
                   cluster_on="query-key", centroid_update="ema", centroid_decay=0.7, centroid_fit=centroid_fit,
                   head_clusters=head_clusters)
    B, N, H, D = 3, 11, layer.heads, layer.head_dim
    x, pad = _padded_inside_and_at_the_end(B, N, layer.dim)
    pad[:, -1] = True  # every sequence 10 real tokens or fewer: sqrt gives k = 3 for each
    k = 3
    before = layer.inner.centroids.detach().clone()
    aux = run_recorded(layer.train(), x, key_padding_mask=pad, causal=causal)[1]
    assert "clustering" not in aux and "centroid_sorting" not in aux
    assert torch.equal(layer.inner.centroids, before)  # pending, not applied yet
    expected = before.clone()
    # (groups, k, width): each head's share of the centroids, or (shared) the whole centroids once
    C = F.normalize(before[:k].view(k, H, D).transpose(0, 1) if head_clusters == "own" else before[:k][None], dim=-1)
    for group in range(C.shape[0]):
        points = []
        for b in range(B):
            q, kk, _ = _heads(layer, x[b])
            if head_clusters == "shared":  # one point per token: its heads' unit vectors side by side
                q, kk = (torch.cat([F.normalize(P[h], dim=-1) for h in range(H)], dim=-1)[None] for P in (q, kk))
            real = ~pad[b]
            points += [kk[group][real]] + ([] if centroid_fit == "keys" else [q[group][real]])
        unit = F.normalize(torch.cat(points).detach(), dim=-1)
        ids = (unit @ C[group].T).argmax(1)
        width = C.shape[-1]
        for c in range(k):
            members = unit[ids == c]
            centroid = C[group, c]
            moved = centroid if len(members) == 0 else F.normalize(0.7 * centroid + 0.3 * members.mean(0), dim=0)
            expected[c, group * width:(group + 1) * width] = moved
    torch.testing.assert_close(layer.inner.pending["centroids"], expected, rtol=1e-12, atol=1e-12)
    wild = x.masked_fill(pad.unsqueeze(-1), 1e3)
    twin = copy.deepcopy(layer)
    twin.inner.pending = {}
    run_recorded(twin, wild, key_padding_mask=pad, causal=causal)
    torch.testing.assert_close(twin.inner.pending["centroids"], expected, rtol=1e-12, atol=1e-12)
    pending = layer.inner.pending["centroids"].clone()
    layer.eval()
    layer(torch.randn_like(x), key_padding_mask=pad, causal=causal)  # other points: an update would differ
    assert torch.equal(layer.inner.centroids, before) and torch.equal(layer.inner.pending["centroids"], pending)
    layer.train()
    layer(x, key_padding_mask=pad, causal=causal)
    assert torch.equal(layer.inner.centroids, pending)  # applied at the start of the next training forward


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_clusters", ["own", "shared"])
def test_fitting_centroids_sets_each_heads_kmeans_of_its_real_keys(causal, head_clusters):
    """``fitting_centroids``: inside it, a query-key layer's forward first sets the k centroids it uses to each
    head's spherical k-means of the batch's real keys (k-means++ seeds from the given generator, head 0 first), or
    with ``head_clusters="shared"`` to one k-means of the heads' unit keys side by side, then attends with them;
    padding keys play no part; outside it, the centroids stay put."""
    layer = _layer("neural-clustering", num_clusters=3, causal_clusters=3, causal_chunk_size=2,
                   cluster_on="query-key", head_clusters=head_clusters)
    B, N, H, D = 3, 11, layer.heads, layer.head_dim
    x, pad = _padded_inside_and_at_the_end(B, N, layer.dim)
    seed = fixed_seed()
    with fitting_centroids(layer, torch.Generator().manual_seed(seed)) as fitted:
        y = layer(x, key_padding_mask=pad, causal=causal)
    assert fitted == ["inner"]  # the fitted inner attention, named as in the model (here the layer)
    generator = torch.Generator().manual_seed(seed)
    keys = [_heads(layer, x[b])[1].detach() for b in range(B)]  # each (H, N, D)
    if head_clusters == "shared":  # (1, N, H D): the heads' unit keys side by side
        keys = [torch.cat([F.normalize(key[h], dim=-1) for h in range(H)], dim=-1)[None] for key in keys]
    expected = torch.stack([spherical_kmeans(torch.cat([keys[b][g][~pad[b]] for b in range(B)]), 3,
                                             generator=generator) for g in range(len(keys[0]))])  # (G, k, E)
    got = (layer.inner.centroids[:3].view(3, H, D).transpose(0, 1) if head_clusters == "own"
           else layer.inner.centroids[:3][None])
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer(x, key_padding_mask=pad, causal=causal), y, rtol=0, atol=0)  # it used them
    wild = x.masked_fill(pad.unsqueeze(-1), 1e3)  # padding keys far off: the same fit
    with fitting_centroids(layer, torch.Generator().manual_seed(seed)):
        layer(wild, key_padding_mask=pad, causal=causal)
    torch.testing.assert_close(layer.inner.centroids[:3].view(3, H, D).transpose(0, 1) if head_clusters == "own"
                               else layer.inner.centroids[:3][None], expected, rtol=1e-12, atol=1e-12)
    before = layer.inner.centroids.detach().clone()
    layer(torch.randn(B, N, layer.dim, dtype=torch.float64), causal=causal)
    assert torch.equal(layer.inner.centroids, before)


def test_fitting_centroids_separates_planted_key_groups_and_needs_a_query_key_layer():
    """Tokens drawn tightly around three directions have keys in three tight groups in every head: fitted, each
    head's nearest-centroid ids split the keys exactly by group (random centroids need not). A model without a
    query-key layer is refused, naming the option it serves."""
    layer = _layer("neural-clustering", num_clusters=3, causal_clusters=3, cluster_on="query-key")
    g = torch.Generator().manual_seed(fixed_seed())
    directions = 5 * torch.randn(3, layer.dim, dtype=torch.float64, generator=g)
    group = torch.randint(3, (2, 40), generator=g)
    x = directions[group] + 0.01 * torch.randn(2, 40, layer.dim, dtype=torch.float64, generator=g)
    with fitting_centroids(layer, torch.Generator().manual_seed(0)):
        layer(x, causal=True)
    H, D = layer.heads, layer.head_dim
    centroids = layer.inner.centroids[:3].view(3, H, D).transpose(0, 1)
    for h in range(H):
        keys = torch.stack([_heads(layer, x[b])[1][h] for b in range(2)])  # (2, 40, D)
        ids = (F.normalize(keys, dim=-1) @ centroids[h].T).argmax(-1)
        for a in range(3):
            assert ids[group == a].unique().numel() == 1, (h, a)  # one id per planted group ...
        assert ids.unique().numel() == 3, h  # ... and three different ones
    with pytest.raises(ValueError, match="centroid_init"), fitting_centroids(_layer("neural-clustering",
                                                                                  num_clusters=3), torch.Generator()):
        pass


def test_neural_clustering_on_query_key_reads_a_key_unlike_its_query():
    """What the paper's shared cluster cannot do: a query whose own token is far from the key it needs reads that
    key when its query vector is near the key's. One head, two centroids; token 0's key and token 5's query point
    along centroid 0, every other query and key along centroid 1: query 5 reads key 0 alone."""
    layer = _layer("neural-clustering", dim=4, heads=1, num_clusters=2, causal_chunk_size=4,
                   cluster_on="query-key")
    with torch.no_grad():
        layer.inner.centroids.copy_(torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]]))
        layer.to_qkv.weight.zero_()
        layer.to_qkv.bias.zero_()
        layer.to_qkv.weight[:4, 2] = torch.tensor([1.0, 0, 0, 0])  # queries: feature 2 -> centroid 0
        layer.to_qkv.bias[:4] = torch.tensor([0, 0.5, 0, 0])  # ... others -> centroid 1
        layer.to_qkv.weight[4:8, 3] = torch.tensor([1.0, 0, 0, 0])  # keys: feature 3 -> centroid 0
        layer.to_qkv.bias[4:8] = torch.tensor([0, 0.5, 0, 0])
        layer.to_qkv.weight[8:, :] = torch.eye(4)  # values: the token
        layer.to_out.weight.copy_(torch.eye(4))
        layer.to_out.bias.zero_()
    x = torch.zeros(1, 8, 4, dtype=torch.float64)
    x[0, :, 0] = torch.arange(8, dtype=torch.float64)  # each token's value names it
    x[0, 0, 3] = 1.0  # token 0's key is the odd one
    x[0, 5, 2] = 1.0  # token 5's query is the odd one
    y = layer(x, causal=True)
    assert y[0, 5, 0] == 0.0 and y[0, 5, 3] == 1.0  # query 5 averaged key 0's value alone (token 0 says 0)
    assert (y[0, 1:5, 3] == 0).all() and (y[0, 6:, 3] == 0).all()  # no other query read key 0


@pytest.mark.parametrize(("N", "cluster_on", "local_window"), [
    (13, "hidden", 0), (20, "hidden", 4), (9, "shared-qk", 0), (16, "shared-qk", 2), (1, "hidden", 0)])
def test_neural_clustering_prefix_assignment_matches_dense_reference(N, cluster_on, local_window):
    """``causal_assign="prefix"`` (strict causal mode): token j goes to argmax_i (s_ij - log sum_{j' <= j} exp
    s_ij'), eq. 4 with U normalised over the real positions so far, written here as a loop over positions. Padding
    in the middle must not enter the log-sum-exps. The centroids share one dominant direction with the points, so
    that the nearest centroid puts (almost) every token in one cluster and the two rules disagree."""
    layer = _layer("neural-clustering", causal_clusters=4, causal_chunk_size=2, causal_assign="prefix",
                   local_window=local_window, cluster_on=cluster_on)
    B = 3
    x = torch.randn(B, N, layer.dim, dtype=torch.float64)
    with torch.no_grad():  # a shared direction, as measured in deep layers (docs/recall-and-aggregation.md)
        common = torch.randn(layer.dim, dtype=torch.float64)
        x += 3 * common
        layer.inner.centroids[:4] += 0.3 * (layer.to_qkv.weight[: layer.dim] @ common if cluster_on == "shared-qk"
                                            else layer.inner.to_cluster.weight @ common)
    pad = torch.zeros(B, N, dtype=torch.bool)
    if N > 4:
        pad[1, -2:] = True
        pad[2, 1:3] = True
    y, groups = groups_of(layer, x, key_padding_mask=pad, causal=True)
    differs = 0
    for b in range(B):
        real = ~pad[b]
        ids, _, _, chunk = _reference_clustering(layer, x[b] * real[:, None], real, strict=True)
        assert torch.equal(groups[b][real], ids[real])
        nearest = _reference_clustering_nearest(layer, x[b] * real[:, None])
        differs += int((nearest != ids)[real].sum())
        allowed = cluster_causal_allowed(ids, chunk, 1, pad[b])
        if local_window:
            allowed = allowed | _local_allowed(N, local_window // 2, True, pad[b])
        output = _shared_qk_output if cluster_on == "shared-qk" else _reference_output
        ref = output(layer, x[b] * real[:, None], allowed)
        torch.testing.assert_close(y[b][real], ref[real], rtol=1e-10, atol=1e-10)
    assert N == 1 or differs > 0, "the case must tell the prefix rule from the nearest centroid"


def _reference_clustering_nearest(layer, x):
    """The nearest-centroid ids of the same layer (strict causal default), for the test's sanity check."""
    o = layer.options
    P = (x @ layer.to_qkv.weight[:layer.dim].T + layer.to_qkv.bias[:layer.dim] if o.cluster_on == "shared-qk"
         else x @ layer.inner.to_cluster.weight.T)
    C = layer.inner.centroids[: o.causal_clusters]
    return (F.normalize(P, dim=-1) @ F.normalize(C, dim=-1).T).argmax(-1)


@pytest.mark.parametrize(("mode", "cluster_on", "local_window"), [
    ("strict", "hidden", 0), ("strict", "shared-qk", 4), ("paper", "hidden", 2), ("none", "shared-qk", 0)])
def test_neural_clustering_dense_training_attends_to_every_key(mode, cluster_on, local_window):
    """``dense_training`` (``train --dense-warmup-steps``): a training forward attends to every real key (under a
    causal mask: every earlier one; shared QK: its own key only when alone), while the clustering runs and publishes
    its losses; evaluation is clustered as before."""
    layer = _layer("neural-clustering", num_clusters=3, causal_clusters=3, causal_chunk_size=2,
                   causal_mode="strict" if mode == "strict" else "paper", local_window=local_window,
                   cluster_on=cluster_on)
    B, N = 3, 11
    x = torch.randn(B, N, layer.dim, dtype=torch.float64)
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[1, -3:] = True
    pad[2, 2:4] = True
    causal = mode != "none"
    clustered = layer.eval()(x, key_padding_mask=pad, causal=causal)
    layer.inner.dense_training = True
    assert torch.equal(layer(x, key_padding_mask=pad, causal=causal), clustered)  # eval: the clusters
    y, aux, _ = run_recorded(layer.train(), x, key_padding_mask=pad, causal=causal)
    assert set(aux) == {"clustering", "centroid_sorting"}
    output = _shared_qk_output if cluster_on == "shared-qk" else _reference_output
    for b in range(B):
        real = ~pad[b]
        allowed = real.expand(N, N) & (torch.ones(N, N, dtype=torch.bool).tril() if causal else True)
        ref = output(layer, x[b] * real[:, None], allowed)
        torch.testing.assert_close(y[b][real], ref[real], rtol=1e-10, atol=1e-10)
    assert (y - clustered)[~pad].abs().max() > 1e-3, "the case must tell every key from the clusters"


def _key_clusters(layer, k, h):
    """Head h's key clusters from the definition: the largest cosine to a unit centroid, plus the cluster's
    load-balancing bias where the layer has one (option ``balance``). k (N, D)."""
    cosines = F.normalize(k, dim=-1) @ layer.inner.centroids[h].T
    if layer.options.balance_rate:
        cosines = cosines + layer.inner.balance_bias[h]
    return cosines.argmax(-1)


def _cluster_select_allowed(layer, q, k, real, causal, members=None):
    """Per head, the (N, N) keys each query reads under ``"cluster-select"``, from its definition: key clusters by
    the nearest unit centroid, each query's ``select`` clusters by the largest q . mu, its window, and from each
    selected cluster the members nearest to it outside the window (causal: the most recent at positions <= t -
    window; otherwise cluster_keys // 2 before the window and the rest after it) -- with ``members="score"`` the
    ``cluster_keys`` of its members outside the window of largest q . k (``members``: that option in place of the
    layer's)."""
    o = layer.options
    members_rule = members or o.members
    H, N, _ = q.shape
    masks = []
    for h in range(H):
        mu = layer.inner.centroids[h]
        ids = _key_clusters(layer, k[h], h)
        allowed = torch.zeros(N, N, dtype=torch.bool)
        for t in range(N):
            window = range(t - o.window + 1, t + 1) if causal else range(t - o.window // 2, t + o.window // 2)
            for j in window:
                if 0 <= j < N and real[j]:
                    allowed[t, j] = True
            for c in (q[h, t] @ mu.T).topk(o.select).indices.tolist():
                members = [j for j in range(N) if real[j] and ids[j] == c]
                if members_rule == "score":
                    outside = [j for j in members if (j <= t - o.window if causal else
                                                      j < t - o.window // 2 or j >= t + o.window // 2)]
                    chosen = sorted(outside, key=lambda j: -float((q[h, t] @ k[h, j]).detach()))[: o.cluster_keys]
                elif causal:
                    chosen = [j for j in members if j <= t - o.window][-o.cluster_keys:]
                else:
                    before = [j for j in members if j < t - o.window // 2]
                    after = [j for j in members if j >= t + o.window // 2]
                    first = o.cluster_keys // 2
                    chosen = (before[-first:] if first else []) + after[: o.cluster_keys - first]
                for j in chosen:
                    assert not allowed[t, j], "the window and the clusters must be disjoint"
                    allowed[t, j] = True
        masks.append(allowed)
    return masks


@pytest.mark.parametrize(("N", "options"), [
    (23, {"num_clusters": 3, "select": 2, "cluster_keys": 3, "window": 4}),
    (17, {"num_clusters": 4, "select": 1, "cluster_keys": 5, "window": 2}),
    (30, {"num_clusters": 5, "select": 3, "cluster_keys": 2, "window": 6}),
    (9, {"num_clusters": 2, "select": 2, "cluster_keys": 1, "window": 2}),
    (1, {"num_clusters": 2, "select": 1, "cluster_keys": 2, "window": 2})])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kernel", ["gather", "dense-mask", "banded", FUSED])
@pytest.mark.parametrize("members", ["recent", "score"])
def test_cluster_select_matches_dense_reference(N, options, causal, kernel, members, balance_bias=None):
    """``"cluster-select"`` against the masked softmax over the keys its definition names, padding at the end and
    in the middle of a sequence (never read, never counted in a cluster); every kernel; a selected cluster's
    nearest members or (``members="score"``) its best-scoring ones. ``balance_bias``: a layer with option
    ``balance`` and that bias (H, C)."""
    balance = {} if balance_bias is None else {"balance": 0.1}
    layer = _layer("cluster-select", **options, kernel=kernel, summaries=False, selection="scores", **OFF, **balance,
                   members=members)
    if balance_bias is not None:
        layer.inner.balance_bias.copy_(balance_bias)
    B = 3
    x = torch.randn(B, N, layer.dim, dtype=torch.float64)
    pad = torch.zeros(B, N, dtype=torch.bool)
    if N > 6:
        pad[1, -3:] = True
        pad[2, 2:4] = True
    y, aux, groups = run_recorded(layer, x, key_padding_mask=pad, causal=causal)
    read = differ = 0
    for b in range(B):
        real = ~pad[b]
        q, k, v = _heads(layer, x[b] * real[:, None])
        masks = _cluster_select_allowed(layer, q, k, real, causal)
        if members == "score":  # the case must tell the best-scoring members from the nearest ones
            other = _cluster_select_allowed(layer, q, k, real, causal, members="recent")
            differ += sum(int((m != r).sum()) for m, r in zip(masks, other, strict=True))
        for h in range(layer.heads):  # the published groups are the key clusters
            assert torch.equal(groups[layer.inner][b, h][real], _key_clusters(layer, k[h], h)[real])
        heads = torch.stack([masked_softmax_attention(q[h], k[h], v[h], masks[h]) for h in range(layer.heads)])
        ref = heads.transpose(0, 1).reshape(N, layer.dim) @ layer.to_out.weight.T + layer.to_out.bias
        torch.testing.assert_close(y[b][real], ref[real], rtol=1e-10, atol=1e-10)
        read += sum(int(m.sum()) for m in masks)
    assert N == 1 or read < B * layer.heads * N * N * 0.9, "the case must leave keys out"
    assert N < 17 or members == "recent" or differ > 0, "the best-scoring members must differ from the nearest"
    assert "commitment" in aux


def _bound_reference(q_t, k, members, t, o, causal):
    """``selection="bound"``'s score of one group for query t, from its definition: over the ``members`` (positions)
    in whole blocks of ``bound_block`` positions outside the window (causal: before block floor((t - window + 1) /
    block); otherwise wholly before [t - window / 2, t + window / 2), or wholly after it, the larger of the two),
    sum_d max(q_d max_j k_jd, q_d min_j k_jd) / sqrt(D); -inf without such members."""
    block = o.bound_block or 64

    def bound(js):
        if not js:
            return -math.inf
        return float(torch.maximum(q_t * k[js].amax(0), q_t * k[js].amin(0)).sum()) / math.sqrt(k.shape[-1])

    if causal:
        return bound([j for j in members if j < block * ((t - o.window + 1) // block)])
    half = o.window // 2
    return max(bound([j for j in members if j < block * ((t - half) // block)]),
               bound([j for j in members if j >= block * -(-(t + o.window - half) // block)]))


def _best(values, select):
    """The ``select`` largest of ``values`` (a list), largest first, equal ones by the lower index: the selection's
    rule for ties (groups without members tie at -inf)."""
    return sorted(range(len(values)), key=lambda c: (-values[c], c))[:select]


def _cluster_select_summaries_reference(layer, q, k, v, real, causal):
    """Per head, (N, D) outputs of ``"cluster-select"`` with ``summaries=True``, one query at a time from the
    definition: the window, the selected clusters' nearest members outside it, and one summary per cluster of its
    other members outside the window (mean key, mean value, logit q . mean / sqrt(D) + log n), in one softmax.
    ``selection="summaries"`` ranks the clusters by that logit over all their members outside the window;
    ``grouping="position"`` puts position j in group (j // cluster_keys) mod num_clusters; ``position_splits`` R puts
    key j of cluster c in group c R + (j // split_size) mod R."""
    o = layer.options
    H, N, D = q.shape
    splits = getattr(o, "position_splits", 1)  # ExperimentalClusterSelectOptions' options, where given
    groups = o.num_clusters * splits
    outputs = []
    for h in range(H):
        mu = layer.inner.centroids[h]
        if o.grouping == "kmeans":
            ids = _key_clusters(layer, k[h], h)
        elif o.grouping == "position":  # pages
            ids = torch.arange(N) // (getattr(o, "page_size", 0) or o.cluster_keys) % o.num_clusters
        else:  # "random": floor(C h(j) / 2^32), h(j) = (j + 1) 2654435761 mod 2^32, one position at a time
            ids = torch.tensor([((j + 1) * 2654435761 % 2**32) * o.num_clusters // 2**32 for j in range(N)])
        if splits > 1:
            ids = torch.tensor([int(ids[j]) * o.position_splits + (j // o.split_size) % o.position_splits
                                for j in range(N)])
        out = torch.zeros(N, D, dtype=q.dtype)
        for t in range(N):
            window = [j for j in (range(t - o.window + 1, t + 1) if causal else
                                  range(t - o.window // 2, t + o.window // 2)) if 0 <= j < N and real[j]]
            outside = [j for j in range(N) if real[j] and j not in window and (not causal or j <= t - o.window)]
            sinks = [j for j in outside if j < o.sink]  # read by every query, in no group
            members = {c: [j for j in outside if ids[j] == c and j >= o.sink] for c in range(groups)}

            def logit(js):
                return float(q[h, t] @ k[h, js].mean(0)) / math.sqrt(D) + math.log(len(js))

            if o.selection == "summaries":
                ranking = torch.tensor([logit(members[c]) if members[c] else -math.inf for c in members])
            elif o.selection == "bound":
                real_members = [[j for j in range(N) if real[j] and ids[j] == c and j >= o.sink]
                                for c in range(groups)]
                ranking = torch.tensor([_bound_reference(q[h, t], k[h], js, t, o, causal) for js in real_members],
                                       dtype=q.dtype)
            else:
                ranking = q[h, t] @ mu.T
            chosen_groups = _best(ranking.tolist(), o.select)
            # split_selection="clusters": clusters by the log-sum-exp of their spans, then the best span
            if getattr(o, "split_selection", "groups") == "clusters":
                R = o.position_splits
                spans = [ranking[c * R:(c + 1) * R] for c in range(o.num_clusters)]
                best = _best([float(torch.logsumexp(span, 0)) for span in spans], o.select)
                chosen_groups = [c * R + int(spans[c].argmax()) for c in best]
            if o.own_group and t >= o.sink:  # the group of the query's own key first, then the best others
                chosen_groups = [int(ids[t]), *[c for c in chosen_groups if c != int(ids[t])][: o.select - 1]]
            read = list(window) + sinks
            for c in chosen_groups:
                if causal:
                    chosen = members[c][-o.cluster_keys:]
                else:
                    first = o.cluster_keys // 2
                    before = [j for j in members[c] if j < t]
                    chosen = (before[-first:] if first else []) + [j for j in members[c] if j > t][
                        : o.cluster_keys - first]
                read += chosen
                members[c] = [j for j in members[c] if j not in chosen]
            logits = [float(q[h, t] @ k[h, j]) / math.sqrt(D) for j in read]
            values = [v[h, j] for j in read]
            for js in members.values() if o.summaries else ():
                if js:
                    logits.append(logit(js))
                    values.append(v[h, js].mean(0))
            if logits:
                out[t] = torch.softmax(torch.tensor(logits, dtype=q.dtype), 0) @ torch.stack(values)
        outputs.append(out)
    return torch.stack(outputs)


@pytest.mark.parametrize(("N", "options"), [
    (23, {"num_clusters": 3, "select": 2, "cluster_keys": 3, "window": 4}),
    (30, {"num_clusters": 5, "select": 2, "cluster_keys": 2, "window": 6}),
    (17, {"num_clusters": 4, "select": 1, "cluster_keys": 5, "window": 2}),
    (1, {"num_clusters": 2, "select": 1, "cluster_keys": 2, "window": 2})])
@pytest.mark.parametrize(("selection", "grouping"), [("scores", "kmeans"), ("summaries", "kmeans"),
                                                    ("summaries", "position"), ("summaries", "position-5"),
                                                    ("summaries", "random"), ("summaries", "kmeans-split"),
                                                    ("summaries", "random-split"),
                                                    ("summaries", "kmeans-split-clusters"), ("bound", "kmeans"),
                                                    ("bound", "kmeans-split"), ("bound", "random"),
                                                    ("bound-alone", "kmeans"), ("bound-own", "kmeans"),
                                                    ("scores-own", "kmeans"), ("summaries-own", "random"),
                                                    ("bound-own", "kmeans-split"), ("bound-sink", "kmeans"),
                                                    ("bound-own-sink", "kmeans"), ("scores-own-sink", "kmeans"),
                                                    ("summaries-sink", "position"), ("summaries-own-sink", "random"),
                                                    ("bound-alone-sink", "kmeans")])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kernel", ["gather", "dense-mask", "banded", FUSED])
def test_cluster_select_summaries_match_dense_reference(N, options, selection, grouping, causal, kernel,
                                                       balance_bias=None):
    """``summaries=True`` (and ``selection="summaries"``, ``grouping="position"``) against the softmax its
    definition names, one query at a time: every key outside the window counts once, alone or in its cluster's
    summary; padding in no summary. ``balance_bias``: a layer with option ``balance`` and that bias (H, C)."""
    pages = {"page_size": 5} if grouping == "position-5" else {}  # pages longer than cluster_keys
    splits = {"position_splits": 2, "split_size": 4} if "-split" in grouping else {}  # clusters cut in spans
    if grouping.endswith("-clusters"):  # a query selects clusters, then a span of each
        splits["split_selection"] = "clusters"
    grouping = grouping.removesuffix("-5").removesuffix("-clusters").removesuffix("-split")
    sink = {"sink": options["cluster_keys"] // 2 if selection.endswith("-sink") else 0}  # read by every query
    selection = selection.removesuffix("-sink")
    own = {"own_group": selection.endswith("-own")}  # the own key's group read first
    selection = selection.removesuffix("-own")
    summaries = selection != "bound-alone"  # "bound-alone": the bound's selection without summaries
    selection = selection.removesuffix("-alone")
    if selection == "bound":  # blocks of 4 (of 5 with spans of 4) against windows of 2-6: the window cuts blocks
        splits["bound_block"] = 5 if splits else 4
    layer = _layer("cluster-select", **options, kernel=kernel, summaries=summaries, selection=selection,
                   grouping=grouping, **pages, **splits, **own, **sink,
                   **({} if balance_bias is None else {"balance": 0.1}))
    if balance_bias is not None:
        layer.inner.balance_bias.copy_(balance_bias)
    B = 3
    x = torch.randn(B, N, layer.dim, dtype=torch.float64)
    pad = torch.zeros(B, N, dtype=torch.bool)
    if N > 6:
        pad[1, -3:] = True
        pad[2, 2:4] = True
    plain = _layer("cluster-select", **options, kernel=kernel, grouping=grouping, **pages, summaries=False,
                   selection="scores" if grouping == "kmeans" else "random", **OFF,
                   **({} if balance_bias is None else {"balance": 0.1}))
    plain.load_state_dict(layer.state_dict())
    y = layer(x, key_padding_mask=pad, causal=causal)
    for b in range(B):
        real = ~pad[b]
        with torch.no_grad():
            q, k, v = _heads(layer, x[b] * real[:, None])
            heads = _cluster_select_summaries_reference(layer, q, k, v, real, causal)
        ref = heads.transpose(0, 1).reshape(N, layer.dim) @ layer.to_out.weight.T + layer.to_out.bias
        torch.testing.assert_close(y[b][real], ref[real], rtol=1e-10, atol=1e-10)
    if N > 6 and summaries:
        assert (y - plain(x, key_padding_mask=pad, causal=causal))[~pad].abs().max() > 1e-3, "summaries must count"
    if selection == "bound" and N > 6:  # the bound must choose other groups than the summaries' means or centroids
        other = _layer("cluster-select", **options, kernel=kernel, summaries=summaries, grouping=grouping,
                       **{key: value for key, value in splits.items() if key != "bound_block"},
                       selection="summaries" if summaries else "scores", **OFF)
        other.load_state_dict(layer.state_dict())
        assert (y - other(x, key_padding_mask=pad, causal=causal))[~pad].abs().max() > 1e-3, "the bound must count"
    for option in [option for option in (own, sink) if any(option.values()) and N > 6]:  # each must change a read
        without = {**own, **sink, **{key: type(value)() for key, value in option.items()}}
        other = _layer("cluster-select", **options, kernel=kernel, summaries=summaries, grouping=grouping,
                       selection=selection, **splits, **without)
        other.load_state_dict(layer.state_dict())
        assert (y - other(x, key_padding_mask=pad, causal=causal))[~pad].abs().max() > 1e-3, f"{option} must count"
    if splits and N > 6:  # the spans must split some cluster of the case, so that the groups differ from the clusters
        whole = _layer("cluster-select", **options, kernel=kernel, summaries=True, selection=selection,
                       grouping=grouping, **OFF)
        whole.load_state_dict(layer.state_dict())
        assert (y - whole(x, key_padding_mask=pad, causal=causal))[~pad].abs().max() > 1e-3, "the spans must count"


@pytest.mark.parametrize("chunk", [1, 4, 5])
@pytest.mark.parametrize("causal", [True, False])
def test_cluster_select_banded_chunks_shorter_than_the_window_match_dense_reference(chunk, causal, monkeypatch):
    """The banded kernel with chunks shorter than the window (production: at most ``BAND_CHUNK`` = 128 positions,
    against windows of 512 and more): bands of several chunks, the keys outside the window in one or two column
    spans of the band (chunk 4 against a window of 10: a span that crosses into the second chunk; chunk 5: one that
    does not; chunk 1: the band is the window and no span holds any), with and without summaries, against the
    definitions above."""
    from clusterformer.ops import selected_band
    monkeypatch.setattr(selected_band, "BAND_CHUNK", chunk)
    assert selected_band.band_chunk(10, causal) == chunk
    options = {"num_clusters": 3, "select": 2, "cluster_keys": 3, "window": 10}
    test_cluster_select_matches_dense_reference(37, options, causal, "banded", "recent")
    test_cluster_select_summaries_match_dense_reference(37, options, "summaries", "kmeans", causal, "banded")


@pytest.mark.parametrize("kernel", ["gather", FUSED])
@pytest.mark.parametrize("causal", [True, False])
def test_cluster_select_summaries_over_several_prefix_blocks_match_dense_reference(kernel, causal, monkeypatch):
    """The gather and fused kernels' summaries read each cluster's own prefix sums, cut into blocks of
    ``PREFIX_BLOCK`` rows (16 in production, more than these clusters hold): in blocks of 4 every cluster spans
    several, whose sums the blocks' segmented scan carries -- against the definitions above, with the summaries'
    ranking and the bound's."""
    from clusterformer.ops import selected_layout
    monkeypatch.setattr(selected_layout, "PREFIX_BLOCK", 4)
    options = {"num_clusters": 3, "select": 2, "cluster_keys": 3, "window": 6}
    test_cluster_select_summaries_match_dense_reference(37, options, "summaries", "kmeans", causal, kernel)
    test_cluster_select_summaries_match_dense_reference(37, options, "bound-own-sink", "kmeans", causal, kernel)


@pytest.mark.parametrize("chunk", [None, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_cluster_select_kernels_give_one_gradient(chunk, causal, monkeypatch):
    """The layer's gradients (input and every weight) are the same through the banded and dense-mask kernels as
    through the gather kernel, which lists every key a query reads: the banded kernel builds one chunk band per call
    for the summaries' selection (no gradient) and the attention (the gradient), so a band built without the
    gradient, or read from the selection's detached copy, changes them. Float64, padding, summaries; chunk 4: bands
    of several chunks against a window of 10."""
    from clusterformer.ops import selected_band
    if chunk is not None:
        monkeypatch.setattr(selected_band, "BAND_CHUNK", chunk)
    options = {"num_clusters": 3, "select": 2, "cluster_keys": 3, "window": 10}
    N = 37
    x = torch.randn(2, N, 16, dtype=torch.float64)
    pad = torch.zeros(2, N, dtype=torch.bool)
    pad[1, -5:] = True
    grads = _cluster_select_by_kernels(options, x, pad, causal, ("gather", "dense-mask", "banded"))
    for kernel in ("dense-mask", "banded"):
        for a, b in zip(grads[kernel][1:], grads["gather"][1:], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _cluster_select_by_kernels(options, x, pad, causal, kernels):
    """Per kernel, one cluster-select layer's outputs on the real tokens, input gradient and weight gradients
    (the same weights for every kernel; eval, so that the centroids stay put)."""
    state = _layer("cluster-select", **options).state_dict()
    results = {}
    for kernel in kernels:
        layer = _layer("cluster-select", **options, kernel=kernel).eval()
        layer.load_state_dict(state)
        xi = x.clone().requires_grad_()
        y = layer(xi, key_padding_mask=pad, causal=causal)
        (y[~pad] * torch.linspace(-1, 1, x.shape[-1], dtype=torch.float64)).sum().backward()
        results[kernel] = [y[~pad], xi.grad] + [p.grad for p in layer.parameters()]
    return results


@_fused_ready
@pytest.mark.parametrize("options", [{"selection": "scores"}, {"selection": "bound", "own_group": True, "sink": 1},
                                     {"grouping": "position", "selection": "bound"},
                                     {"summaries": True}, {"summaries": True, "selection": "bound", "sink": 1}])
@pytest.mark.parametrize("causal", [True, False])
def test_cluster_select_fused_kernel_gives_the_gather_kernels_gradient(options, causal):
    """The C++ kernel against the gather kernel, which lists the same keys per query: the layer's
    output and gradients (input and every weight) in float64, padding in two places, more keys than the window at
    37 positions. And "auto" takes it: the same values without naming it."""
    options = {"num_clusters": 3, "select": 2, "cluster_keys": 3, "window": 6, "summaries": False, **options}
    N = 37
    x = torch.randn(2, N, 16, dtype=torch.float64)
    pad = torch.zeros(2, N, dtype=torch.bool)
    pad[1, -5:] = True
    pad[0, 3:6] = True
    results = _cluster_select_by_kernels(options, x, pad, causal, ("gather", "fused", "auto"))
    for kernel in ("fused", "auto"):
        for a, b in zip(results[kernel], results["gather"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert torch.equal(results["auto"][0], results["fused"][0])


def test_cluster_select_fused_kernel_refuses_what_it_cannot_run():
    """Named explicitly, the fused kernel says why it cannot run (attention dropout in training; half precision);
    "auto" then takes the banded or dense-mask kernel instead."""
    from clusterformer.ops.selected import resolve_kernel

    x = torch.randn(1, 20, 16, dtype=torch.float64)
    layer = _layer("cluster-select", num_clusters=3, select=1, cluster_keys=2, window=4, kernel="fused",
                   dropout=0.1).train()
    with pytest.raises(ValueError, match=r"it has no attention dropout; got dropout_p=0\.1"):
        layer(x)
    layer.eval()(x)  # no dropout in evaluation
    q = x.view(1, 1, 20, 16)
    with pytest.raises(ValueError, match=r"it runs float32/float64 CPU tensors; got torch\.bfloat16"):
        resolve_kernel("fused", 20, q=q.to(torch.bfloat16))
    assert resolve_kernel("auto", 20, q=q, dropout_p=0.1) == "dense-mask"
    assert resolve_kernel("auto", 300, q=q, dropout_p=0.1) == "banded"
    assert resolve_kernel("auto", 20, q=q.to(torch.bfloat16)) == "dense-mask"
    if extension_available():
        assert resolve_kernel("auto", 20, q=q) == resolve_kernel("auto", 5000, q=q) == "fused"


def test_cluster_select_summaries_options():
    """The defaults; budget: the summaries are num_clusters more keys per query; ``selection="summaries"`` needs
    them."""
    from clusterformer.attention.cluster_select import ClusterSelectOptions
    options = ClusterSelectOptions(num_clusters=16, select=2, cluster_keys=8, window=16, summaries=True)
    # keys read: the window, the clusters, the sink, the summaries and the bounds that rank the groups
    assert options.keys_per_query(1024) == 16 + 2 * 8 + 1 + 16 + 16
    budget = options.for_budget(64, 1024)
    assert ClusterSelectOptions(**{**vars(options), **budget}).keys_per_query(1024) <= 64
    assert budget == {"window": 14, "cluster_keys": 8}
    # the defaults (version 2): summaries on, groups ranked by the bound,
    # the own key's group read first, a sink of 1 -- each resolved at construction, so records name what ran
    defaults = ClusterSelectOptions()
    assert (defaults.summaries, defaults.selection, defaults.own_group, defaults.sink) == (True, "bound", True, 1)
    assert ClusterSelectOptions(summaries=False).selection == "bound"
    assert ClusterSelectOptions(summaries=False, selection="random").selection == "random"
    assert ClusterSelectOptions(cluster_keys=1).sink == 0  # a sink must fit half a cluster's keys
    with pytest.raises(ValueError, match="summaries"):
        ClusterSelectOptions(summaries=False, selection="summaries")
    with pytest.raises(ValueError, match="grouping"):  # selection="scores" needs trained centroids
        ClusterSelectOptions(grouping="position", summaries=False, selection="scores")
    with pytest.raises(ValueError, match="grouping='random' has no trained centroids"):
        ClusterSelectOptions(grouping="random", summaries=False, selection="scores")
    with pytest.raises(ValueError, match="grouping"):
        ClusterSelectOptions(grouping="pages", summaries=True, selection="summaries")
    with pytest.raises(ValueError, match="summaries"):
        ClusterSelectOptions(num_clusters=16, summaries=True).for_budget(18, 1024)
    with pytest.raises(ValueError, match="select must be at most num_clusters=4; got 5"):
        ClusterSelectOptions(num_clusters=4, select=5)
    # selection="bound": blocks of 64 by default, any grouping, with or without summaries; the bound vectors rank
    # groups and are not keys of the softmax, but their logits are keys read: one per group (the summaries'
    # selection reads the chosen groups' whole summaries beside the attended ones)
    bound = ClusterSelectOptions(selection="bound")
    assert bound.block == 64 and ClusterSelectOptions(selection="bound", bound_block=5).block == 5
    assert ClusterSelectOptions().block == 64 and ClusterSelectOptions(selection="summaries").block == 0
    assert bound.keys_per_query(1024) == ClusterSelectOptions(selection="summaries").keys_per_query(1024) + 16 - 2
    assert bound.keys_mixed(1024) == ClusterSelectOptions(selection="summaries").keys_mixed(1024) == 1024
    assert ClusterSelectOptions(selection="bound", grouping="position", summaries=False).selection == "bound"
    for bad, message in (({"bound_block": 8, "selection": "summaries"},
                          "bound_block=8 sets the blocks of selection='bound'"),
                         ({"selection": "bound", "bound_block": -1}, "bound_block"),
                         ({"selection": "bounds"}, "selection")):
        with pytest.raises(ValueError, match=message):
            ClusterSelectOptions(**bad)


def test_cluster_select_members_option():
    """``members``: "recent" by default; "score" reads as many keys per query and refuses the summaries, whose
    ranges leave out the nearest members; anything else is named in the error. The layer function refuses a member
    list beside summaries too."""
    from clusterformer.attention.cluster_select import ClusterSelectOptions
    from clusterformer.ops.selected import selected_cluster_attention

    assert ClusterSelectOptions().members == "recent"
    scored = ClusterSelectOptions(summaries=False, members="score")
    # as many keys mixed; read: every member of the selected groups scored, up to every key, and their 2 bounds
    assert scored.keys_mixed(1024) == ClusterSelectOptions(summaries=False).keys_mixed(1024)
    assert scored.keys_per_query(1024) == 1024 + 2
    with pytest.raises(ValueError, match=r"members='score' .* set summaries=False"):
        ClusterSelectOptions(members="score")
    with pytest.raises(ValueError, match="members"):
        ClusterSelectOptions(summaries=False, members="best")
    q = torch.randn(1, 1, 6, 4)
    ids = torch.zeros(1, 1, 6, dtype=torch.long)
    with pytest.raises(ValueError, match="pass summaries=False with members"):
        selected_cluster_attention(q, q, q, ids, ids[..., None], num_clusters=1, cluster_keys=2, window=2,
                                   mask=CAUSAL_MASK, summaries=True, members=torch.zeros(1, 1, 6, 2, dtype=torch.long))


def test_cluster_select_own_group_and_sink_options():
    """``with_own_group``: the own group first, then the selection's best others in their order -- the own group
    moves to the front where it was selected, and replaces the worst where it was not; the keys per query do not
    change. Options: a bool. ``sink``: its keys are counted and budgeted."""
    from clusterformer.attention.cluster_select import ClusterSelectOptions
    from clusterformer.ops.selected_ranking import with_own_group
    selected = torch.tensor([[5, 2, 7], [5, 2, 7], [5, 2, 7], [5, 2, 7]])
    own = torch.tensor([2, 7, 5, 1])
    assert with_own_group(selected, own).tolist() == [[2, 5, 7], [7, 5, 2], [5, 2, 7], [1, 5, 2]]
    assert with_own_group(torch.tensor([[3]]), torch.tensor([4])).tolist() == [[4]]
    options = {"selection": "bound", "summaries": False}
    assert (ClusterSelectOptions(**options, own_group=True).keys_per_query(1024)
            == ClusterSelectOptions(**options, own_group=False).keys_per_query(1024))
    # sink: that many more keys per query, taken first from a budget; at most cluster_keys // 2
    sunk = ClusterSelectOptions(**options, sink=4)
    assert sunk.keys_per_query(1024) == ClusterSelectOptions(**options, sink=0).keys_per_query(1024) + 4
    assert sunk.attended_groups == sunk.num_groups + 1 == 17
    assert ClusterSelectOptions(**options, sink=0).attended_groups == 16
    budget = sunk.for_budget(64, 1024)
    assert ClusterSelectOptions(**options, sink=4, **budget).keys_per_query(1024) <= 64
    assert budget == ClusterSelectOptions(**options, sink=0).for_budget(60, 1024)
    # a budget whose clusters get fewer than 2 sink keys each goes without the sink, and says so (beside the 16
    # group bounds, which are keys read)
    assert ClusterSelectOptions(**options).for_budget(8 + 16, 1024) == {"window": 2, "cluster_keys": 2}
    small = ClusterSelectOptions(**options).for_budget(6 + 16, 1024)
    assert small == {"window": 2, "cluster_keys": 2, "sink": 0}
    assert ClusterSelectOptions(**options, **small).keys_per_query(1024) == 6 + 16
    for bad, message in (({"sink": 17}, "sink=17 positions .* at most cluster_keys // 2 = 16"),
                         ({"sink": -1}, "sink"),
                         ({"own_group": 1}, "own_group must be a bool")):
        with pytest.raises(ValueError, match=message):
            ClusterSelectOptions(**bad)


@pytest.mark.parametrize(("N", "options"), [
    (23, {"num_clusters": 3, "select": 2, "cluster_keys": 3, "window": 4}),
    (30, {"num_clusters": 5, "select": 2, "cluster_keys": 2, "window": 6})])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kernel", ["gather", "dense-mask", "banded", FUSED])
def test_cluster_select_balance_bias_matches_dense_reference(N, options, causal, kernel):
    """Option ``balance``: a key's cluster is the largest cosine plus its cluster's bias -- the dense references
    above with a bias that moves keys between clusters."""
    bias = torch.randn(2, options["num_clusters"], dtype=torch.float64,
                       generator=torch.Generator().manual_seed(fixed_seed()))
    layer = _layer("cluster-select", **options)
    k = _heads(layer, torch.randn(N, layer.dim, dtype=torch.float64))[1]
    moved = [(_key_clusters(layer, k[h], h) != (F.normalize(k[h], dim=-1) @ layer.inner.centroids[h].T + bias[h])
              .argmax(-1)).any() for h in range(2)]
    assert any(moved), "the bias must move keys between clusters"
    test_cluster_select_matches_dense_reference(N, options, causal, kernel, "recent", balance_bias=bias)
    test_cluster_select_summaries_match_dense_reference(N, options, "summaries", "kmeans", causal, kernel,
                                                       balance_bias=bias)


def test_cluster_select_balance_step_moves_each_bias_towards_the_mean_load():
    """One step of the load-balancing bias, by hand: loads (3, 1, 0, 2) (mean 1.5) move the biases by (-r, +r, +r,
    -r); loads at the mean leave the bias alone. (The loads are the assignment's counts over the real keys:
    tests/ops/test_spherical.py checks that padding counts in none.)"""
    from clusterformer.attention.cluster_select import balance_step

    bias = torch.tensor([[0.5, 0.0, -0.25, 1.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    loads = torch.tensor([[3.0, 1.0, 0.0, 2.0], [2.0, 2.0, 1.0, 1.0]])
    step = balance_step(bias, loads, 0.25)
    torch.testing.assert_close(step[0], bias[0] + 0.25 * torch.tensor([-1.0, 1.0, 1.0, -1.0], dtype=torch.float64),
                               rtol=0, atol=1e-15)
    # head 1: loads (2, 2, 1, 1), mean 1.5
    torch.testing.assert_close(step[1], 0.25 * torch.tensor([-1.0, -1.0, 1.0, 1.0], dtype=torch.float64),
                               rtol=0, atol=1e-15)
    assert torch.equal(balance_step(bias, torch.ones(2, 4), 0.25), bias)


def test_cluster_select_balance_spreads_crowded_keys():
    """Training forwards on keys of which most point one way: without ``balance`` one cluster takes most of them;
    with it the largest cluster of each head holds at most 0.4 (8 clusters)."""
    def largest_share(balance):
        torch.manual_seed(fixed_seed())
        layer = build("cluster-select", dim=32, heads=2, num_clusters=8, select=2, cluster_keys=4, window=4,
                      balance=balance)
        g = torch.Generator().manual_seed(fixed_seed())
        crowd = torch.randn(32, generator=g)
        for _ in range(60):
            x = crowd + 0.3 * torch.randn(4, 64, 32, generator=g)
            x[:, ::8] = torch.randn(4, 8, 32, generator=g)
            layer(x, causal=True)
        with torch.no_grad(), record_groups() as groups:
            layer.eval()(x, causal=True)
        ids = groups[layer.inner]
        return max(float(torch.bincount(ids[:, h].reshape(-1), minlength=8).max()) / ids[:, h].numel()
                   for h in range(2))

    assert largest_share(0.0) > 0.6, "the case must crowd the keys"
    assert largest_share(0.05) < 0.4


@pytest.mark.parametrize("causal", [True, False])
def test_cluster_select_dense_training_attends_to_every_key_and_moves_the_centroids(causal):
    """``dense_training`` (``train --dense-warmup-steps``): a training forward of cluster-select is full attention
    over the real keys, while the centroids still follow the keys; evaluation reads the selected clusters."""
    layer = _layer("cluster-select", num_clusters=3, select=1, cluster_keys=2, window=2)
    B, N = 2, 15
    x = torch.randn(B, N, layer.dim, dtype=torch.float64)
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[1, -4:] = True
    selected = layer.eval()(x, key_padding_mask=pad, causal=causal)
    layer.inner.dense_training = True
    assert torch.equal(layer(x, key_padding_mask=pad, causal=causal), selected)
    before = layer.inner.centroids.clone()
    y = layer.train()(x, key_padding_mask=pad, causal=causal)
    for b in range(B):
        real = ~pad[b]
        allowed = real.expand(N, N) & (torch.ones(N, N, dtype=torch.bool).tril() if causal else True)
        ref = _reference_output(layer, x[b] * real[:, None], allowed)
        torch.testing.assert_close(y[b][real], ref[real], rtol=1e-10, atol=1e-10)
    assert (y - selected)[~pad].abs().max() > 1e-3
    layer.inner.apply_pending_updates()
    assert not torch.equal(layer.inner.centroids, before), "the centroids keep training"


def test_cluster_select_random_selection_is_the_same_size_and_not_the_scores():
    """``selection="random"``: ``select`` distinct clusters per query, the same for every sequence of a batch, drawn
    afresh in each training forward and fixed in evaluation; not the clusters the scores pick."""
    layer = _layer("cluster-select", num_clusters=6, select=3, cluster_keys=2, window=4, selection="random")
    inner = layer.inner
    picks = inner._random_selection(2, 2, 40, torch.device("cpu"))
    assert picks.shape == (2, 2, 40, 3) and torch.equal(picks[0], picks[1])
    assert ((picks >= 0) & (picks < 6)).all()
    assert (picks.sort(-1).values.diff(dim=-1) > 0).all(), "distinct clusters"
    assert not torch.equal(picks, inner._random_selection(2, 2, 40, torch.device("cpu")))  # a new draw
    q = torch.randn(2, 2, 40, layer.head_dim, dtype=torch.float64)
    assert (picks.sort(-1).values != inner._select(q, 3).sort(-1).values).any()
    x = torch.randn(2, 40, layer.dim, dtype=torch.float64)
    layer.eval()
    assert torch.equal(layer(x, causal=True), layer(x, causal=True))
    with pytest.raises(ValueError, match="selection"):
        _layer("cluster-select", selection="nearest")


def test_shared_qk_clustering_needs_the_layers_own_projection():
    """A pretrained model's separate query and key layers cannot give a shared QK: a clear error, not a silent
    clustering by the keys alone."""
    from clusterformer.attention.base import QKVProjection  # noqa: F401 (the protocol the fake follows)

    layer = _layer("neural-clustering", num_clusters=2, cluster_on="shared-qk")

    class Separate:
        heads, head_dim, shared_qk = layer.heads, layer.head_dim, False

        def qkv(self, x):
            return layer.qkv(x)

        def project_rows(self, rows, which):
            return layer.project_rows(rows, which)

    with pytest.raises(ValueError, match="cluster_on='shared-qk' needs a layer whose queries and keys are one"):
        layer.inner.attend_hidden(torch.randn(1, 5, layer.dim, dtype=torch.float64), Separate())
    with pytest.raises(ValueError, match="cluster_on"):
        _layer("neural-clustering", cluster_on="keys")


@pytest.mark.parametrize(("N", "causal"), [(7, False), (7, True), (1, True), (16, False)])
def test_full_attention_matches_dense_reference(N, causal):
    layer = _layer("full")
    x = torch.randn(2, N, layer.dim, dtype=torch.float64)
    pad = torch.zeros(2, N, dtype=torch.bool)
    pad[0, : N // 3] = True  # left padding: under a causal mask the first rows have no key
    y = layer(x, key_padding_mask=pad, causal=causal)
    for b in range(2):
        allowed = ~pad[b].expand(N, N)
        if causal:
            allowed = allowed & torch.ones(N, N, dtype=torch.bool).tril()
        ref = _reference_output(layer, x[b] * (~pad[b])[:, None], allowed)
        real = ~pad[b]
        torch.testing.assert_close(y[b][real], ref[real], rtol=1e-9, atol=1e-9)
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("name", ["full", "neural-clustering"])
@pytest.mark.parametrize("causal", [False, True])
def test_padding_never_changes_real_outputs(name, causal):
    layer = _layer(name, dim=16, heads=4)
    B, N = 3, 30
    x = torch.randn(B, N, 16, dtype=torch.float64)
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[0, 20:] = True
    pad[2, ::3] = True  # padding in the middle too
    y, aux, _ = run_recorded(layer, x, key_padding_mask=pad, causal=causal)
    garbage = x.clone()
    garbage[pad] = torch.randn(int(pad.sum()), 16, dtype=torch.float64) * 1e3
    garbage[0, 25] = float("nan")
    y2, aux2, _ = run_recorded(layer, garbage, key_padding_mask=pad, causal=causal)
    torch.testing.assert_close(y2[~pad], y[~pad], rtol=0, atol=0)
    assert set(aux2) == set(aux)
    for key, value in aux.items():  # clustering losses ignore padding too
        torch.testing.assert_close(aux2[key], value, rtol=0, atol=0)
    if name == "neural-clustering":
        assert torch.isfinite(layer(garbage, pad, causal, return_flow=True)[1]).all()


@pytest.mark.parametrize("N", [1, 2, 17, 64])
def test_strict_causal_output_never_depends_on_later_tokens(N):
    layer = _layer("neural-clustering", dim=16, heads=2, num_clusters="sqrt")
    x = torch.randn(2, N, 16, dtype=torch.float64)
    y = layer(x, causal=True)
    for t in range(N):
        changed = x.clone()
        changed[:, t + 1 :] = torch.randn_like(changed[:, t + 1 :]) * 5
        torch.testing.assert_close(layer(changed, causal=True)[:, : t + 1], y[:, : t + 1], rtol=0, atol=1e-12)


def test_paper_causal_mode_is_not_strict_as_documented():
    """Appendix B masks by position inside chunks, but the chunking sees the whole sequence. Changing
    future tokens *can* change which past keys a token attends to; the docs say so. This finds a case."""
    torch.manual_seed(0)
    layer = build("neural-clustering", dim=16, heads=2, num_clusters=4, causal_mode="paper").double()
    x = torch.randn(1, 32, 16, dtype=torch.float64)
    y = layer(x, causal=True)
    moved = False
    for _ in range(20):
        changed = x.clone()
        changed[:, 16:] = torch.randn(1, 16, 16, dtype=torch.float64) * 3
        moved |= not torch.allclose(layer(changed, causal=True)[:, :16], y[:, :16])
    assert moved


def test_losses_are_finite_and_reach_centroids_and_projection():
    layer = build("neural-clustering", dim=32, heads=4)
    x = torch.randn(2, 50, 32)
    _, aux, _ = run_recorded(layer, x)
    l1, l2 = aux["clustering"], aux["centroid_sorting"]
    assert torch.isfinite(l1) and torch.isfinite(l2)
    assert -1.0 <= l1.item() <= 1.0 and -1.0 <= l2.item() <= 1.0  # cosine similarity is bounded
    for loss in (l1, l2):
        layer.zero_grad()
        loss.backward(retain_graph=True)
        for param in (layer.inner.centroids, layer.inner.to_cluster.weight):
            assert param.grad is not None and torch.isfinite(param.grad).all() and param.grad.abs().sum() > 0


def test_training_steps_lower_the_joint_loss():
    """A tiny regression task: the output at each token should equal the mean of the tokens of its
    sequence that share its sign pattern -- attention has to learn it; the aux losses train too."""
    torch.manual_seed(0)
    layer = build("neural-clustering", dim=16, heads=2, num_clusters=4)
    head = torch.nn.Linear(16, 1)
    opt = torch.optim.Adam([*layer.parameters(), *head.parameters()], lr=3e-3)
    data = torch.Generator().manual_seed(1)
    x = torch.randn(8, 32, 16, generator=data)
    target = x[..., :1].mean(1, keepdim=True).expand(8, 32, 1)

    def loss_now():
        with collect_aux_losses() as aux:
            task = F.mse_loss(head(layer(x)), target)
        return task + 0.1 * aux["clustering"] + 0.1 * aux["centroid_sorting"]

    first = loss_now().item()
    for _ in range(60):
        opt.zero_grad()
        loss_now().backward()
        opt.step()
    assert loss_now().item() < first - 0.05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_autocast_gives_finite_results(dtype, causal):
    layer = build("neural-clustering", dim=32, heads=4)
    x = torch.randn(2, 100, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=dtype):
        y, aux, _ = run_recorded(layer, x, causal=causal)
        loss = y.float().pow(2).mean() + sum(aux.values())
    loss.backward()
    assert torch.isfinite(y.float()).all() and torch.isfinite(x.grad).all()
    assert len(aux) == 2 and all(torch.isfinite(v) for v in aux.values())


@pytest.mark.parametrize(("B", "N", "num_clusters"), [(2, 5, 8), (2, 5, 5), (3, 1, "sqrt"), (0, 7, 3), (2, 0, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_edge_sizes(B, N, num_clusters, causal):
    layer = build("neural-clustering", dim=8, heads=2, num_clusters=num_clusters)
    x = torch.randn(B, N, 8, requires_grad=True)
    y, aux, _ = run_recorded(layer, x, causal=causal)
    assert y.shape == (B, N, 8)
    (y.sum() + sum(aux.values())).backward()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()


def test_all_padding_sequence_is_finite():
    layer = build("neural-clustering", dim=8, heads=2, num_clusters=2)
    x = torch.randn(2, 6, 8, requires_grad=True)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[0] = True
    y, aux, _ = run_recorded(layer, x, key_padding_mask=pad)
    (y.sum() + sum(aux.values())).backward()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    assert len(aux) == 2 and all(torch.isfinite(v) for v in aux.values())


@pytest.mark.parametrize("name", ["full", "neural-clustering"])
def test_nan_input_stays_in_its_sequence(name):
    """Documented behaviour: NaN is not checked; it stays in the outputs of the sequence that has it."""
    layer = build(name, dim=16, heads=2)
    x = torch.randn(3, 20, 16)
    x[1, 4, 2] = float("nan")
    y = layer(x)
    assert torch.isfinite(y[0]).all() and torch.isfinite(y[2]).all()
    assert torch.isnan(y[1]).any()


def test_centroid_flow_argument():
    layer = build("neural-clustering", dim=8, heads=2, num_clusters=3, own_centroids=False)
    x = torch.randn(2, 9, 8)
    with pytest.raises(ValueError, match="centroids must flow in"):
        layer(x)
    y, c_hat = layer(x, flow=torch.randn(2, 3, 8), return_flow=True)
    assert y.shape == (2, 9, 8) and c_hat.shape == (2, 3, 8)
    with pytest.raises(ValueError, match="centroids must have shape"):
        layer(x, flow=torch.randn(2, 4, 8))
    with pytest.raises(ValueError, match="leak future tokens"):
        layer(x, causal=True, flow=torch.randn(3, 8))
    with pytest.raises(ValueError, match="takes no flow"):
        build("full", dim=8, heads=2)(x, flow=torch.randn(3, 8))


def test_registry_names_and_defaults():
    assert {"full", "neural-clustering"} <= set(names())
    for name in names():
        layer = build(name, dim=64, heads=4)
        assert layer(torch.randn(1, 10, 64)).shape == (1, 10, 64)
        assert set(describe(name)["options"]) == set(vars(layer.options))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: build("nope", dim=8, heads=2), "unknown attention mechanism 'nope'"),
        (lambda: build("full", dim=8, heads=2, num_clusters=4), "unknown option 'num_clusters' for attention 'full'"),
        (lambda: build("neural-clustering", dim=8, heads=2, clusters=4), "unknown option 'clusters'"),
        (lambda: build("neural-clustering", dim=8, heads=2, num_clusters=0), "num_clusters must be >= 1"),
        (lambda: build("neural-clustering", dim=8, heads=2, num_clusters="log"), "num_clusters must be an int"),
        (lambda: build("neural-clustering", dim=8, heads=2, look_back=-1), "look_back must be >= 0"),
        (lambda: build("neural-clustering", dim=8, heads=2, causal_mode="soft"), "causal_mode must be one of"),
        (lambda: build("neural-clustering", dim=8, heads=2, similarity_scale=0), "similarity_scale must be >"),
        (lambda: build("full", dim=8, heads=2, dropout=1.0), "dropout must be <"),
        (lambda: build("full", dim=10, heads=3), "dim must be divisible by heads"),
        (lambda: build("full", dim=0, heads=1), "dim must be >= 1"),
    ],
)
def test_bad_options_raise_value_error_naming_them(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("name", ["full", "neural-clustering"])
@pytest.mark.parametrize(
    ("args", "match"),
    [
        (lambda: (torch.randn(10, 16), None, False), "x must be 3-D"),
        (lambda: (torch.randn(2, 10, 12), None, False), r"x must have shape \(B, N, dim=16\)"),
        (lambda: (torch.randint(0, 5, (2, 10, 16)), None, False), "x must have a floating-point dtype"),
        (lambda: (torch.randn(2, 10, 16), torch.zeros(2, 9, dtype=torch.bool), False), "key_padding_mask must have"),
        (lambda: (torch.randn(2, 10, 16), torch.zeros(2, 10), False), "key_padding_mask must be a bool"),
        (lambda: (torch.randn(2, 10, 16), None, "yes"), "causal must be a bool"),
    ],
)
def test_bad_layer_input_raises_value_error(name, args, match):
    layer = build(name, dim=16, heads=2)
    x, mask, causal = args()
    with pytest.raises(ValueError, match=match):
        layer(x, key_padding_mask=mask, causal=causal)


@pytest.mark.parametrize("options", [{}, {"num_clusters": 3, "causal_clusters": 2, "causal_chunk_size": 3},
                                     {"causal_clusters": 3, "causal_chunk_size": 4, "look_back": 2}])
def test_strict_causal_prefix_gives_the_same_outputs_alone(options):
    """Outputs at 0..t are the same whether the layer sees t + 1 tokens or more -- including
    with num_clusters="sqrt" (the default), whose k and chunk once followed the length -- at several t on
    and around block boundaries."""
    layer = _layer("neural-clustering", causal_mode="strict", **options).eval()
    g = torch.Generator().manual_seed(fixed_seed())
    N = 200 if not options else 37
    x = torch.randn(2, N, layer.dim, dtype=torch.float64, generator=g)
    y = layer(x, causal=True)
    w = layer.options.causal_chunk_size
    for t in sorted({1, w - 1, w, w + 1, 2 * w, N // 2, N - 2}):
        torch.testing.assert_close(layer(x[:, :t], causal=True), y[:, :t], atol=1e-12, rtol=0)


@pytest.mark.parametrize(("N", "num_clusters", "look_back"), [(13, 3, 1), (12, 4, 2), (7, "sqrt", 1)])
@pytest.mark.parametrize("mode", ["none", "strict"])
def test_contiguous_grouping_is_local_block_attention(N, num_clusters, look_back, mode):
    """The ablation grouping="contiguous" is the same chunked attention with every token in one
    group -- contiguous blocks of the original order, chunk size ceil(L / k) (strict causal: causal_chunk_size)
    and the same look-back -- and publishes no clustering losses."""
    layer = _layer("neural-clustering", num_clusters=num_clusters, look_back=look_back, grouping="contiguous",
                   causal_chunk_size=3)
    B = 2
    x = torch.randn(B, N, layer.dim, dtype=torch.float64)
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[1, -3:] = True
    y, aux, groups = run_recorded(layer, x, key_padding_mask=pad, causal=mode == "strict")
    assert dict(aux) == {} and (groups[layer.inner][~pad] == 0).all()
    for b in range(B):
        real = ~pad[b]
        L = int(real.sum())
        zeros = torch.zeros(N, dtype=torch.long)
        if mode == "strict":
            allowed = cluster_causal_allowed(zeros, 3, look_back, pad[b])
        else:
            k = layer.options.clusters_for(L)
            allowed = sorted_chunk_allowed(zeros, max(1, math.ceil(L / k)), look_back, False, pad[b])
        ref = _reference_output(layer, x[b] * real[:, None], allowed)
        torch.testing.assert_close(y[b][real], ref[real], rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="grouping"):
        build("neural-clustering", dim=8, heads=2, grouping="kmeans")


@pytest.mark.parametrize("mode", ["none", "strict"])
def test_random_grouping_is_the_chunked_attention_of_random_clusters(mode):
    """The ablation grouping="random" puts each token in a random cluster (a hash of its position
    and one draw per forward), then attends exactly as the learned grouping would with those ids; fresh groups
    every training forward, the same in evaluation, independent of the batch, no clustering losses."""
    from clusterformer.attention.neural_clustering import random_groups

    layer = _layer("neural-clustering", num_clusters=3, grouping="random", causal_chunk_size=3, causal_clusters=3)
    N = 14
    x = torch.randn(2, N, layer.dim, dtype=torch.float64)
    pad = torch.zeros(2, N, dtype=torch.bool)
    pad[1, -4:] = True
    causal = mode == "strict"
    layer.train()
    first = run_recorded(layer, x, key_padding_mask=pad, causal=causal)[2][layer.inner]
    second = run_recorded(layer, x, key_padding_mask=pad, causal=causal)[2][layer.inner]
    assert not torch.equal(first, second)  # a new draw per training forward
    layer.eval()
    y, aux, groups = run_recorded(layer, x, key_padding_mask=pad, causal=causal)
    assert dict(aux) == {} and torch.equal(groups[layer.inner], run_recorded(layer, x, key_padding_mask=pad,
                                                                             causal=causal)[2][layer.inner])
    ids = groups[layer.inner]
    assert set(ids[~pad].tolist()) <= {0, 1, 2} and len(set(ids[0].tolist())) > 1
    k_real = torch.tensor([3, 3]) if causal else torch.tensor([layer.options.clusters_for(L) for L in (N, N - 4)])
    assert all(int(ids[b][~pad[b]].max()) < int(k_real[b]) for b in range(2))
    for b in range(2):
        real = ~pad[b]
        L = int(real.sum())
        if causal:
            allowed = cluster_causal_allowed(ids[b].masked_fill(pad[b], 3), 3, 1, pad[b])
        else:
            k = layer.options.clusters_for(L)
            allowed = sorted_chunk_allowed(ids[b], max(1, math.ceil(L / k)), 1, False, pad[b])
        ref = _reference_output(layer, x[b] * real[:, None], allowed)
        torch.testing.assert_close(y[b][real], ref[real], rtol=1e-9, atol=1e-9)
    # the ids of a sequence follow from its positions, its k and the draw: alone, it gets the same
    alone = run_recorded(layer, x[1:, :N - 4], causal=causal)[2][layer.inner]
    torch.testing.assert_close(alone[0], ids[1][:N - 4])
    assert random_groups(5, torch.tensor([4]), 7, torch.device("cpu")).tolist() == \
        random_groups(9, torch.tensor([4]), 7, torch.device("cpu"))[:, :5].tolist()


@pytest.mark.parametrize("causal", [False, True])
def test_explore_attends_within_random_groups_in_some_training_forwards_only(causal):
    """``explore``: with probability p a training forward uses random groups of the same size (a function of the
    position and one draw, not of x) while the clustering losses are still published; evaluation always uses the
    learned groups, so it equals the same layer without ``explore``."""
    import copy

    layer = _layer("neural-clustering", num_clusters=3, causal_clusters=3, causal_chunk_size=2, explore=1.0)
    plain = copy.deepcopy(layer)
    plain.inner.options = type(layer.inner.options)(**{**layer.inner.options.__dict__, "explore": 0.0})
    x = torch.randn(2, 14, layer.dim, dtype=torch.float64)
    other = torch.randn(2, 14, layer.dim, dtype=torch.float64)
    layer.eval()
    plain.eval()
    torch.testing.assert_close(layer(x, causal=causal), plain(x, causal=causal), rtol=0, atol=0)
    layer.train()
    plain.train()
    state = layer.inner.generator.get_state()
    _, aux, groups = run_recorded(layer, x, causal=causal)
    layer.inner.generator.set_state(state)
    _, _, groups_other = run_recorded(layer, other, causal=causal)
    learned = run_recorded(plain, x, causal=causal)[2][plain.inner]
    learned_other = run_recorded(plain, other, causal=causal)[2][plain.inner]
    assert set(aux) == {"clustering", "centroid_sorting"}
    assert torch.equal(groups[layer.inner], groups_other[layer.inner])  # not a function of x: random groups
    assert not torch.equal(learned, learned_other)  # (which the learned ones are, for these inputs)
    assert int(groups[layer.inner].max()) < 3
    half = _layer("neural-clustering", num_clusters=3, explore=0.5).train()
    learned_runs = [torch.equal(groups_of(half, x)[1], groups_of(copy.deepcopy(half).eval(), x)[1]) for _ in range(12)]
    assert any(learned_runs) and not all(learned_runs)
    with pytest.raises(ValueError, match="explore"):
        _layer("neural-clustering", explore=0.5, grouping="random")
    with pytest.raises(ValueError, match="explore"):
        _layer("neural-clustering", explore=1.5)
