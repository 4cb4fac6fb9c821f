"""The oracle and Quest (clusterformer.ops.topk_cache) against float64 references written from their definitions,
one query at a time: the oracle reads, per query and head, the A real keys up to its position of largest q . k;
Quest, over pages cut from each sequence's real keys in order, reads its own page up to itself (at most its A most
recent keys) and the floor((A - own) / page) whole earlier pages of largest bound sum_d max(q_d min_d, q_d max_d).
A sequence's budget and pages are its own (left padding beside other sequences changes nothing), and what each
query reads is counted against A."""

from __future__ import annotations

import math

import pytest
import torch

from clusterformer.masks import AttentionMask
from clusterformer.ops.retrieval import keys_allowed
from clusterformer.ops.topk_cache import oracle_attention, quest_attention
from seeds import fixed_seed


def _allowed(budget, real_count):
    return min(real_count, math.ceil(real_count * budget) if isinstance(budget, float) else budget)


def reference(q, k, v, real, budget, scale, page=None):
    """page None: the oracle; a number: Quest with pages of that many positions."""
    B, H, Lq, _D = q.shape
    Hkv, n = k.shape[1], k.shape[2]
    out = torch.zeros(B, H, Lq, v.shape[-1], dtype=q.dtype)
    for b in range(B):
        A = _allowed(budget, int(real[b].sum()))
        for h in range(H):
            g = h // (H // Hkv)
            for i in range(Lq):
                t = n - Lq + i
                qi = q[b, h, i]
                if page is None:
                    visible = [j for j in range(t + 1) if real[b, j]]
                    keys = sorted(visible, key=lambda j: -float(qi @ k[b, g, j]))[:A]
                else:  # pages of the sequence's real keys in order: page p = its real keys of rank p P .. p P + P - 1
                    ranked = [j for j in range(n) if real[b, j]]
                    keys = []
                    if real[b, t]:
                        r = ranked.index(t)
                        first = max(r // page * page, r - A + 1)
                        keys = ranked[first:r + 1]
                        take = max(0, (A - len(keys)) // page)
                        bounds = {}
                        for p in range(r // page):
                            members = ranked[p * page:(p + 1) * page]
                            low, high = k[b, g, members].amin(0), k[b, g, members].amax(0)
                            bounds[p] = float(torch.maximum(qi * low, qi * high).sum())
                        for p in sorted(bounds, key=lambda p: -bounds[p])[:take]:
                            keys += ranked[p * page:(p + 1) * page]
                if keys:
                    logits = torch.stack([qi @ k[b, g, j] for j in keys]) * scale
                    out[b, h, i] = torch.softmax(logits, 0) @ v[b, g, keys]
    return out


def _cache(n=45, pad=(0, 11), D=8, Hkv=2):
    g = torch.Generator().manual_seed(fixed_seed())
    k = torch.randn(len(pad), Hkv, n, D, generator=g, dtype=torch.float64)
    v = torch.randn(len(pad), Hkv, n, D, generator=g, dtype=torch.float64)
    real = torch.ones(len(pad), n, dtype=torch.bool)
    for b, p in enumerate(pad):
        real[b, :p] = False  # left padding, as generate() batches prompts
    return k, v, real, g


@pytest.mark.parametrize("budget", [1, 3, 10, 17, 0.15, 0.4])
@pytest.mark.parametrize("page", [None, 4, 5])
@pytest.mark.parametrize("Lq", [1, 4])
def test_matches_reference(budget, page, Lq):
    k, v, real, g = _cache()
    q = torch.randn(2, 4, Lq, 8, generator=g, dtype=torch.float64)
    if page is None:
        got = oracle_attention(q, k, v, AttentionMask(~real, causal=True), budget, 0.4)
    else:
        got = quest_attention(q, k, v, AttentionMask(~real, causal=True), budget, page, 0.4)
    torch.testing.assert_close(got, reference(q, k, v, real, budget, 0.4, page), rtol=0, atol=1e-12)


@pytest.mark.parametrize("page", [None, 4])
def test_covering_budget_is_dense_and_a_sequence_alone_reads_the_same(page):
    k, v, real, g = _cache(n=33, pad=(0, 9))
    n, Lq = 33, 3
    q = torch.randn(2, 4, Lq, 8, generator=g, dtype=torch.float64)

    def run(q, k, v, padding, budget):
        mask = AttentionMask(padding, causal=True)
        return (oracle_attention(q, k, v, mask, budget, 0.3) if page is None else
                quest_attention(q, k, v, mask, budget, page, 0.3))

    got = run(q, k, v, ~real, 1.0)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    allowed = real[:, None, None, :] & (torch.arange(n) <= torch.arange(n - Lq, n).unsqueeze(1))
    want = torch.softmax((q @ kk.transpose(-1, -2) * 0.3).masked_fill(~allowed, float("-inf")), -1) @ vv
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    sparse = run(q, k, v, ~real, 0.3)
    alone = run(q[1:], k[1:, :, 9:], v[1:, :, 9:], None, 0.3)  # row 1 without its padding (page edges move)
    torch.testing.assert_close(alone, sparse[1:], rtol=0, atol=1e-12)  # Quest's pages are cut from real keys


@pytest.mark.parametrize("budget", [1, 2, 5, 9, 0.2])
@pytest.mark.parametrize("page", [None, 3, 4])
def test_every_key_read_counts_against_the_budget(budget, page):
    """Values one-hot per position: each query's output has a non-zero weight exactly on the keys it read."""
    k, _v, real, g = _cache(n=40, pad=(0, 7))
    n = 40
    v = torch.eye(n, dtype=torch.float64).expand(2, 2, n, n)
    for Lq in (1, 3):
        q = torch.randn(2, 4, Lq, 8, generator=g, dtype=torch.float64)
        out = (oracle_attention(q, k, v, AttentionMask(~real, causal=True), budget, 0.3) if page is None else
               quest_attention(q, k, v, AttentionMask(~real, causal=True), budget, page, 0.3))
        read = (out > 0).sum(-1)  # (B, H, Lq)
        allowed = keys_allowed(budget, real.sum(1)).view(2, 1, 1)
        assert bool((read <= allowed).all()), (read, allowed)
        assert bool((out.masked_fill(real.view(2, 1, 1, n), 0) == 0).all())  # no padding key
        later = torch.arange(n) > (n - Lq + torch.arange(Lq)).view(Lq, 1)
        assert bool((out.masked_fill(~later, 0) == 0).all())  # no later key
        if page is None:  # the oracle uses its whole budget
            assert bool((read == allowed).all())
