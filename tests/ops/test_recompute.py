"""recompute_saved (clusterformer.ops.recompute): gradients bit for bit as without it, the tensor it covers freed
after the forward, one recomputation per backward, the autocast state of the forward, and the caller's own
saved-tensor hooks left in charge."""

from __future__ import annotations

import gc
import weakref
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

import clusterformer.attention.base as attention_base
import clusterformer.attention.neural_clustering as neural_clustering_module
from clusterformer.attention import build
from clusterformer.bench.memory import training_pass_memory
from clusterformer.ops.recompute import recompute_saved, recompute_saved_all

SEED = 20261126


def _inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(37, 6, generator=g, dtype=dtype).requires_grad_()
    w = torch.randn(5, 6, generator=g, dtype=dtype).requires_grad_()
    rows = torch.randint(0, 37, (41,), generator=g)
    return x, w, rows


def _loss(x, w, rows, recompute: bool, calls: list | None = None):
    """Three consumers of one gathered tensor (a slice and the whole), as neural clustering projects q, k, v."""
    gathered = x.index_select(0, rows)

    def again():
        if calls is not None:
            calls.append(1)
        return x.index_select(0, rows)

    with (recompute_saved(gathered, again) if recompute else torch.autograd.graph.saved_tensors_hooks(
            lambda t: t, lambda t: t)):
        q = F.linear(gathered[3:29], w)
        k = F.linear(gathered, w).tanh()
        v = gathered * gathered.sum(-1, keepdim=True)
    return (q.pow(2).sum() + k.sum() + v.pow(3).sum()), weakref.ref(gathered)


def test_gradients_are_bit_for_bit_those_without_recomputation():
    grads = []
    for recompute in (False, True):
        x, w, rows = _inputs()
        loss, _ = _loss(x, w, rows, recompute)
        grads.append(torch.autograd.grad(loss, (x, w)))
    for plain, recomputed in zip(*grads, strict=True):
        assert torch.equal(plain, recomputed)


def test_the_covered_tensor_is_freed_after_the_forward_and_recomputed_once_per_backward():
    x, w, rows = _inputs()
    calls = []
    loss, gathered = _loss(x, w, rows, True, calls)
    gc.collect()
    assert gathered() is None  # nothing keeps it between the forward and the backward (the graph is alive: loss)
    assert calls == []
    loss.backward(retain_graph=True)
    assert calls == [1]  # three saved views, one recomputation
    first = x.grad.clone()
    x.grad = None
    loss.backward()
    assert calls == [1, 1] and torch.equal(x.grad, first)  # a second backward recomputes


def test_without_the_block_the_tensor_lives_until_the_backward():
    """The control for the test above: the plain graph keeps the gathered rows."""
    x, w, rows = _inputs()
    _graph_alive, gathered = _loss(x, w, rows, False)
    gc.collect()
    assert gathered() is not None


def test_recomputation_runs_under_the_forwards_autocast_state():
    """The covered tensor is a projection made under bf16 autocast (as P = x W^C is in mixed-precision training);
    the backward runs outside autocast, so the recipe must restore it to rebuild the same bf16 tensor."""
    grads = []
    for recompute in (False, True):
        x, w, _ = _inputs(torch.float32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            p = F.linear(x, w)
            assert p.dtype == torch.bfloat16
            with (recompute_saved(p, lambda x=x, w=w: F.linear(x, w)) if recompute
                  else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)):
                loss = (p * p).sum() + (p.tanh() @ w).sum()
        grads.append(torch.autograd.grad(loss.float(), (x, w)))
    for plain, recomputed in zip(*grads, strict=True):
        assert torch.equal(plain, recomputed)


def test_the_callers_saved_tensor_hooks_stay_in_charge():
    """Under torch.utils.checkpoint (its own hooks) the block steps aside; the gradients are unchanged."""
    calls = []
    x, w, rows = _inputs()
    loss = torch.utils.checkpoint.checkpoint(lambda a, b: _loss(a, b, rows, True, calls)[0], x, w,
                                             use_reentrant=False)
    got = torch.autograd.grad(loss, (x, w))
    x2, w2, _ = _inputs()
    want = torch.autograd.grad(_loss(x2, w2, rows, False)[0], (x2, w2))
    assert calls == []
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_an_empty_tensor_passes_through():
    x = torch.zeros(0, 4, requires_grad=True)
    with recompute_saved(x, lambda: pytest.fail("nothing to recompute")):
        y = (x * x).sum()
    y.backward()
    assert x.grad.shape == (0, 4)


def _alive_after_forward(name: str, length: int = 484, **options):
    """Bytes of tensors alive after a training forward (what the graph keeps for the backward, and the output), the
    input's gradient after a backward, and the input's bytes. The default length, 484 = 22 clusters x chunks of 22,
    leaves neural clustering no empty slot, so its CPU path needs no window mask (which SDPA keeps, and which the
    fused GPU kernel does not build)."""
    torch.manual_seed(SEED)
    layer = build(name, dim=64, heads=4, **options)
    x = torch.randn(2, length, 64, requires_grad=True)
    alive, _ = training_pass_memory(layer, x)
    return alive, x.grad, x.numel() * x.element_size()


def test_neural_clustering_keeps_what_full_attention_keeps_plus_integers(monkeypatch):
    """The memory target (docs/speed-and-memory.md#memory), after the forward: full keeps its Q/K/V projection, SDPA's
    output and the output projection's; neural clustering the same plus its layout's integers (O(N)), neither its sorted
    copy of x nor the reordered copy of its output, which the backward rebuilds. With the blocks replaced by nothing it
    keeps both (about 2x the input more): a block that kept its source, or that caught an op saving its own output (a
    reference cycle keeping the clustering's graph alive), fails this. Both give the same gradients."""
    full, _, x_bytes = _alive_after_forward("full")
    with_recompute, grad, _ = _alive_after_forward("neural-clustering")
    assert with_recompute <= full + 0.3 * x_bytes, (with_recompute, full, x_bytes)
    monkeypatch.setattr(neural_clustering_module, "recompute_saved", lambda source, recompute: nullcontext())
    monkeypatch.setattr(attention_base, "recompute_saved", lambda source, recompute: nullcontext())
    without, grad_without, _ = _alive_after_forward("neural-clustering")
    assert without - with_recompute >= 1.8 * x_bytes, (without, with_recompute, x_bytes)
    assert torch.equal(grad, grad_without)


def test_cluster_select_keeps_neither_band_copy(monkeypatch):
    """The banded kernel's bands are shifted copies of the keys and of the values (``width`` chunks each per query
    chunk); the products that read them keep a recipe instead, so after the forward at least 3x the input's bytes
    fewer are alive than with the blocks replaced by nothing (4x measured: each band is twice the input here; one
    band kept fails this). Both give the same gradients."""
    import clusterformer.ops.selected as kernels_module
    import clusterformer.ops.selected_band as band_module

    with_recompute, grad, x_bytes = _alive_after_forward("cluster-select", 600, kernel="banded")
    for module in (kernels_module, band_module):  # the attention's products and the band's scores
        monkeypatch.setattr(module, "recompute_saved", lambda source, recompute: nullcontext())
    without, grad_without, _ = _alive_after_forward("cluster-select", 600, kernel="banded")
    assert without - with_recompute >= 3 * x_bytes, (without, with_recompute, x_bytes)
    assert torch.equal(grad, grad_without)


def test_one_block_rebuilds_several_sources_and_keeps_those_without_a_recipe():
    """recompute_saved_all: saved-tensor hooks do not nest, so one block covers several sources. Both gathered
    tensors are rebuilt (each once), the one paired with None is kept as usual, and the gradients are the same."""
    x, w, rows = _inputs()
    calls = []

    def loss_of(x, w, recipes: bool):
        a, b, c = x.index_select(0, rows), x.index_select(0, rows.flip(0)), x.index_select(0, rows[:9])
        pairs = [(a, lambda: (calls.append("a"), x.index_select(0, rows))[1]),
                 (b, lambda: (calls.append("b"), x.index_select(0, rows.flip(0)))[1]),
                 (c, None)]
        with recompute_saved_all(pairs) if recipes else nullcontext():
            y = (a @ w.T).sum() * (b @ w.T).sum() + (c @ w.T).pow(2).sum()
        return y, weakref.ref(a), weakref.ref(b), weakref.ref(c)

    y, a, b, c = loss_of(x, w, True)
    gc.collect()
    assert a() is None and b() is None  # not kept by the graph
    assert c() is not None  # paired with None: kept
    got = torch.autograd.grad(y, (x, w))
    assert sorted(calls) == ["a", "b"]
    x2, w2, _ = _inputs()
    want = torch.autograd.grad(loss_of(x2, w2, False)[0], (x2, w2))
    for g, h in zip(got, want, strict=True):
        assert torch.equal(g, h)
