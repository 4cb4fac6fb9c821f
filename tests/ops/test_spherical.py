"""ops/spherical.py: the fused spherical assignment (nearest unit centroid, commitment distance, per-cluster sums)
against a float64 loop over tokens written from the definition, the tensor composition against the same loop, the
kernel's gradient against the composition's autograd and by gradcheck, batch invariance, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from clusterformer.ops import spherical as sp
from extensions_off import run_without_extensions
from seeds import fixed_seed

needs_kernel = pytest.mark.skipif(not sp.spherical_extension_available(), reason="no fused spherical kernel")

SHAPES = [  # (B, H, N, D, C): one centroid, one token, the head sizes the kernel unrolls (16, 32, 64, 128) and others
    (2, 3, 7, 5, 4), (1, 2, 1, 3, 1), (3, 1, 11, 16, 6), (2, 2, 9, 32, 3), (1, 2, 6, 64, 9), (1, 1, 5, 128, 2),
    (2, 1, 4, 1, 3),
]


def _inputs(B, H, N, D, C, dtype=torch.float64):
    g = torch.Generator().manual_seed(fixed_seed())
    k = torch.randn(B, H, N, D, generator=g, dtype=dtype)
    k[0, 0, 0] = 0  # a zero key: u = 0 (F.normalize's eps), every cosine 0, the first centroid
    mu = F.normalize(torch.randn(H, C, D, generator=g, dtype=dtype), dim=-1)
    bias = 0.3 * torch.randn(H, C, generator=g, dtype=dtype)
    real = torch.rand(B, N, generator=g) > 0.3
    return k, mu, bias, real


def _loop(k, mu, bias, real):
    """The definition, one token at a time: u = k / max(|k|, 1e-12); id = the first c of largest u . mu_c + b_c;
    gap = |u - mu_id|^2; sums and counts over the real tokens."""
    B, H, N, D = k.shape
    C = mu.shape[1]
    ids = torch.zeros(B, H, N, dtype=torch.long)
    gap = torch.zeros(B, H, N, dtype=k.dtype)
    sums = torch.zeros(H, C, D, dtype=k.dtype)
    counts = torch.zeros(H, C, dtype=k.dtype)
    for b in range(B):
        for h in range(H):
            for n in range(N):
                u = k[b, h, n] / max(float(k[b, h, n].norm()), 1e-12)
                scores = [float(u @ mu[h, c]) + (0.0 if bias is None else float(bias[h, c])) for c in range(C)]
                best = scores.index(max(scores))
                ids[b, h, n] = best
                gap[b, h, n] = (u - mu[h, best]).square().sum()
                if real is None or real[b, n]:
                    sums[h, best] += u
                    counts[h, best] += 1
    return ids, gap, sums, counts


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("fused", [pytest.param(True, marks=needs_kernel), False])
def test_assignment_matches_the_definition(shape, with_bias, fused):
    k, mu, bias, real = _inputs(*shape)
    bias = bias if with_bias else None
    assign = sp.spherical_assignment if fused else sp.spherical_assignment_reference
    got = assign(k, mu, bias=bias, real=real)
    ids, gap, sums, counts = _loop(k, mu, bias, real)
    assert torch.equal(got.ids, ids)
    for name, a, b in (("gap", got.gap, gap), ("sums", got.sums, sums), ("counts", got.counts, counts)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=name)
    if mu.shape[1] > 2 and k.shape[-1] > 1 and got.ids.numel() >= 8:
        assert got.ids.unique().numel() > 1, "the case must use several centroids"
    assert got.counts.sum() == real.sum() * k.shape[1], "padding must count in no cluster"


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_gradient_matches_the_composition_autograd(shape):
    """The kernel's written-out gradient of the distances through the normalisation, against autograd through
    F.normalize; the zero key's gradient ((u - mu) / eps, about 1e12) compared relative to its size."""
    k, mu, bias, real = _inputs(*shape)
    weight = torch.randn(k.shape[:3], generator=torch.Generator().manual_seed(fixed_seed()), dtype=k.dtype)
    grads = []
    for assign in (sp.spherical_assignment, sp.spherical_assignment_reference):
        leaf = k.clone().requires_grad_()
        (assign(leaf, mu, bias=bias, real=real).gap * weight).sum().backward()
        grads.append(leaf.grad)
    fused, composed = grads
    torch.testing.assert_close(fused[0, 0, 0], composed[0, 0, 0], rtol=1e-12, atol=0)
    fused[0, 0, 0] = composed[0, 0, 0] = 0
    torch.testing.assert_close(fused, composed, rtol=0, atol=1e-10)


@needs_kernel
def test_kernel_gradcheck():
    g = torch.Generator().manual_seed(fixed_seed())
    k = torch.randn(2, 2, 5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    mu = F.normalize(torch.randn(2, 3, 6, generator=g, dtype=torch.float64), dim=-1)
    bias = torch.randn(2, 3, generator=g, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: sp.spherical_assignment(x, mu, bias=bias).gap, (k,))


@pytest.mark.parametrize("fused", [pytest.param(True, marks=needs_kernel), False])
def test_a_sequence_is_assigned_alike_alone_and_in_a_batch(fused):
    """Ids and distances of a sequence do not depend on the other sequences of the batch (float32, bitwise)."""
    k, mu, bias, real = _inputs(4, 2, 33, 64, 16, dtype=torch.float32)
    assign = sp.spherical_assignment if fused else sp.spherical_assignment_reference
    batch = assign(k, mu, bias=bias, real=real)
    alone = assign(k[2:3], mu, bias=bias, real=real[2:3])
    assert torch.equal(batch.ids[2:3], alone.ids)
    assert torch.equal(batch.gap[2:3], alone.gap)


@needs_kernel
def test_the_fallback_without_the_kernel_gives_the_same_assignment():
    """With the kernels off (a fresh interpreter), spherical_assignment is the composition; the same ids and
    distances as the kernel here."""
    k, mu, bias, real = _inputs(2, 2, 9, 8, 5)
    code = (f"import torch; from clusterformer.ops.spherical import spherical_assignment as a, _KERNEL; "
            f"k = torch.tensor({k.tolist()}, dtype=torch.float64); mu = torch.tensor({mu.tolist()}, "
            f"dtype=torch.float64); b = torch.tensor({bias.tolist()}, dtype=torch.float64); "
            f"r = torch.tensor({real.tolist()}); out = a(k, mu, bias=b, real=r); assert _KERNEL.load() is None; "
            f"print(out.ids.flatten().tolist()); print(repr(out.gap.flatten().tolist()))")
    ids, gap = run_without_extensions(code).splitlines()
    got = sp.spherical_assignment(k, mu, bias=bias, real=real)
    assert eval(ids) == got.ids.flatten().tolist()
    torch.testing.assert_close(torch.tensor(eval(gap), dtype=torch.float64), got.gap.flatten(), rtol=0, atol=1e-12)


@pytest.mark.parametrize(("change", "match"), [
    ({"k": torch.randn(2, 3, 4)}, "k must be a float tensor"),
    ({"k": torch.ones(1, 2, 3, 4, dtype=torch.long)}, "k must be a float tensor"),
    ({"centroids": torch.randn(3, 5, 4)}, "centroids must be"),
    ({"centroids": torch.randn(2, 0, 4)}, "centroids must be"),
    ({"bias": torch.randn(2, 4)}, "bias must be"),
    ({"real": torch.ones(1, 4, dtype=torch.bool)}, "real must be"),
    ({"real": torch.ones(1, 3)}, "real must be"),
])
def test_bad_input_raises_value_error_naming_it(change, match):
    args = {"k": torch.randn(1, 2, 3, 4), "centroids": F.normalize(torch.randn(2, 5, 4), dim=-1), "bias": None,
            "real": None, **change}
    with pytest.raises(ValueError, match=match):
        sp.spherical_assignment(args["k"], args["centroids"], bias=args["bias"], real=args["real"])
