"""Cluster retrieval over a growing cache (clusterformer.ops.retrieval) against a float64 reference written from
its definition: per query, sinks + causal window + whole clusters in descending centroid score (the best over
the query heads sharing the key/value head; the last cluster in part, members by position) up to the budget,
optionally the rest of every cluster from its centroid and size.

The reference keeps its own cluster bookkeeping (assignments as Python dicts, centroids recomputed as means)
and only borrows the K-means itself (tested in tests/ops/test_ops.py) for the (re)clusterings."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from clusterformer.attention.retrieval import ClusterRetrievalOptions, SinkWindowOptions
from clusterformer.clustering.kmeans import euclidean_kmeans
from clusterformer.masks import AttentionMask
from clusterformer.ops.retrieval import (
    DECODE_KERNEL,
    build_index,
    decode_kernel_unusable,
    extend_index,
    keys_allowed,
    retrieval_attention,
)
from extensions_off import run_without_extensions
from seeds import fixed_seed


def cache_mask(real: torch.Tensor) -> AttentionMask:
    """The causal mask of a cache whose real keys are ``real`` (B, n) bool."""
    return AttentionMask(~real, causal=True)

needs_decode_kernel = pytest.mark.skipif(not DECODE_KERNEL.available(),
                                         reason=f"the fused decoding step is not built: {DECODE_KERNEL.error}")
# the decoding steps (one query position) of "group" and "head" selection without the remainder estimate run the
# fused C++ step with kernel "auto" where it is built; "torch" holds them to the composition, "fused" to the kernel
KERNELS = ["torch", pytest.param("fused", marks=needs_decode_kernel)]


class ReferenceIndex:
    """Cluster assignments of the indexable keys, per (batch, key/value head), as dicts position -> cluster."""

    def __init__(self, k, real, end, opts):
        self.opts = opts
        self.assign: dict[tuple[int, int], dict[int, int]] = {}
        self.joined = 0
        self.end = 0
        self._rebuild(k, real, end)

    def _indexable(self, real, b, p):
        return bool(real[b, p]) and int(real[b, :p].sum()) >= self.opts.sink

    def _rebuild(self, k, real, end):
        B, Hkv, _n, _D = k.shape
        self.end, self.joined = end, 0
        for b in range(B):
            valid = torch.tensor([self._indexable(real, b, p) for p in range(end)], dtype=torch.bool)
            for h in range(Hkv):
                ids = euclidean_kmeans(k[b, h, :end].unsqueeze(0), max(1, self.opts.num_clusters),
                                       iterations=self.opts.iterations, valid=valid.unsqueeze(0))[0]
                self.assign[b, h] = {p: int(ids[p]) for p in range(end) if valid[p]}

    def centroids(self, k, b, h):
        members: dict[int, list[int]] = {}
        for p, c in self.assign[b, h].items():
            members.setdefault(c, []).append(p)
        return {c: (k[b, h, ps].mean(0), sorted(ps)) for c, ps in members.items()}

    def extend(self, k, real, end):
        if end <= self.end:
            return
        if self.joined + end - self.end > self.opts.refresh:
            self._rebuild(k, real, end)
            return
        B, Hkv = k.shape[:2]
        for b in range(B):
            for h in range(Hkv):
                before = self.centroids(k, b, h)
                for p in range(self.end, end):
                    if self._indexable(real, b, p):
                        dist = {c: float(((k[b, h, p] - mu) ** 2).sum()) for c, (mu, _) in before.items()}
                        self.assign[b, h][p] = min(dist, key=lambda c: (dist[c], c))
        self.joined += end - self.end
        self.end = end


def reference_attention(q, k, v, real, index, opts, scale, ranking=None):
    B, H, Lq, _D = q.shape
    Hkv, n = k.shape[1], k.shape[2]
    out = torch.zeros(B, H, Lq, v.shape[-1], dtype=q.dtype)
    for b in range(B):
        L = int(real[b].sum())
        allowed = min(L, math.ceil(L * opts.budget) if isinstance(opts.budget, float) else opts.budget)
        # every key or centroid term a query reads counts: sinks (leaving the query its own key), the C centroid
        # terms where the budget has room for them, then the window and the retrieved keys share the cap
        sinks = max(0, min(opts.sink, allowed - 1))
        room = allowed - sinks - 1
        held = 0 if index is None else max(len(index.assign[b, g]) for g in range(Hkv))  # keys of its fullest head
        left_out = index is not None and allowed - sinks - (n - index.end) < held
        estimate = index is not None and opts.estimate_remainder and room >= opts.num_clusters and left_out
        cap = max(1, allowed - sinks - (opts.num_clusters if estimate else 0))
        region = 0 if index is None else index.end  # the window reads no key the index holds
        retrieved = 0 if index is None else max(0, cap - (n - index.end))
        real_pos = [p for p in range(n) if real[b, p]]
        for h in range(H):
            g = h // (H // Hkv)
            clusters = index.centroids(k, b, g) if index is not None else {}
            for i in range(Lq):
                pos = n - Lq + i
                qi = q[b, h, i] * scale
                first = max(region, pos - cap + 1)  # the query's window: its cap most recent positions
                keys = [p for p in real_pos[:sinks] if p < first and (index is None or p < index.end)]
                keys += [p for p in real_pos if first <= p <= pos]
                logits = [float(qi @ k[b, h_kv, p]) for p in keys for h_kv in [g]]
                values = [v[b, g, p] for p in keys]
                group = range(g * (H // Hkv), (g + 1) * (H // Hkv))  # heads sharing the key/value head g
                positions = [i]
                selection = getattr(opts, "selection", "group")
                if selection == "head":
                    group = [h]
                elif selection == "block":  # those heads at every position of the call
                    positions = range(Lq)
                rank_q = q if ranking is None else ranking  # the queries that rank: the call's, or those given
                if ranking is not None:
                    positions = range(ranking.shape[2])
                best = {c: max(float(rank_q[b, hh, ii] * scale @ mu) for hh in group for ii in positions)
                        for c, (mu, _) in clusters.items()}
                ranked = sorted(clusters, key=lambda c: (-best[c], c))
                rerank = getattr(opts, "rerank", 1)
                left = retrieved * rerank  # candidates: the ranked clusters' first members
                candidates = []
                for c in ranked:
                    mu, members = clusters[c]
                    take = members[:left]
                    left -= len(take)
                    candidates += take
                if rerank > 1:  # the `retrieved` candidates of highest exact score (best over the unit's heads)
                    exact = {p: max(float(rank_q[b, hh, ii] * scale @ k[b, g, p]) for hh in group
                                        for ii in positions) for p in candidates}
                    candidates = sorted(candidates, key=lambda p: -exact[p])[:retrieved]
                logits += [float(qi @ k[b, g, p]) for p in candidates]
                values += [v[b, g, p] for p in candidates]
                for c in ranked:
                    mu, members = clusters[c]
                    rest = len([p for p in members if p not in candidates])
                    if estimate and rest > 0:
                        logits.append(float(qi @ mu) + math.log(rest))
                        values.append(v[b, g, list(members)].mean(0))
                w = torch.softmax(torch.tensor(logits, dtype=q.dtype), 0)
                out[b, h, i] = (w.unsqueeze(1) * torch.stack(values)).sum(0)
    return out


def _cache(seed, B=2, Hkv=2, n=70, D=8, pad=(0, 9)):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, Hkv, n, D, generator=g, dtype=torch.float64) * 1.5
    v = torch.randn(B, Hkv, n, D, generator=g, dtype=torch.float64)
    real = torch.ones(B, n, dtype=torch.bool)
    for b, p in enumerate(pad):
        real[b, :p] = False  # left padding, as generate() batches prompts
    return k, v, real, g


@pytest.mark.parametrize("budget,estimate,selection,rerank", [
    (0.3, False, "group", 1), (0.3, True, "group", 1), (23, True, "group", 1), (9, False, "group", 1),
    (0.3, True, "head", 1), (9, False, "head", 1), (0.3, False, "group", 3), (9, False, "group", 2),
    (0.3, False, "head", 2), (9, False, "head", 4), (0.3, True, "block", 1), (9, False, "block", 3),
    (0.3, True, "group", 3), (23, True, "head", 2), (0.3, True, "block", 2)])
@pytest.mark.parametrize("kernel", KERNELS)
def test_retrieval_matches_reference_through_steps(budget, estimate, selection, rerank, kernel):
    """Prefill-sized cache, then steps of 1 and 3 queries (index built, keys joining, a refresh), float64; the
    single steps by the PyTorch composition and by the fused decoding step (where it applies: no estimate)."""
    if kernel == "fused" and (estimate or selection == "block"):
        pytest.skip("the fused step has no remainder estimate and no block selection")
    opts = ClusterRetrievalOptions(budget=budget, num_clusters=5, sink=2, window=6, refresh=7, iterations=3,
                                   estimate_remainder=estimate, selection=selection, rerank=rerank, kernel=kernel)
    k_all, v_all, real_all, g = _cache(fixed_seed(), n=70)
    H, scale = 4, 0.37
    n, index, ref_index = 50, None, None
    for Lq in (1, 1, 3, 1, 3, 3, 1, 3):  # the 3rd..6th steps join 7+ keys: one refresh
        n += Lq
        k, v, real = k_all[:, :, :n], v_all[:, :, :n], real_all[:, :n]
        q = torch.randn(2, H, Lq, 8, generator=g, dtype=torch.float64)
        end = n - max(opts.window, Lq)
        if index is None:
            index, ref_index = build_index(k, v, cache_mask(real), end, opts), ReferenceIndex(k, real, end, opts)
        else:
            index = extend_index(index, k, v, cache_mask(real), end, opts)
            ref_index.extend(k, real, end)
        got = retrieval_attention(q, k, v, cache_mask(real), index, opts, scale)
        want = reference_attention(q, k, v, real, ref_index, opts, scale)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    assert index.joined == ref_index.joined < n - opts.window - 45  # fewer than all the joins: a rebuild happened


@pytest.mark.parametrize("rerank", [1, 3])
def test_block_selection_ranked_by_other_queries_matches_reference(rerank):
    """selection="block" with ``ranking``: the clusters (and re-ranked candidates) chosen by the best scores of
    5 given queries -- the sparse prefill's block before -- for all 4 queries of the call, float64."""
    opts = ClusterRetrievalOptions(budget=0.4, num_clusters=5, sink=2, window=4, iterations=3, rerank=rerank,
                                   selection="block")
    k, v, real, g = _cache(fixed_seed(), n=60)
    q = torch.randn(2, 4, 4, 8, generator=g, dtype=torch.float64)
    before = torch.randn(2, 4, 5, 8, generator=g, dtype=torch.float64)
    index = build_index(k, v, cache_mask(real), 60 - 4, opts)
    got = retrieval_attention(q, k, v, cache_mask(real), index, opts, 0.4, "block", before)
    want = reference_attention(q, k, v, real, ReferenceIndex(k, real, 60 - 4, opts), opts, 0.4, ranking=before)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    own = retrieval_attention(q, k, v, cache_mask(real), index, opts, 0.4, "block")
    assert (own - got).abs().max() > 1e-6  # the ranking queries decide


@pytest.mark.parametrize("pad", [(0, 9), (0, 60)])
def test_sink_window_matches_reference(pad):
    """StreamingLLM's sinks + window; with 60 of 64 keys padding, the 4 real keys are sinks inside the window."""
    opts = SinkWindowOptions(budget=0.2, sink=3)
    k, v, real, g = _cache(fixed_seed(), n=64, pad=pad)
    for Lq in (1, 4):
        q = torch.randn(2, 4, Lq, 8, generator=g, dtype=torch.float64)
        got = retrieval_attention(q, k, v, cache_mask(real), None, opts, 0.5)
        torch.testing.assert_close(got, reference_attention(q, k, v, real, None, opts, 0.5), rtol=0, atol=1e-10)


def test_budget_covering_every_key_is_dense_attention():
    """Every cluster retrieved whole: exactly softmax attention over all real keys (causal for the new ones)."""
    k, v, real, g = _cache(fixed_seed(), n=60)
    n, Lq = 60, 3
    opts = ClusterRetrievalOptions(budget=1.0, num_clusters=4, sink=2, window=5, estimate_remainder=True)
    index = build_index(k, v, cache_mask(real), n - 5, opts)
    q = torch.randn(2, 4, Lq, 8, generator=g, dtype=torch.float64)
    got = retrieval_attention(q, k, v, cache_mask(real), index, opts, 0.3)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    allowed = real[:, None, None, :] & (torch.arange(n) <= torch.arange(n - Lq, n).unsqueeze(1))
    want = torch.softmax((q @ kk.transpose(-1, -2) * 0.3).masked_fill(~allowed, float("-inf")), -1) @ vv
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_no_future_key_and_batch_invariance():
    """A query never reads a later key; a sequence gives the same outputs alone as left-padded beside another."""
    opts = ClusterRetrievalOptions(budget=0.3, num_clusters=4, sink=2, window=4, estimate_remainder=True)
    k, v, real, g = _cache(fixed_seed(), n=48)
    Lq = 4
    q = torch.randn(2, 4, Lq, 8, generator=g, dtype=torch.float64)
    index = build_index(k, v, cache_mask(real), 48 - Lq, opts)
    base = retrieval_attention(q, k, v, cache_mask(real), index, opts, 0.4)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, -1] += 5.0
    v2[:, :, -1] -= 3.0  # the last position is in the future of queries 0..2
    moved = retrieval_attention(q, k2, v2, cache_mask(real), build_index(k2, v2, cache_mask(real), 48 - Lq, opts),
                                opts, 0.4)
    torch.testing.assert_close(moved[:, :, :3], base[:, :, :3], rtol=0, atol=0)
    assert not torch.allclose(moved[:, :, 3], base[:, :, 3])
    alone = (k[1:, :, 9:], v[1:, :, 9:], real[1:, 9:])  # row 1 without its 9 padding keys
    alone_mask = cache_mask(alone[2])
    got = retrieval_attention(q[1:], *alone[:2], alone_mask, build_index(*alone[:2], alone_mask, 39 - Lq, opts), opts,
                              0.4)
    torch.testing.assert_close(got, base[1:], rtol=0, atol=1e-12)


def test_options_are_validated():
    for bad in ({"budget": 0.0}, {"budget": 1.5}, {"budget": 0}, {"budget": True}, {"num_clusters": 0},
                {"refresh": 0}, {"estimate_remainder": 1}, {"selection": "query"}, {"rerank": 0}, {"rerank": 2.0},
                {"kernel": "cuda"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ClusterRetrievalOptions(**bad)
    for bad in ({"budget": 2.0}, {"sink": -1}, {"dense_layers": -1}, {"prefill_block": -1}, {"prefill_block": 1.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SinkWindowOptions(**bad)


@pytest.mark.parametrize("estimate", [False, True])
def test_no_padding_path_equals_an_all_real_mask(estimate):
    """real=None (no padding: budgets as plain numbers, no masks) computes what an all-True mask computes."""
    opts = ClusterRetrievalOptions(budget=0.25, num_clusters=4, sink=2, window=5, estimate_remainder=estimate)
    k, v, real, g = _cache(fixed_seed(), n=57, pad=(0, 0))
    for Lq in (1, 3):
        q = torch.randn(2, 4, Lq, 8, generator=g, dtype=torch.float64)
        with_mask = retrieval_attention(q, k, v, cache_mask(real), build_index(k, v, cache_mask(real), 57 - 5, opts),
                                        opts, 0.3)
        without = retrieval_attention(q, k, v, None, build_index(k, v, None, 57 - 5, opts), opts, 0.3)
        torch.testing.assert_close(without, with_mask, rtol=0, atol=1e-12)
        streaming = SinkWindowOptions(budget=opts.budget, sink=opts.sink)
        torch.testing.assert_close(retrieval_attention(q, k, v, None, None, streaming, 0.3),
                                   retrieval_attention(q, k, v, cache_mask(real), None, streaming, 0.3),
                                   rtol=0, atol=1e-12)


@pytest.mark.parametrize("budget", [1, 2, 3, 5, 9, 0.1, 0.25])
@pytest.mark.parametrize("estimate,selection,rerank", [(False, "group", 1), (True, "group", 1), (True, "head", 1),
                                                       (False, "group", 3), (False, "head", 2),
                                                       (True, "block", 1), (False, "block", 2),
                                                       (True, "group", 3)])
@pytest.mark.parametrize("kernel", KERNELS)
def test_every_key_and_centroid_read_counts_against_the_budget(budget, estimate, selection, rerank, kernel):
    """Count what each query reads: values one-hot per position (a key read puts weight on its own coordinate)
    and, for the centroid terms, the index's value means one-hot on extra coordinates (one per cluster). Every
    query, of every head and sequence, in prefill-sized chunks and single steps, with sinks (4) that a small
    budget must cut and a window (6) wider than some budgets: keys + centroid terms <= the budget of its
    sequence, and a budget of a few keys is used whole (no query reads fewer keys than it may and than exist)."""
    if kernel == "fused" and (estimate or selection == "block"):
        pytest.skip("the fused step has no remainder estimate and no block selection")
    C, sink = 3, 4
    opts = ClusterRetrievalOptions(budget=budget, num_clusters=C, sink=sink, window=6, refresh=100, iterations=2,
                                   estimate_remainder=estimate, selection=selection, rerank=rerank, kernel=kernel)
    k, _v, real, g = _cache(fixed_seed(), n=64, pad=(0, 20))
    n = k.shape[2]
    v = torch.zeros(2, 2, n, n + C, dtype=torch.float64)
    v[:, :, torch.arange(n), torch.arange(n)] = 1.0
    lengths = real.sum(1)
    for Lq in (1, 3):
        q = torch.randn(2, 4, Lq, 8, generator=g, dtype=torch.float64)
        # 5 keys wait to join: W > window
        index = build_index(k, v, cache_mask(real), n - max(opts.window, Lq) - 5, opts)
        index.value_sums = torch.zeros_like(index.value_sums)
        index.value_sums[:, torch.arange(C), n + torch.arange(C)] = index.counts.to(torch.float64)
        for index_or_none, options in ((index, opts), (None, SinkWindowOptions(budget=budget, sink=sink))):
            out = retrieval_attention(q, k, v, cache_mask(real), index_or_none, options, 0.3)  # (B, H, Lq, n + C)
            keys, terms = (out[..., :n] > 0).sum(-1), (out[..., n:] > 0).sum(-1)  # (B, H, Lq)
            allowed = keys_allowed(budget, lengths).view(2, 1, 1)
            assert bool(((keys + terms) <= allowed).all()), (keys + terms, allowed)
            assert bool((out[..., :n].masked_fill(real.view(2, 1, 1, n), 0) == 0).all())  # no padding key read
            if isinstance(budget, int) and budget <= 3:  # a few keys: every one of them is used
                assert bool((keys == allowed).all()), keys
            if index_or_none is None:
                assert int(terms.sum()) == 0


def test_an_index_recognises_its_cache_by_keys_spread_over_it():
    """follows() compares keys at 8 positions spread over the indexed ones, not only the last: a cache that differs
    from the index's at its start or in its middle (a different prompt with the same last indexed key) is not
    taken for it, nor one that is shorter. (Between the probes it cannot see: the index lives with its cache
    object, and this check guards against that object being refilled.)"""
    opts = ClusterRetrievalOptions(budget=0.3, num_clusters=3, sink=1, window=4)
    k, v, _real, _ = _cache(fixed_seed(), n=40, pad=(0, 0))
    index = build_index(k, v, None, 30, opts)
    assert index.follows(k) and index.follows(torch.cat([k, k[:, :, :3]], 2))  # the same cache, grown
    for position in (0, 17, 29):  # probes at 0, 4, 8, 12, 17, 21, 25, 29
        other = k.clone()
        other[:, :, position] += 1.0
        assert not index.follows(other), position
    assert not index.follows(k[:, :, :35])


@needs_decode_kernel
def test_fused_decoding_step_runs_where_it_applies_and_says_why_not_elsewhere():
    """kernel="auto" takes the fused step for a decoding step (the same output as kernel="fused", bit for bit) and
    the composition for a call of several positions; kernel="fused" refuses what the kernel cannot take, naming
    the reason, and the remainder estimate at construction."""
    k, v, real, g = _cache(fixed_seed(), n=80)
    opts = {"budget": 0.3, "num_clusters": 4, "sink": 2, "window": 5}
    index = build_index(k, v, cache_mask(real), 80 - 5, ClusterRetrievalOptions(**opts))
    q = torch.randn(2, 4, 1, 8, generator=g, dtype=torch.float64)
    auto, fused, composed = (retrieval_attention(q, k, v, cache_mask(real), index,
                                                 ClusterRetrievalOptions(**opts, kernel=kn), 0.3)
                             for kn in ("auto", "fused", "torch"))
    assert torch.equal(auto, fused)
    assert not torch.equal(fused, composed)  # two computations (equal to rounding: the reference tests)
    torch.testing.assert_close(fused, composed, rtol=0, atol=1e-12)
    fused_opts = ClusterRetrievalOptions(**opts, kernel="fused")
    for bad, reason in ((q.float(), "float32 or float64"), (q.clone().requires_grad_(), "no backward")):
        with pytest.raises(ValueError, match=reason):
            retrieval_attention(bad, k, v, cache_mask(real), index, fused_opts, 0.3)
    assert decode_kernel_unusable(q, k, v) is None
    q3 = torch.randn(2, 4, 3, 8, generator=g, dtype=torch.float64)  # several positions: the composition, no error
    torch.testing.assert_close(retrieval_attention(q3, k, v, cache_mask(real), index, fused_opts, 0.3),
                               retrieval_attention(q3, k, v, cache_mask(real), index, ClusterRetrievalOptions(**opts),
                                                   0.3),
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match="estimate_remainder"):
        ClusterRetrievalOptions(**opts, kernel="fused", estimate_remainder=True)


def test_the_decoding_step_builds_where_a_compiler_and_ninja_exist():
    import shutil

    if shutil.which("c++") is None or shutil.which("ninja") is None:
        pytest.skip("no C++ compiler or ninja here")
    assert DECODE_KERNEL.available(), DECODE_KERNEL.error


def test_without_the_extension_auto_composes_and_fused_says_why():
    """CLUSTERFORMER_NO_EXTENSIONS=1: nothing is built; kernel="auto" computes the composition's values bit for bit
    and kernel="fused" raises ValueError naming the reason."""
    code = (
        "import torch\n"
        "from clusterformer.attention.retrieval import ClusterRetrievalOptions as O\n"
        "from clusterformer.ops.retrieval import build_index, retrieval_attention\n"
        "k = torch.randn(1, 2, 60, 8, dtype=torch.float64); q = torch.randn(1, 4, 1, 8, dtype=torch.float64)\n"
        "index = build_index(k, k, None, 50, O(num_clusters=4, window=10))\n"
        "a, t = (retrieval_attention(q, k, k, None, index, O(num_clusters=4, window=10, budget=0.3, kernel=kn), 0.3)"
        " for kn in ('auto', 'torch'))\n"
        "assert torch.equal(a, t)\n"
        "try:\n"
        "    retrieval_attention(q, k, k, None, index, O(num_clusters=4, window=10, budget=0.3, kernel='fused'), 0.3)\n"
        "except ValueError as error:\n"
        "    print(error)\n"
    )
    reason = "kernel='fused' cannot run here: the extension is not available (disabled by "
    assert reason in run_without_extensions(code)


@needs_decode_kernel
@pytest.mark.parametrize("selection", ["group", "head"])
def test_fused_decoding_step_gives_the_same_bits_on_one_and_two_threads(selection):
    """The step's work is split over threads by units, candidate chunks and query heads; each output is computed
    by one thread, so the thread count changes no bit (600 candidates per unit: two chunks of 512)."""
    k, v, real, g = _cache(fixed_seed(), n=2000)
    opts = ClusterRetrievalOptions(budget=0.1, num_clusters=16, sink=2, window=8, rerank=4, selection=selection,
                                   kernel="fused")
    index = build_index(k, v, cache_mask(real), 2000 - 8, opts)
    q = torch.randn(2, 4, 1, 8, generator=g, dtype=torch.float64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = retrieval_attention(q, k, v, cache_mask(real), index, opts, 0.3)
        torch.set_num_threads(2)
        two = retrieval_attention(q, k, v, cache_mask(real), index, opts, 0.3)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    composed = retrieval_attention(q, k, v, cache_mask(real), index, dataclasses.replace(opts, kernel="torch"), 0.3)
    torch.testing.assert_close(one, composed, rtol=0, atol=1e-10)
