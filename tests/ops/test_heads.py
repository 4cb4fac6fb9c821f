"""ops/heads.py: q, k, v as strided views of the fused projection, and their gradients written back into its layout;
the fused kernels reading and writing those views in place give the bits they give on contiguous copies."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F

from clusterformer.masks import AttentionMask
from clusterformer.ops import listed_attention as la
from clusterformer.ops import spherical as sp
from clusterformer.ops.heads import empty_heads, gradient_buffers, split_heads, unit_rows
from seeds import fixed_seed

needs_kernel = pytest.mark.skipif(not la.extension_available(), reason=f"no fused kernel: {la.extension_error()}")


def _projection(B, N, P, H, D, seed_offset=0):
    g = torch.Generator().manual_seed(fixed_seed() + seed_offset)
    return torch.randn(B, N, P * H * D, generator=g, dtype=torch.float64, requires_grad=True)


def _by_permute(projected, P, H):
    """The split written plainly: view, permute, unbind (autograd's own backward)."""
    B, N, width = projected.shape
    return projected.view(B, N, P, H, width // (P * H)).permute(2, 0, 3, 1, 4).unbind(0)


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("used", ["all", "some"])
def test_split_heads_are_views_whose_gradient_equals_the_permutes(parts, used):
    """The parts are (B, H, N, D) views of the projection (no copy), equal to the permuted view; the gradient it gets
    back equals autograd's through view + permute + unbind, zero for a part no loss reads."""
    B, N, H, D = 2, 5, 3, 4
    projected = _projection(B, N, parts, H, D)
    views = split_heads(projected, parts, H)
    plain = _by_permute(projected, parts, H)
    g = torch.Generator().manual_seed(fixed_seed() + 1)
    weights = [torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(parts)]
    read = range(parts) if used == "all" else [parts - 1]
    for view, expected in zip(views, plain, strict=True):
        assert view.shape == (B, H, N, D) and torch.equal(view, expected)
        assert view.untyped_storage().data_ptr() == projected.untyped_storage().data_ptr()  # a view, not a copy
    (grad,) = torch.autograd.grad(sum((views[p] * weights[p]).sum() for p in read), projected)
    (expected,) = torch.autograd.grad(sum((plain[p] * weights[p]).sum() for p in read), projected)
    assert torch.equal(grad, expected)
    if used == "some":
        assert (grad.view(B, N, parts, H, D)[:, :, 0] == 0).all()


class _WritesIntoBuffers(torch.autograd.Function):
    """out = q * a + k * b + v * c, whose backward writes the gradients into gradient_buffers, as the fused kernel
    does (dk and dv accumulated into zeros); records the buffers' addresses."""

    seen: ClassVar[list[int]] = []

    @staticmethod
    def forward(ctx, q, k, v, a, b, c):
        ctx.save_for_backward(q, k, v, a, b, c)
        return q * a + k * b + v * c

    @staticmethod
    def backward(ctx, grad):
        q, k, v, a, b, c = ctx.saved_tensors
        dq, dk, dv = gradient_buffers(q, k, v, zero=(False, True, True))
        _WritesIntoBuffers.seen.append(dq.data_ptr())
        dq.copy_(grad * a)
        dk.add_(grad * b)
        dv.add_(grad * c)
        return dq, dk, dv, None, None, None


@pytest.mark.parametrize("k_twice", [False, True])
def test_gradients_written_into_the_buffers_come_back_in_place(k_twice):
    """Gradients written into gradient_buffers' slots reach the projection as that buffer itself (no copy); where k
    also feeds another loss (the clustering's commitment), the summed gradient is written into k's slot: the values
    equal autograd's through the permutes either way."""
    B, N, H, D = 2, 6, 2, 3
    projected = _projection(B, N, 3, H, D)
    g = torch.Generator().manual_seed(fixed_seed() + 2)
    a, b, c = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(3))
    arrived = []
    projected.register_hook(lambda grad: arrived.append(grad.data_ptr()))

    def loss(q, k, v, fused):
        out = _WritesIntoBuffers.apply(q, k, v, a, b, c) if fused else q * a + k * b + v * c
        return (out * out).sum() + ((k ** 3).sum() if k_twice else 0)

    _WritesIntoBuffers.seen.clear()
    (grad,) = torch.autograd.grad(loss(*split_heads(projected, 3, H), fused=True), projected)
    (expected,) = torch.autograd.grad(loss(*_by_permute(projected, 3, H), fused=False), projected)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)
    assert arrived[0] == _WritesIntoBuffers.seen[0], "the buffer the backward wrote is the projection's gradient"


def test_gradient_buffers_share_one_buffer_only_for_a_projections_consecutive_parts():
    B, N, H, D = 2, 4, 3, 5
    q, k, v = split_heads(_projection(B, N, 3, H, D).detach(), 3, H)
    dq, dk, dv = gradient_buffers(q, k, v, zero=(True, True, False))
    assert dq._base is dk._base is dv._base and dq._base.shape == (B, N, 3, H, D)
    assert (dq == 0).all() and (dk == 0).all()
    for parts in [(k, q, v), (q, k), (q.contiguous(), k, v), (q, q, v)]:  # another order, fewer, a copy, repeated
        grads = gradient_buffers(*parts, zero=(True,) * len(parts))
        assert len({grad.data_ptr() for grad in grads}) == len(parts) and all(grad._base is None or
                                                                              grad._base.shape != (B, N, 3, H, D)
                                                                              for grad in grads)
        assert all((grad == 0).all() and grad.transpose(1, 2).is_contiguous() for grad in grads)
    with pytest.raises(ValueError, match="zero must say"):
        gradient_buffers(q, k, v, zero=(True,))
    with pytest.raises(ValueError, match="projected's last dim 10 is not parts=3"):
        split_heads(torch.zeros(1, 2, 10), 3, 2)


def test_empty_heads_join_as_a_view_and_unit_rows_copies_only_what_it_must():
    like = torch.zeros(1)
    out = empty_heads(2, 3, 4, 5, like=like)
    assert out.shape == (2, 3, 4, 5) and out.transpose(1, 2).is_contiguous()
    view = torch.randn(2, 3, 4, 5).transpose(1, 2)
    assert unit_rows(view) is view
    columns = torch.randn(2, 3, 5, 4).transpose(2, 3)  # stride 4 along the last dim
    copied = unit_rows(columns)
    assert copied.stride(-1) == 1 and torch.equal(copied, columns)


@needs_kernel
@pytest.mark.parametrize("D", [3, 64])  # 64: a head size the kernels unroll
@pytest.mark.parametrize("with_runs", [False, True])
def test_the_kernels_read_and_write_projection_views_as_they_do_copies(D, with_runs):
    """Listed attention (forward, the three gradients), on q, k, v as views of one projection and on contiguous
    copies: the same bits -- a row stride wrong anywhere would read other heads' or tokens' values. Also with a key
    padding mask and the window read in place."""
    B, N, H, M = 2, 11, 2, 3
    projected = _projection(B, N, 3, H, D, seed_offset=3)
    g = torch.Generator().manual_seed(fixed_seed() + 4)
    index = torch.randint(-1, N, (B, H, N, M), generator=g)
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[1, -3:] = True
    runs = None
    if with_runs:
        order = torch.stack([torch.randperm(N, generator=g) for _ in range(B * H)]).view(B, H, N)
        length = torch.randint(0, 3, (B, H, N, 2), generator=g)
        runs = la.SlotRuns(order, (torch.rand(B, H, N, 2, generator=g) * (N - length + 1)).long(), length, 2)
    weight = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)

    def run(split):
        q, k, v = split(projected)
        out, lse = la.listed_attention(q, k, v, index, 0.7, window=3, window_offset=2, mask=AttentionMask(pad),
                                       runs=runs)
        return (out, lse, *torch.autograd.grad((out * weight).sum() + lse.sum(), projected))

    strided = run(lambda x: split_heads(x, 3, H))
    copied = run(lambda x: tuple(t.contiguous() for t in _by_permute(x, 3, H)))
    for a, b in zip(strided, copied, strict=True):
        assert torch.equal(a, b)
    assert strided[0].transpose(1, 2).is_contiguous(), "the output is laid out as its heads are joined"


@needs_kernel
@pytest.mark.parametrize("D", [3, 64])
def test_the_selection_and_assignment_kernels_read_projection_views_as_copies(D):
    """bound_groups, summary_logits, top_members and the spherical assignment (ids, distance, sums, the distance's
    gradient) on views of one projection and on contiguous copies: the same bits."""
    B, N, H, G = 2, 13, 2, 3
    projected = _projection(B, N, 3, H, D, seed_offset=5)
    g = torch.Generator().manual_seed(fixed_seed() + 6)
    ids = torch.randint(0, G + 1, (B, H, N), generator=g)
    order = torch.stack([torch.randperm(N, generator=g) for _ in range(B * H)]).view(B, H, N)
    length = torch.randint(0, 6, (B, H, N, 4), generator=g)
    runs = la.SlotRuns(order, (torch.rand(B, H, N, 4, generator=g) * (N - length + 1)).long(), length, 5)
    mu = F.normalize(torch.randn(H, 4, D, generator=g, dtype=torch.float64), dim=-1)
    prefix = F.pad(torch.randn(B, H, N, D, generator=g, dtype=torch.float64).cumsum(2), (0, 0, 1, 0))
    total = torch.tensor([5, 4, 4]).expand(B, H, G)  # three groups of the N = 13 sorted rows
    start = torch.cumsum(total, -1) - total
    lower = torch.randint(0, 3, (B, H, N, G), generator=g)
    summaries = la.RangeSummaries(prefix, prefix, start, total, lower, lower + torch.randint(0, 2, lower.shape,
                                                                                             generator=g))
    weight = torch.randn(B, H, N, generator=g, dtype=torch.float64)

    def run(split):
        q, k, _ = split(projected)
        bounds = la.bound_groups(q, k, ids, num_groups=G, window=2, causal=True, block=2)
        chosen = la.bound_groups(q, k, ids, num_groups=G, window=2, causal=False, block=3, select=2)
        members = la.top_members(q, k, runs, per_group=2, keep=2)
        logits = la.summary_logits(q, summaries, 0.6)
        assignment = sp.spherical_assignment(k, mu)
        (grad,) = torch.autograd.grad((assignment.gap * weight).sum(), projected)
        return bounds, chosen, members, logits, assignment.ids, assignment.gap, assignment.sums, grad

    strided = run(lambda x: split_heads(x, 3, H))
    copied = run(lambda x: tuple(t.contiguous() for t in _by_permute(x, 3, H)))
    for a, b in zip(strided, copied, strict=True):
        assert torch.equal(a, b)
