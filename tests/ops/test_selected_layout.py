"""cluster-select's layout: each cluster's own prefix sums (:meth:`ClusterLayout.cluster_prefix`), which the
summaries of the gather and fused kernels and the summaries' ranking read, against their definition in float64 and
by gradcheck -- over clusters of several blocks (the blocks' segmented scan) and of one, with padding."""

from __future__ import annotations

import pytest
import torch

import clusterformer.ops.selected_layout as selected_layout
from clusterformer.masks import AttentionMask
from clusterformer.ops.listed_attention import extension_available
from clusterformer.ops.selected import selected_cluster_attention
from clusterformer.ops.selected_layout import cluster_layout
from seeds import fixed_seed


def _ids(B, H, N, C, g):
    ids = torch.randint(0, C, (B, H, N), generator=g)
    ids[1, :, -3:] = C  # padding: in no cluster
    return ids


@pytest.mark.parametrize("block", [1, 2, 3, 16])
@pytest.mark.parametrize(("N", "C"), [(1, 1), (7, 1), (40, 3), (64, 9)])
def test_each_clusters_prefix_sums_are_its_members_sums_in_position_order(block, N, C, monkeypatch):
    """Row prefix_start[c] + r holds the sum of cluster c's first r members (by position): exactly 0 for r = 0,
    to 1e-12 otherwise, for every r up to the cluster's size; the rows fit R = (ceil(N / block) + C) blocks."""
    monkeypatch.setattr(selected_layout, "PREFIX_BLOCK", block)
    g = torch.Generator().manual_seed(fixed_seed())
    B, H, D = 2, 2, 3
    ids = _ids(B, H, N, C, g) if N > 3 else torch.randint(0, C, (B, H, N), generator=g)
    x = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    layout = cluster_layout(ids, num_clusters=C, window=2, causal=True)
    prefix = layout.cluster_prefix(x)
    assert prefix.shape == (B, H, (-(-N // block) + C) * block, D)
    for b in range(B):
        for h in range(H):
            for c in range(C):
                members = x[b, h, ids[b, h] == c]  # in position order
                first = int(layout.prefix_start[b, h, c])
                assert torch.equal(prefix[b, h, first], torch.zeros(D, dtype=torch.float64))
                for r in range(1, len(members) + 1):
                    torch.testing.assert_close(prefix[b, h, first + r], members[:r].sum(0), rtol=1e-12, atol=1e-12)


def test_the_prefix_sums_gradcheck():
    """Through the gather, the blocks' cumsums and their segmented scan (blocks of 2: several per cluster)."""
    g = torch.Generator().manual_seed(fixed_seed())
    ids = _ids(2, 1, 11, 2, g)
    x = torch.randn(2, 1, 11, 2, generator=g, dtype=torch.float64, requires_grad=True)
    layout = cluster_layout(ids, num_clusters=2, window=2, causal=True)
    original = selected_layout.PREFIX_BLOCK
    selected_layout.PREFIX_BLOCK = 2
    try:
        assert torch.autograd.gradcheck(layout.cluster_prefix, (x,))
    finally:
        selected_layout.PREFIX_BLOCK = original


@pytest.mark.parametrize("kernel", ["gather", pytest.param("fused", marks=pytest.mark.skipif(
    not extension_available(), reason="cluster-select's fused kernel is not built here"))])
@pytest.mark.parametrize("causal", [True, False])
def test_the_summaries_over_several_blocks_gradcheck(kernel, causal, monkeypatch):
    """The gather and fused kernels' summaries read from prefix sums in blocks of 2 (each cluster over several
    blocks): gradcheck in float64 with padding, on q, k and v (the fused kernel's gradient reaches the prefix sums
    and through them the keys and values)."""
    monkeypatch.setattr(selected_layout, "PREFIX_BLOCK", 2)
    torch.manual_seed(fixed_seed())
    B, H, N, D, C = 1, 2, 11, 3, 2
    q, k, v = (torch.randn(B, H, N, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    key_ids = torch.randint(0, C, (B, H, N))
    key_ids[..., -1] = C  # padding
    pad = key_ids[:, 0] == C
    selected = torch.randint(0, C, (B, H, N, 1))

    def fn(q, k, v):
        out = selected_cluster_attention(q, k, v, key_ids, selected, num_clusters=C, cluster_keys=1, window=2,
                                         mask=AttentionMask(pad, causal), kernel=kernel, summaries=True)
        return out[:, :, :-1]

    assert torch.autograd.gradcheck(fn, (q, k, v))
