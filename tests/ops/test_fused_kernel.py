"""The fused sorted-chunk kernel (ops/fused_chunked.py) against the dense float64 references.

Without a GPU the kernels run in Triton's CPU interpreter (conftest sets TRITON_INTERPRET=1), in float64,
so the tolerances are those of float64 (1e-10). On a GPU the same tests run compiled, on CUDA tensors."""

from __future__ import annotations

import math
from contextlib import nullcontext

import pytest
import torch

from reference import bucket_reference, cluster_causal_allowed, dense_reference, sorted_chunk_allowed

pytest.importorskip("triton")

from clusterformer.masks import AttentionMask
from clusterformer.ops import (
    bucketed_attention,
    cluster_causal_attention,
    sorted_chunk_attention,
    sorted_layout,
    use_fused_kernel,
    windowed_attention,
)
from clusterformer.ops.fused_chunked import fused_available, fused_chunk_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Compiled Triton has no float64 dot on every GPU; the interpreter does. Compare in the best dtype we have.
ON_GPU = DEVICE == "cuda"
DTYPE = torch.float32 if ON_GPU else torch.float64
TOL = 2e-5 if ON_GPU else 1e-10

pytestmark = pytest.mark.skipif(not fused_available(torch.zeros(1, device=DEVICE, dtype=DTYPE)),
                                reason="Triton cannot run here")


def _inputs(seed, B, H, N, D):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(3)], g


def _to_dev(ts):
    return [t.to(DEVICE, DTYPE).requires_grad_() for t in ts]


def _check(out, ref, grads_fused, grads_ref, pad):
    keep = torch.ones_like(ref, dtype=torch.bool) if pad is None else ~pad[:, None, :, None].expand_as(ref)
    assert torch.isfinite(out).all()
    err = (out.double().cpu() - ref).abs()[keep].max()
    assert err < TOL, f"output error {err:.2e}"
    for name, a, b in zip("qkv", grads_fused, grads_ref, strict=True):
        assert torch.isfinite(a).all(), name
        g_err = (a.double().cpu() - b).abs().max()
        assert g_err < TOL, f"d{name} error {g_err:.2e}"


# (seed, B, H, N, D, chunk, look_back, causal, padded): awkward sizes -- N not a multiple of the chunk, a
# single chunk (look-back clamps), look-back 3, head dims that are not powers of two, a whole padded sequence.
SORTED_CASES = [
    (0, 2, 2, 23, 8, 5, 1, False, True),
    (1, 2, 2, 23, 8, 5, 1, True, True),
    (2, 1, 3, 7, 20, 16, 1, False, False),
    (3, 2, 1, 40, 12, 4, 3, True, True),
    (4, 3, 2, 37, 16, 6, 2, False, False),
]


@pytest.mark.parametrize("seed,B,H,N,D,chunk,look_back,causal,padded", SORTED_CASES)
def test_sorted_chunk_fused_matches_dense_reference(seed, B, H, N, D, chunk, look_back, causal, padded):
    (q, k, v), g = _inputs(seed, B, H, N, D)
    ids = torch.randint(0, 4, (B, N), generator=g)
    pad = None
    if padded:
        pad = torch.zeros(B, N, dtype=torch.bool)
        pad[-1, N // 2 :] = True
        pad[0, 3] = True  # padding in the middle too
    qd, kd, vd = _to_dev((q, k, v))
    out = sorted_chunk_attention(qd, kd, vd, ids.to(DEVICE), chunk, look_back=look_back,
                                 mask=AttentionMask(None if pad is None else pad.to(DEVICE), causal), kernel="fused")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref = dense_reference(q, k, v, lambda b, h: sorted_chunk_allowed(ids[b], chunk, look_back, causal,
                                                                     None if pad is None else pad[b]))
    grad = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    if pad is not None:
        grad = grad.masked_fill(pad[:, None, :, None], 0.0)
    grads_ref = torch.autograd.grad(ref, (q, k, v), grad)
    grads_fused = torch.autograd.grad(out, (qd, kd, vd), grad.to(DEVICE, DTYPE))
    _check(out, ref, grads_fused, grads_ref, pad)


@pytest.mark.parametrize("seed,N,chunk,look_back", [(10, 29, 3, 1), (11, 18, 4, 2), (12, 9, 16, 1)])
def test_cluster_causal_fused_matches_dense_reference(seed, N, chunk, look_back):
    B, H, D, C = 2, 2, 8, 3
    (q, k, v), g = _inputs(seed, B, H, N, D)
    ids = torch.randint(0, C, (B, H, N), generator=g)  # per-head ids
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[1, N - 5 :] = True
    qd, kd, vd = _to_dev((q, k, v))
    out = cluster_causal_attention(qd, kd, vd, ids.to(DEVICE), chunk, C, look_back=look_back,
                                   mask=AttentionMask(pad.to(DEVICE), causal=True), kernel="fused")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref = dense_reference(q, k, v, lambda b, h: cluster_causal_allowed(ids[b, h], chunk, look_back, pad[b]))
    grad = torch.randn(ref.shape, generator=g, dtype=torch.float64).masked_fill(pad[:, None, :, None], 0.0)
    grads_ref = torch.autograd.grad(ref, (q, k, v), grad)
    grads_fused = torch.autograd.grad(out, (qd, kd, vd), grad.to(DEVICE, DTYPE))
    _check(out, ref, grads_fused, grads_ref, pad)


@pytest.mark.parametrize("causal", [False, True])
def test_bucketed_fused_matches_reference(causal):
    """Shared-QK rounds (exclude-self rule, log-sum-exp merge): the lse output's gradient is used."""
    B, H, N, D, R, nb, chunk = 2, 2, 21, 8, 3, 4, 4
    g = torch.Generator().manual_seed(20 + causal)
    qk = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    buckets = torch.randint(0, nb, (B, H, R, N), generator=g)
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[0, 15:] = True
    qkd, vd = _to_dev((qk, v))
    out = bucketed_attention(qkd, vd, buckets.to(DEVICE), chunk, num_buckets=nb,
                             mask=AttentionMask(pad.to(DEVICE), causal), kernel="fused")
    qk.requires_grad_()
    v.requires_grad_()
    ref = torch.stack([
        torch.stack([bucket_reference(qk[b, h], v[b, h], buckets[b, h], chunk, 1, causal, pad[b], nb)
                     for h in range(H)]) for b in range(B)])
    grad = torch.randn(ref.shape, generator=g, dtype=torch.float64).masked_fill(pad[:, None, :, None], 0.0)
    grads_ref = torch.autograd.grad(ref, (qk, v), grad)
    grads_fused = torch.autograd.grad(out, (qkd, vd), grad.to(DEVICE, DTYPE))
    keep = ~pad[:, None, :, None].expand_as(ref)
    assert (out.double().cpu() - ref).abs()[keep].max() < TOL
    for a, b in zip(grads_fused, grads_ref, strict=True):
        assert (a.double().cpu() - b).abs().max() < TOL


def test_fused_gradcheck_with_lse_and_every_mask():
    """gradcheck of the custom autograd op itself: out and lse, causal positions, groups, exclude-self,
    rows without any allowed key and rows that fall back to their own key."""
    if ON_GPU:
        pytest.skip("gradcheck needs float64 (the interpreter)")
    g = torch.Generator().manual_seed(30)
    w, hops, W, H, D = 3, 2, 3, 1, 4
    rows = (W + hops - 1) * w
    q = torch.randn(W * w, H, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(rows, H, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(rows, H, D, generator=g, dtype=torch.float64, requires_grad=True)
    key_ok = torch.rand(rows, generator=g) > 0.3
    key_ok[: hops * w] = False  # window 0 has no key at all
    positions = torch.randint(0, 6, (rows,), generator=g)
    groups = torch.randint(0, 2, (rows,), generator=g)

    def fn(q, k, v):
        out, lse = fused_chunk_attention(q, k, v, key_ok, w, hops, positions=positions, groups=groups,
                                         exclude_self=True, scale=0.7)
        return out, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))

    _, lse = fused_chunk_attention(q, k, v, key_ok, w, hops, positions=positions, groups=groups,
                                   exclude_self=True, scale=0.7)
    assert (~torch.isfinite(lse)).any(), "the case should include rows without any key"
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-8, fast_mode=True)


def test_rows_without_keys_give_zeros_and_finite_gradients():
    (q, k, v), _ = _inputs(40, 1, 2, 10, 8)
    pad = torch.ones(1, 10, dtype=torch.bool)  # nothing to attend to at all
    qd, kd, vd = _to_dev((q, k, v))
    out = sorted_chunk_attention(qd, kd, vd, torch.zeros(1, 10, dtype=torch.long, device=DEVICE), 4,
                                 mask=AttentionMask(pad.to(DEVICE)), kernel="fused")
    assert (out == 0).all()
    out.sum().backward()
    for t in (qd, kd, vd):
        assert torch.isfinite(t.grad).all() and (t.grad == 0).all()


def test_kernel_choice_is_validated():
    x = torch.zeros(1, 1, 4, 8)
    with pytest.raises(ValueError, match="kernel"):
        use_fused_kernel(x, 0.0, "triton")
    with pytest.raises(ValueError, match="dropout_p"):
        use_fused_kernel(x.to(DEVICE, DTYPE), 0.1, "fused")
    assert not use_fused_kernel(x, 0.0, "sdpa")
    assert not use_fused_kernel(x.cpu(), 0.0, "auto"), "auto must not send CPU tensors to the interpreter"


def test_fused_and_unfused_paths_agree_on_a_layer_sized_problem():
    """One larger case (several tiles per chunk, key tiles straddling chunks) against the unfused path,
    itself tested against the dense reference in test_ops.py."""
    g = torch.Generator().manual_seed(50)
    N, D, w = 150 if DEVICE == "cpu" else 3000, 16, 37 if DEVICE == "cpu" else 181
    ids = torch.randint(0, 5, (2, N), generator=g).to(DEVICE)
    layout = sorted_layout(ids, w, 1)
    H = 2
    x = torch.randn(layout.rows.numel(), H, 3, D, generator=g, dtype=torch.float64).to(DEVICE, DTYPE)
    q_rows = layout.query_rows(x[:, :, 0])
    W = layout.num_windows
    q_win = q_rows.view(W, w, H, D).transpose(1, 2)
    results = []
    for kernel in ("fused", "sdpa"):
        xs = x.detach().requires_grad_()
        q = layout.query_rows(xs[:, :, 0]).view(W, w, H, D).transpose(1, 2)
        out = windowed_attention(q, xs[:, :, 1], xs[:, :, 2], layout, mask=AttentionMask(causal=True), kernel=kernel)
        out.pow(2).sum().backward()
        results.append((out.detach(), xs.grad))
    assert q_win.shape == (W, H, w, D)
    tol = TOL * math.sqrt(w)
    assert (results[0][0] - results[1][0]).abs().max() < tol
    assert (results[0][1] - results[1][1]).abs().max() < tol



def test_fused_path_promotes_mixed_dtypes():
    """Under autocast a mechanism's float32 steps (normalised keys) meet half-precision queries, and the
    kernel multiplies in one dtype: the fused path casts to autocast's dtype, else promotes. It failed to
    compile on an H100 before ("Both operands must be same dtype")."""
    g = torch.Generator().manual_seed(51)
    N, D, w, H = 40, 8, 8, 2
    ids = torch.randint(0, 3, (1, N), generator=g).to(DEVICE)
    layout = sorted_layout(ids, w, 1)
    x = torch.randn(layout.rows.numel(), H, 3, D, generator=g, dtype=torch.float64).to(DEVICE, DTYPE)
    W = layout.num_windows
    low = torch.float16 if ON_GPU else torch.float32
    q = layout.query_rows(x[:, :, 0]).view(W, w, H, D).transpose(1, 2).to(low)
    fused = windowed_attention(q, x[:, :, 1], x[:, :, 2], layout, mask=AttentionMask(causal=True), kernel="fused")
    promoted = windowed_attention(q.to(DTYPE), x[:, :, 1], x[:, :, 2], layout, mask=AttentionMask(causal=True),
                                  kernel="sdpa")
    assert fused.dtype == DTYPE
    assert (fused - promoted).abs().max() < TOL


@pytest.mark.parametrize("kernel", ["fused", "sdpa"])
def test_the_output_recipe_rebuilds_the_output_and_its_gradients(kernel):
    """with_recipe: the recipe attached to the output (neural clustering's output projection keeps it instead of the
    reordered copy) gives the output bit for bit, and a consumer that keeps the recipe gets the same gradients."""
    from clusterformer.ops.recompute import recipe_of, recompute_saved

    g = torch.Generator().manual_seed(52)
    N, D, w, H = 45, 8, 8, 2
    ids = torch.randint(0, 4, (2, N), generator=g).to(DEVICE)
    layout = sorted_layout(ids, w, 1)
    x = torch.randn(layout.rows.numel(), H, 3, D, generator=g, dtype=torch.float64).to(DEVICE, DTYPE)
    weight = torch.randn(5, H * D, generator=g, dtype=torch.float64).to(DEVICE, DTYPE)
    W = layout.num_windows
    grads = []
    for keep_recipe in (False, True):
        xs = x.detach().requires_grad_()
        q = layout.query_rows(xs[:, :, 0]).view(W, w, H, D).transpose(1, 2)
        out = windowed_attention(q, xs[:, :, 1], xs[:, :, 2], layout, mask=AttentionMask(causal=True), kernel=kernel,
                                 with_recipe=True)
        recipe = recipe_of(out)
        assert torch.equal(recipe(), out)
        flat = out.flatten(1)
        with recompute_saved(flat, lambda recipe=recipe: recipe().flatten(1)) if keep_recipe else nullcontext():
            y = torch.nn.functional.linear(flat, weight)
        y.pow(2).sum().backward()
        grads.append(xs.grad)
    assert torch.equal(grads[0], grads[1])
    plain = windowed_attention(q, x[:, :, 1], x[:, :, 2], layout, mask=AttentionMask(causal=True), kernel=kernel)
    assert recipe_of(plain) is None  # only where asked


def _bucketed_kept(kernel: str, recipes: bool, monkeypatch) -> tuple[int, list[torch.Tensor], torch.Tensor, int]:
    """Bytes alive after bucketed_attention's forward (4 rounds), its gradients and output, and one (B, H, N, D)
    tensor's bytes; ``recipes=False`` runs it with the recipes replaced by nothing (every round's rows kept)."""
    import gc

    import clusterformer.ops.bucketed as bucketed_module
    from clusterformer.bench.memory import TensorMemoryTracker

    if not recipes:
        monkeypatch.setattr(bucketed_module, "attach_recipe", lambda tensor, recipe: tensor)
        monkeypatch.setattr(bucketed_module, "recompute_saved_all", lambda pairs: nullcontext())
    g = torch.Generator().manual_seed(61)
    B, H, N, D, R, nb, chunk = 1, 2, 160, 16, 4, 8, 16
    qk = torch.randn(B, H, N, D, generator=g, dtype=torch.float64).to(DEVICE, DTYPE).requires_grad_()
    v = torch.randn(B, H, N, D, generator=g, dtype=torch.float64).to(DEVICE, DTYPE).requires_grad_()
    buckets = torch.randint(0, nb, (B, H, R, N), generator=g).to(DEVICE)
    with TensorMemoryTracker() as tracker:
        out = bucketed_attention(qk, v, buckets, chunk, num_buckets=nb, kernel=kernel)
        gc.collect()
        kept = tracker.current_bytes
    out.backward(torch.randn(out.shape, generator=g, dtype=torch.float64).to(DEVICE, DTYPE))
    monkeypatch.undo()
    return kept, [qk.grad, v.grad], out.detach(), qk.numel() * qk.element_size()


@pytest.mark.parametrize("kernel", ["fused", "sdpa"])
def test_hashing_rounds_keep_no_gathered_rows(kernel, monkeypatch):
    """The rows gathered once per round (q, k, v: 3 x 4 rounds x the input's size) are rebuilt in the
    backward, and on the fused kernel the merge of the rounds rebuilds their reordered outputs (4 more) from the
    kernel's own. At least 11 (fused: 14) tensors of the input's size fewer alive after the forward than with the
    recipes replaced by nothing; the same output and gradients, bit for bit. Both kernels: the recipes go through
    the fused kernel's own backward and through the explicit products' saved-tensor hooks."""
    kept, grads, out, unit = _bucketed_kept(kernel, True, monkeypatch)
    kept_all, grads_all, out_all, _ = _bucketed_kept(kernel, False, monkeypatch)
    assert kept_all - kept >= (14 if kernel == "fused" else 11) * unit, (kept_all / unit, kept / unit)
    assert torch.equal(out, out_all)
    for a, b in zip(grads, grads_all, strict=True):
        if ON_GPU:  # the gathers' backward (index_add) sums the rounds with atomics on CUDA: run-to-run rounding
            assert (a - b).abs().max() <= 1e-5 * b.abs().max()
        else:
            assert torch.equal(a, b)


def test_the_fused_kernel_refuses_a_wrong_number_of_recipes():
    q = torch.zeros(16, 1, 8, device=DEVICE, dtype=DTYPE)
    with pytest.raises(ValueError, match="recipes must hold one entry"):
        fused_chunk_attention(q, q, q, torch.ones(16, dtype=torch.bool, device=DEVICE), 16, 1, scale=1.0,
                              recipes=(None, None))
