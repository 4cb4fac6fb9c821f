"""``"cluster-select"`` is strictly causal bit for bit in float32: an output at position t depends on the keys at
positions <= t alone, whatever the later tokens hold -- also where later values are a thousand times larger, which
makes any rounding error that mixes them in visible. Every kernel, with the summaries (the sums over a cluster's
members, the part that once read later keys through differences of prefix sums) and the summaries' ranking."""

from __future__ import annotations

import pytest
import torch

from clusterformer.attention import build
from clusterformer.masks import CAUSAL_MASK
from clusterformer.ops.listed_attention import extension_available
from clusterformer.ops.selected import selected_cluster_attention
from clusterformer.ops.selected_layout import cluster_layout
from clusterformer.ops.selected_ranking import summary_selection
from seeds import fixed_seed

KERNELS = ["gather", "banded", "dense-mask",
           pytest.param("fused", marks=pytest.mark.skipif(not extension_available(),
                                                          reason="cluster-select's fused kernel is not built here"))]
N, CUT = 512, 256  # positions >= CUT change; outputs at positions < CUT must not


def _changed_future(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x with its positions >= CUT replaced by other values, ``scale`` times larger."""
    other = x.clone()
    other[:, CUT:] = torch.randn_like(x[:, CUT:], dtype=torch.float64).to(x.dtype) * scale
    return other


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("selection", ["bound", "summaries"])
@pytest.mark.parametrize("scale", [1.0, 1000.0])
def test_later_tokens_leave_earlier_outputs_unchanged_in_float32(kernel, selection, scale):
    """The layer in evaluation, float32: later tokens at normal scale and a thousand times larger."""
    torch.manual_seed(fixed_seed())
    layer = build("cluster-select", dim=32, heads=2, num_clusters=8, select=2, cluster_keys=8, window=16,
                  selection=selection, kernel=kernel).eval()
    x = torch.randn(2, N, 32)
    with torch.no_grad():
        before = layer(x, causal=True)[:, :CUT]
        after = layer(_changed_future(x, scale), causal=True)[:, :CUT]
    assert before.abs().mean() > 0.01  # outputs of normal size: a change would show
    assert torch.equal(before, after), f"max change {float((before - after).abs().max()):.3g}"


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_kernels_summaries_ignore_later_keys_and_values_bit_for_bit(kernel):
    """The kernel alone on float32 q, k, v with given clusters and selections: later keys and values a thousand
    times larger, and later keys moved to other clusters, leave the earlier outputs and the summaries' ranking
    exactly as they were."""
    torch.manual_seed(fixed_seed())
    B, H, D, C = 1, 2, 16, 6
    q, k, v = (torch.randn(B, H, N, D) for _ in range(3))
    ids = torch.randint(0, C, (B, H, N))
    selected = torch.stack([torch.randperm(C)[:2] for _ in range(B * H * N)]).view(B, H, N, 2)
    options = {"num_clusters": C, "cluster_keys": 4, "window": 8, "mask": CAUSAL_MASK, "summaries": True}

    def run(k, v, ids):
        layout = cluster_layout(ids, num_clusters=C, window=8, causal=True)
        out = selected_cluster_attention(q, k, v, ids, selected, kernel=kernel, layout=layout, **options)
        ranked = summary_selection(q, k, ids, layout, select=2, window=8, mask=CAUSAL_MASK, kernel=kernel)
        return out[:, :, :CUT], ranked[:, :, :CUT]

    out, ranked = run(k, v, ids)
    later_k, later_v, later_ids = k.clone(), v.clone(), ids.clone()
    later_k[:, :, CUT:] *= 1000
    later_v[:, :, CUT:] *= 1000
    later_ids[:, :, CUT:] = torch.randint(0, C, (B, H, N - CUT))
    other, other_ranked = run(later_k, later_v, later_ids)
    assert torch.equal(out, other), f"max change {float((out - other).abs().max()):.3g}"
    assert torch.equal(ranked, other_ranked)
