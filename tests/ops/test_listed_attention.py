"""ops/listed_attention.py: softmax attention over each query's own list of keys, by the C++ kernel and by the
gather it replaces, against a float64 loop over queries and list entries written from the definition; gradcheck of
the kernel's backward (the output's and the logsumexp's gradients)."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from clusterformer.masks import AttentionMask
from clusterformer.ops import listed_attention as la
from extensions_off import run_without_extensions
from seeds import fixed_seed

SHAPES = [  # (B, H, N, Nk, M, D): fewer and more keys than queries, one query, lists longer than Nk, D = 1; the
    # head sizes the kernel unrolls at compile time (16, 32, 64, 128) and one it does not
    (2, 3, 7, 9, 4, 5), (1, 2, 13, 13, 13, 3), (3, 1, 1, 4, 2, 2), (1, 1, 4, 3, 9, 6), (2, 2, 10, 10, 1, 1),
    (1, 2, 5, 6, 4, 16), (2, 1, 4, 5, 3, 32), (1, 1, 3, 4, 3, 64), (1, 1, 2, 3, 2, 128),
]

needs_kernel = pytest.mark.skipif(not la.extension_available(), reason=f"no fused kernel: {la.extension_error()}")


def _inputs(B, H, N, Nk, M, D, dtype=torch.float64):
    g = torch.Generator().manual_seed(fixed_seed())
    index = torch.randint(-1, Nk, (B, H, N, M), generator=g)  # -1: no key; repeats within a list included
    index[0, 0, 0] = -1  # a query without keys
    q = torch.randn(B, H, N, D, generator=g, dtype=dtype)
    k, v = (torch.randn(B, H, Nk, D, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v, index


def _loop_reference(q, k, v, index, scale, window=0, offset=0, pad=None):
    """One query at a time: the softmax over its window's real keys inside [0, Nk) and its listed entries (a key
    listed twice, or listed and in the window, counts twice)."""
    B, H, N, _ = index.shape
    Nk = k.shape[2]
    out = torch.zeros_like(q)
    lse = torch.full((B, H, N), -math.inf, dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            for i in range(N):
                in_window = [j for j in range(i - offset, i - offset + window)
                             if 0 <= j < Nk and (pad is None or not pad[b, j])]
                keys = in_window + [j for j in index[b, h, i].tolist() if j >= 0]
                if not keys:
                    continue
                scores = torch.stack([q[b, h, i] @ k[b, h, j] * scale for j in keys])
                weights = torch.softmax(scores, 0)
                out[b, h, i] = sum(w * v[b, h, j] for w, j in zip(weights, keys, strict=True))
                lse[b, h, i] = torch.logsumexp(scores, 0)
    return out, lse


def test_the_kernel_builds_where_a_compiler_and_ninja_exist():
    if shutil.which("c++") is None or shutil.which("ninja") is None:
        pytest.skip("no C++ compiler or ninja here")
    assert la.extension_available(), la.extension_error()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fused", [pytest.param(True, marks=needs_kernel), False])
def test_listed_attention_matches_a_loop_over_queries(shape, fused):
    q, k, v, index = _inputs(*shape)
    scale = 0.7
    fn = la.listed_attention if fused else la.listed_attention_reference
    out, lse = fn(q, k, v, index, scale)
    expected_out, expected_lse = _loop_reference(q, k, v, index, scale)
    torch.testing.assert_close(out, expected_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-12, atol=1e-12)  # -inf where a query has no key
    assert lse[0, 0, 0] == -math.inf and torch.equal(out[0, 0, 0], torch.zeros_like(out[0, 0, 0]))


WINDOWS = [(1, 0), (3, 2), (4, 2), (5, 0), (12, 6), (20, 19)]  # (window, offset): causal-like, centred, wider than N


@pytest.mark.parametrize(("window", "offset"), WINDOWS)
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("fused", [pytest.param(True, marks=needs_kernel), False])
def test_the_window_read_in_place_matches_a_loop_over_queries(window, offset, padded, fused):
    """The window, read without an index: keys i - offset .. i - offset + window - 1 inside [0, Nk), padding
    skipped (in the window only: the list is taken as given), beside listed keys; gradients against the gather."""
    q, k, v, index = _inputs(2, 2, 9, 11, 3, 4)
    pad = torch.zeros(2, 11, dtype=torch.bool)
    if padded:
        pad[0, 2:4] = True
        pad[1, -3:] = True
    scale = 0.9
    expected = _loop_reference(q, k, v, index, scale, window, offset, pad if padded else None)
    _assert_matches(q, k, v, index, scale, expected, fused, window=window, window_offset=offset,
                    mask=AttentionMask(pad if padded else None))


def _assert_matches(q, k, v, index, scale, expected, fused, **options):
    """The kernel (``fused``) or the gather on (q, k, v, index, scale, **options) against ``expected`` (out, lse) at
    1e-12; the kernel's gradients of out and the finite lse against the gather's autograd."""
    fn = la.listed_attention if fused else la.listed_attention_reference
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = fn(*inputs, index, scale, **options)
    torch.testing.assert_close(out, expected[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, expected[1], rtol=1e-12, atol=1e-12)
    if fused:
        finite = lse.isfinite()
        (out.sum() + lse[finite].sum()).backward()
        gathered = [t.clone().requires_grad_() for t in (q, k, v)]
        g_out, g_lse = la.listed_attention_reference(*gathered, index, scale, **options)
        (g_out.sum() + g_lse[finite].sum()).backward()
        for a, b in zip(inputs, gathered, strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
def test_listed_attention_kernel_gradcheck(shape):
    """dq, dk and dv from the output's and the logsumexp's gradients (lse read where finite: a query without keys
    has none)."""
    q, k, v, index = _inputs(*shape)
    finite = index.ge(0).any(-1)

    def fn(q, k, v):
        out, lse = la.listed_attention(q, k, v, index)
        return out, lse.masked_fill(~finite, 0.0)

    assert torch.autograd.gradcheck(fn, tuple(t.requires_grad_() for t in (q, k, v)))
    pad = torch.zeros(shape[0], shape[3], dtype=torch.bool)
    pad[0, -1] = True

    def windowed(q, k, v):  # a window of 3 ending at the query, with padding: every query keeps a key or two
        out, lse = la.listed_attention(q, k, v, index, window=3, window_offset=2, mask=AttentionMask(pad))
        return out, lse.masked_fill(lse.isinf(), 0.0)

    assert torch.autograd.gradcheck(windowed, (q, k, v))


@needs_kernel
def test_listed_attention_kernel_gradients_equal_the_gathers_in_float32():
    """The kernel in float32 (the dtype of training) against the gather's autograd: values and gradients."""
    q, k, v, index = _inputs(2, 2, 33, 40, 17, 16, dtype=torch.float32)
    grads = []
    for fn in (la.listed_attention, la.listed_attention_reference):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = fn(*inputs, index)
        (out.pow(2).sum() + lse.masked_fill(lse.isinf(), 0.0).sum()).backward()
        grads.append([out, lse, *(t.grad for t in inputs)])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda a: {**a, "q": a["q"][0]}, "q must be 4-D"),
        (lambda a: {**a, "k": a["k"][:, :1]}, "k and v must both have shape"),
        (lambda a: {**a, "v": a["v"][..., :2]}, "k and v must both have shape"),
        (lambda a: {**a, "index": a["index"][:, :, :2]}, "index must have shape"),
        (lambda a: {**a, "index": a["index"].int()}, "index must be int64"),
        (lambda a: {**a, "index": a["index"] + 7}, r"index must hold -1 \(no key\) or positions in \[0, 6\)"),
        (lambda a: {**a, "index": a["index"] - 2}, "index must hold -1"),
        (lambda a: {**a, "v": a["v"].float()}, "share a floating-point dtype"),
        (lambda a: {**a, "window": -1}, "window must be an int >= 0"),
        (lambda a: {**a, "mask": AttentionMask(torch.zeros(1, 5, dtype=torch.bool))},
         r"mask's padding must have shape \(batch, length\) = \(1, 6\)"),
        (lambda a: {**a, "mask": torch.zeros(1, 6, dtype=torch.bool)}, "mask must be an AttentionMask"),
    ],
)
def test_bad_input_raises_value_error_naming_argument(change, match):
    q, k, v, index = _inputs(1, 2, 5, 6, 3, 4)
    args = change({"q": q, "k": k, "v": v, "index": index})
    for fn in (la.listed_attention, la.listed_attention_reference):
        with pytest.raises(ValueError, match=match):
            fn(**args)


def test_tensors_the_kernel_does_not_take_go_through_the_gather():
    """bfloat16 (no kernel instance): the gather's values, whatever the build."""
    q, k, v, index = _inputs(1, 2, 6, 6, 3, 4, dtype=torch.bfloat16)
    out, lse = la.listed_attention(q, k, v, index)
    expected_out, expected_lse = la.listed_attention_reference(q, k, v, index)
    assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)


def test_the_kernel_can_be_turned_off_and_auto_then_keeps_the_unfused_kernels():
    """CLUSTERFORMER_NO_EXTENSIONS=1: nothing is built, extension_error says why, listed_attention gives the
    gather's values and cluster-select's "auto" takes the dense mask (N <= 256) or the banded kernel."""
    code = (
        "import torch\n"
        "from clusterformer.ops import listed_attention as la\n"
        "from clusterformer.ops.selected import resolve_kernel\n"
        "q = torch.randn(1, 2, 5, 4, dtype=torch.float64)\n"
        "index = torch.tensor([0, 2, -1]).expand(1, 2, 5, 3).contiguous()\n"
        "out, lse = la.listed_attention(q, q, q, index, window=2, window_offset=1)\n"
        "ref, ref_lse = la.listed_attention_reference(q, q, q, index, window=2, window_offset=1)\n"
        "assert torch.equal(out, ref) and torch.equal(lse, ref_lse)\n"
        "assert not la.extension_available()\n"
        "print(la.extension_error())\n"
        "print(resolve_kernel('auto', 5, q=q), resolve_kernel('auto', 5000, q=q))\n"
    )
    assert run_without_extensions(code).splitlines() == ["disabled by CLUSTERFORMER_NO_EXTENSIONS", "dense-mask banded"]


def _summaries(B, H, N, Nk):
    """Keys and values in a random order of rows, three groups of 3, 4 and 2 rows, and per query random ranges."""
    g = torch.Generator().manual_seed(fixed_seed())
    sizes = torch.tensor([3, 4, 2]).expand(B, H, 3).contiguous()
    start = (sizes.cumsum(-1) - sizes).contiguous()
    lower = torch.minimum(torch.randint(0, 3, (B, H, N, 3), generator=g), sizes[:, :, None])
    upper = torch.maximum(lower, sizes[:, :, None] - torch.randint(0, 3, (B, H, N, 3), generator=g))
    order = torch.randperm(Nk, generator=g)
    return sizes, start, lower, upper, order


def _prefix(x, order):
    return torch.nn.functional.pad(x[:, :, order].cumsum(2), (0, 0, 1, 0))


@pytest.mark.parametrize("fused", [pytest.param(True, marks=needs_kernel), False])
def test_range_summaries_match_a_loop_over_queries_and_groups(fused):
    """Each query's summary of group c: the mean key and value of rows start + [0, lower) and start + [upper,
    total) of the order (n of them; none where n = 0), logit q . mean * scale + log n, beside the window and the
    listed keys in one softmax; and the logits alone (summary_logits)."""
    q, k, v, index = _inputs(2, 2, 7, 9, 3, 5)
    sizes, start, lower, upper, order = _summaries(2, 2, 7, 9)
    summaries = la.RangeSummaries(_prefix(k, order), _prefix(v, order), start, sizes, lower, upper)
    scale = 0.8
    fn = la.listed_attention if fused else la.listed_attention_reference
    out, lse = fn(q, k, v, index, scale, window=2, window_offset=1, summaries=summaries)
    expected_out, expected_lse = torch.zeros_like(q), torch.zeros_like(lse)
    expected_logits = torch.full((2, 2, 7, 3), -math.inf, dtype=q.dtype)
    for b in range(2):
        for h in range(2):
            for i in range(7):
                keys = [j for j in (i - 1, i) if 0 <= j < 9] + [j for j in index[b, h, i].tolist() if j >= 0]
                logits = [q[b, h, i] @ k[b, h, j] * scale for j in keys]
                values = [v[b, h, j] for j in keys]
                for c in range(3):
                    s, t = int(start[b, h, c]), int(sizes[b, h, c])
                    held = [int(order[r]) for r in list(range(s, s + int(lower[b, h, i, c])))
                            + list(range(s + int(upper[b, h, i, c]), s + t))]
                    if held:
                        mean_k = torch.stack([k[b, h, j] for j in held]).mean(0)
                        mean_v = torch.stack([v[b, h, j] for j in held]).mean(0)
                        logits.append(q[b, h, i] @ mean_k * scale + math.log(len(held)))
                        values.append(mean_v)
                        expected_logits[b, h, i, c] = logits[-1]
                weights = torch.softmax(torch.stack(logits), 0)
                expected_out[b, h, i] = (weights[:, None] * torch.stack(values)).sum(0)
                expected_lse[b, h, i] = torch.logsumexp(torch.stack(logits), 0)
    torch.testing.assert_close(out, expected_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(la.summary_logits(q, summaries, scale), expected_logits, rtol=1e-12, atol=1e-12)
    assert (lower + sizes[:, :, None] - upper == 0).any(), "the case must hold a group without a summary"


@needs_kernel
def test_range_summaries_gradcheck_through_the_prefix_sums():
    """The summaries' gradients reach the prefix sums at the four rows each reads, and through the sums k and v."""
    q, k, v, index = _inputs(2, 2, 6, 9, 3, 4)
    sizes, start, lower, upper, order = _summaries(2, 2, 6, 9)

    def fn(q, k, v):
        summaries = la.RangeSummaries(_prefix(k, order), _prefix(v, order), start, sizes, lower, upper)
        out, lse = la.listed_attention(q, k, v, index, window=2, window_offset=1, summaries=summaries)
        return out, lse

    assert torch.autograd.gradcheck(fn, tuple(t.requires_grad_() for t in (q, k, v)))


def _runs(B, H, N, Nk, R, capacity, seed_offset=0):
    """Random slot runs: a permutation of the key positions per (b, h) and R runs per query, lengths 0..capacity
    (one query with none), each inside [0, Nk)."""
    g = torch.Generator().manual_seed(fixed_seed() + 1 + seed_offset)
    order = torch.stack([torch.randperm(Nk, generator=g) for _ in range(B * H)]).view(B, H, Nk)
    length = torch.randint(0, capacity + 1, (B, H, N, R), generator=g).clamp(max=Nk)
    length[0, 0, 0] = 0
    first = (torch.rand(B, H, N, R, generator=g) * (Nk - length + 1)).long()
    return la.SlotRuns(order, first, length, capacity)


def _runs_loop_index(runs):
    """The runs' keys written out one query at a time: order[first + u] for u < length, -1 for the rest."""
    order, first, length, capacity = runs
    B, H, N, R = first.shape
    index = torch.full((B, H, N, R * capacity), -1, dtype=torch.long)
    for b in range(B):
        for h in range(H):
            for i in range(N):
                for r in range(R):
                    for u in range(int(length[b, h, i, r])):
                        index[b, h, i, r * capacity + u] = order[b, h, int(first[b, h, i, r]) + u]
    return index


RUN_SHAPES = [(2, 2, 9, 11, 3, 4, 2, 4), (1, 1, 5, 4, 0, 16, 3, 2), (2, 1, 12, 12, 1, 32, 4, 5),
              (1, 2, 3, 7, 2, 3, 1, 7)]  # (B, H, N, Nk, M, D, R, capacity): with and without listed keys


@pytest.mark.parametrize("shape", RUN_SHAPES)
@pytest.mark.parametrize("windowed", [False, True])
@pytest.mark.parametrize("fused", [pytest.param(True, marks=needs_kernel), False])
def test_slot_runs_match_a_loop_over_queries(shape, windowed, fused):
    """Keys listed as runs of a sorted order (cluster-select's selected clusters) read the same keys as the loop
    reference given them written out per query, beside a window and listed keys; the kernel's gradients equal the
    gather's."""
    B, H, N, Nk, M, D, R, capacity = shape
    q, k, v, index = _inputs(B, H, N, Nk, M, D)
    runs = _runs(B, H, N, Nk, R, capacity)
    assert torch.equal(runs.as_index(), _runs_loop_index(runs))
    window = {"window": 3, "window_offset": 2} if windowed else {}
    scale = 0.8
    expected = _loop_reference(q, k, v, torch.cat([index, _runs_loop_index(runs)], -1), scale,
                               window.get("window", 0), window.get("window_offset", 0))
    _assert_matches(q, k, v, index, scale, expected, fused, runs=runs, **window)


@needs_kernel
def test_slot_runs_gradcheck_with_summaries():
    """dq, dk, dv and the prefix sums' gradients with runs, a window and summaries in one softmax."""
    B, H, N, Nk, D = 1, 2, 6, 9, 3  # the summaries' groups hold 9 rows
    q, k, v, index = _inputs(B, H, N, Nk, 0, D)
    runs = _runs(B, H, N, Nk, 2, 2)
    sizes, start, lower, upper, order = _summaries(B, H, N, Nk)
    summaries = la.RangeSummaries(_prefix(k, order), _prefix(v, order), start, sizes, lower, upper)

    def fn(q, k, v, pk, pv):
        out, lse = la.listed_attention(q, k, v, index, runs=runs, window=2, window_offset=1,
                                       summaries=summaries._replace(prefix_k=pk, prefix_v=pv))
        return out, lse.masked_fill(lse.isinf(), 0.0)

    inputs = (q, k, v, summaries.prefix_k.clone(), summaries.prefix_v.clone())
    assert torch.autograd.gradcheck(fn, tuple(t.requires_grad_() for t in inputs))


@pytest.mark.parametrize(("change", "match"), [
    (lambda r: r._replace(order=r.order[:, :, :-1]), r"runs.order must be an int64 tensor of shape \(B, H, Nk\)"),
    (lambda r: r._replace(order=r.order.int()), "runs.order must be an int64"),
    (lambda r: r._replace(order=r.order + 1), r"runs.order must hold key positions in \[0, 6\)"),
    (lambda r: r._replace(first=r.first[..., :1]), "runs.first and runs.length must be"),
    (lambda r: r._replace(length=r.length.int()), "runs.first and runs.length must be"),
    (lambda r: r._replace(capacity=-1), "runs.capacity must be an int >= 0"),
    (lambda r: r._replace(length=r.length + 3), r"runs.length must lie in \[0, capacity=2\]"),
    (lambda r: r._replace(first=r.first + 6), r"runs: every run's slots .* must lie in \[0, 6\)"),
    (lambda r: r._replace(first=r.first - 7), r"runs: every run's slots"),
])
def test_bad_runs_raise_value_error_naming_them(change, match):
    q, k, v, index = _inputs(1, 2, 5, 6, 0, 4)
    runs = change(_runs(1, 2, 5, 6, 2, 2))
    for fn in (la.listed_attention, la.listed_attention_reference):
        with pytest.raises(ValueError, match=match):
            fn(q, k, v, index, runs=runs)


def _bound_loop(q, k, ids, G, window, causal, block):
    """selection="bound" from its definition, one query and group at a time: sum_d max(q_d max k_d, q_d min k_d)
    over the group's members in whole blocks outside the window (causal: blocks < floor((t + 1 - window) / block);
    otherwise the larger of the bound over blocks < floor((t - window // 2) / block) and over blocks >=
    ceil((t + window - window // 2) / block)); -inf without members."""
    B, H, N, _ = q.shape
    out = torch.full((B, H, N, G), -math.inf, dtype=q.dtype)

    def bound(qt, js):
        if not js:
            return -math.inf
        return float(torch.maximum(qt * k[b, h, js].amax(0), qt * k[b, h, js].amin(0)).sum())

    for b in range(B):
        for h in range(H):
            for t in range(N):
                for g in range(G):
                    members = [j for j in range(N) if int(ids[b, h, j]) == g]
                    if causal:
                        out[b, h, t, g] = bound(q[b, h, t], [j for j in members
                                                            if j // block < (t + 1 - window) // block])
                    else:
                        half = window // 2
                        before = [j for j in members if j // block < (t - half) // block]
                        after = [j for j in members if j // block >= -(-(t + window - half) // block)]
                        out[b, h, t, g] = max(bound(q[b, h, t], before), bound(q[b, h, t], after))
    return out


@needs_kernel
@pytest.mark.parametrize(("window", "block"), [(2, 1), (3, 2), (4, 4), (6, 3), (2, 20)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("D", [4, 64])  # 64: a head size the kernel unrolls
def test_bound_groups_match_the_definition_and_choose_ties_by_the_lower_group(window, block, causal, D):
    """The fused bounds against a loop over queries and groups (padding, id G, in no group; blocks that do not
    divide N; a block longer than N), and its choice against top_groups of the bounds: the same groups in the same
    order, ties (groups without members, at -inf) to the lower id."""
    from clusterformer.ops.selected_ranking import top_groups

    g = torch.Generator().manual_seed(fixed_seed())
    B, H, N, G = 2, 2, 13, 4
    q, k = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(2))
    ids = torch.randint(0, G + 1, (B, H, N), generator=g)  # G: padding, or the sink
    ids[0, 0] = torch.tensor([0, 1] * 6 + [4])[:N]  # groups 2 and 3 empty here: ties at -inf for every query
    expected = _bound_loop(q, k, ids, G, window, causal, block)
    bounds = la.bound_groups(q, k, ids, num_groups=G, window=window, causal=causal, block=block)
    torch.testing.assert_close(bounds, expected, rtol=1e-12, atol=1e-12)
    if block < N:
        assert (expected == -math.inf).any() and expected.isfinite().any(), "the case must hold both"
    else:  # one block, cut by every window: no bound
        assert (expected == -math.inf).all()
    for select in (1, 2, 3, 4):
        chosen = la.bound_groups(q, k, ids, num_groups=G, window=window, causal=causal, block=block, select=select)
        assert torch.equal(chosen, top_groups(expected, select))
    float32 = la.bound_groups(q.float(), k.float(), ids, num_groups=G, window=window, causal=causal, block=block)
    torch.testing.assert_close(float32, expected.float(), rtol=1e-5, atol=1e-5)
    # the scale applied in the kernel: the bits of the bounds of the scaled query, the same groups
    for select in (0, 2):
        scaled = la.bound_groups(q, k, ids, num_groups=G, window=window, causal=causal, block=block, select=select,
                                 scale=0.37)
        assert torch.equal(scaled, la.bound_groups(q * 0.37, k, ids, num_groups=G, window=window, causal=causal,
                                                   block=block, select=select))


def test_top_groups_puts_equal_logits_in_order_of_their_ids():
    """The selection's rule for ties, which topk leaves unspecified: largest first, equal ones by the lower id."""
    from clusterformer.ops.selected_ranking import top_groups

    inf = math.inf
    logits = torch.tensor([[-inf, 1.0, -inf, 1.0, -inf, 2.0], [-inf] * 6, [0.5, -inf, 0.5, 0.5, 0.7, -inf]])
    assert top_groups(logits, 4).tolist() == [[5, 1, 3, 0], [0, 1, 2, 3], [4, 0, 2, 3]]
    wide = torch.full((70,), -inf)
    wide[40] = 0.0
    assert top_groups(wide, 3).tolist() == [40, 0, 1]  # topk gave [40, 47, 48] here
    spans = torch.tensor([[0.0, 0.0, -inf, -inf, 0.0, 0.0]])  # 3 clusters of 2 spans: clusters 0 and 2 tie
    assert top_groups(spans, 2, by_cluster=2).tolist() == [[0, 4]]


@needs_kernel
@pytest.mark.parametrize(("change", "match"), [
    ({"k": torch.zeros(1, 2, 5, 3)}, "q and k must be float32/float64 CPU tensors of one shape"),
    ({"key_ids": torch.zeros(1, 2, 4, dtype=torch.long)}, r"key_ids must be an int64 tensor of shape \(B, H, N\)"),
    ({"key_ids": torch.full((1, 2, 5), 4)}, r"key_ids must lie in \[0, num_groups=3\]"),
    ({"block": 0}, "block must be an int >= 1"),
    ({"select": 4}, "select must be at most num_groups=3"),
    ({"num_groups": True}, "num_groups must be an int"),
    ({"scale": 0.0}, "scale must be a finite float > 0"),
    ({"scale": float("nan")}, "scale must be a finite float > 0"),
])
def test_bad_bound_input_raises_value_error_naming_it(change, match):
    args = {"q": torch.randn(1, 2, 5, 4), "k": torch.randn(1, 2, 5, 4),
            "key_ids": torch.zeros(1, 2, 5, dtype=torch.long), "num_groups": 3, "window": 2, "causal": True,
            "block": 2, **change}
    with pytest.raises(ValueError, match=match):
        la.bound_groups(**args)


@needs_kernel
def test_the_kernel_gives_the_same_bits_on_one_thread_and_on_two():
    """Work is split over (sequence, head) pairs, each computed whole by one thread: outputs, the logsumexp and
    every gradient are bitwise the same whatever torch.set_num_threads says (float32, runs, window, summaries)."""
    B, H, N, Nk, D = 2, 3, 6, 9, 16
    q, k, v, index = _inputs(B, H, N, Nk, 2, D, dtype=torch.float32)
    runs = _runs(B, H, N, Nk, 2, 3)
    sizes, start, lower, upper, order = _summaries(B, H, N, Nk)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            summaries = la.RangeSummaries(_prefix(inputs[1], order), _prefix(inputs[2], order), start, sizes, lower,
                                          upper)
            out, lse = la.listed_attention(*inputs, index, runs=runs, window=3, window_offset=2, summaries=summaries)
            (out.square().sum() + lse[lse.isfinite()].sum()).backward()
            bounds = la.bound_groups(q, k[:, :, :N], order.expand(B, H, Nk)[..., :N] % 4, num_groups=3, window=2,
                                     causal=False, block=2)
            results.append([out, lse, bounds, *(t.grad for t in inputs)])
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def _members_loop(q, k, ids, selected, keep, window, causal):
    """members="score" from its definition: per query and selected group, the group's members outside the query's
    window (causal: at positions <= t - window; otherwise before t - window / 2 or from t + window - window / 2 on)
    by q . k descending, equal scores the later position first; ``keep`` of them in position order, -1 after."""
    B, H, N, _ = q.shape
    out = torch.full((B, H, N, selected.shape[-1] * keep), -1, dtype=torch.long)
    for b in range(B):
        for h in range(H):
            for t in range(N):
                for s, group in enumerate(selected[b, h, t].tolist()):
                    outside = [j for j in range(N) if ids[b, h, j] == group and (
                        j <= t - window if causal else j < t - window // 2 or j >= t + window - window // 2)]
                    best = sorted(sorted(outside, key=lambda j: (-float(q[b, h, t] @ k[b, h, j]), -j))[:keep])
                    out[b, h, t, s * keep: s * keep + len(best)] = torch.tensor(best, dtype=torch.long)
    return out


@pytest.mark.parametrize(("N", "window", "keep"), [(1, 2, 2), (13, 2, 2), (21, 4, 3), (30, 6, 1)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("fused", [pytest.param(True, marks=needs_kernel), False])
@pytest.mark.parametrize("D", [4, 64])  # a head size read at run time, and one the kernel unrolls
def test_scored_members_match_the_definition_with_ties_to_the_later_position(N, window, keep, causal, fused, D,
                                                                              monkeypatch):
    """cluster-select's members="score": the fused pass and the tensor operations (without the kernel) against a
    loop over queries and groups -- padding (id G) in no group, groups of fewer than ``keep`` members, and equal
    keys (equal scores), which go to the later position first."""
    from clusterformer.ops import selected_ranking as sel
    from clusterformer.ops.selected_layout import cluster_layout

    if not fused:
        monkeypatch.setattr(sel, "extension_available", lambda: False)
    g = torch.Generator().manual_seed(fixed_seed())
    B, H, G, S = 2, 2, 4, 2
    q, k = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(2))
    if N > 10:
        k[:, :, 7] = k[:, :, 3]  # equal keys: equal scores for every query
        k[:, :, 9] = k[:, :, 3]
    ids = torch.randint(0, G, (B, H, N), generator=g)
    ids[1, :, N - 3:] = G  # padding
    if N > 10:
        ids[:, :, [3, 7, 9]] = 1
    selected = torch.stack([torch.randperm(G, generator=g)[:S] for _ in range(B * H * N)]).view(B, H, N, S)
    layout = cluster_layout(ids, num_clusters=G, window=window, causal=causal)
    got = sel.scored_members(q, k, layout, selected, cluster_keys=keep, causal=causal)
    expected = _members_loop(q, k, ids, selected, keep, window, causal)
    assert torch.equal(got, expected)
    if N > 10:
        assert (expected >= 0).any(), "the case must read members"
        assert (expected < 0).any() or not causal, "the case must hold groups short of keep members"
        with_ties = (selected == 1).any(-1) & (torch.arange(N) >= (9 + window if causal else 0))
        assert with_ties.any(), "the case must rank equal scores"
    float32 = sel.scored_members(q.float(), k.float(), layout, selected, cluster_keys=keep, causal=causal)
    assert torch.equal(float32 >= 0, expected >= 0)  # as many members read in float32


@needs_kernel
@pytest.mark.parametrize(("change", "match"), [
    ({"per_group": 0}, "per_group must be an int >= 1"),
    ({"keep": 0}, "keep must be an int >= 1"),
    ({"per_group": 2}, "not a multiple of per_group=2"),
    ({"q": torch.randn(1, 2, 5, 4, dtype=torch.float16)}, "q must be a float32/float64 CPU tensor"),
])
def test_bad_top_members_input_raises_value_error_naming_it(change, match):
    order = torch.arange(5).expand(1, 2, 5).contiguous()
    runs = la.SlotRuns(order, torch.zeros(1, 2, 5, 3, dtype=torch.long), torch.ones(1, 2, 5, 3, dtype=torch.long), 1)
    args = {"q": torch.randn(1, 2, 5, 4), "k": torch.randn(1, 2, 5, 4), "runs": runs, "per_group": 1, "keep": 2,
            **change}
    with pytest.raises(ValueError, match=match):
        la.top_members(**args)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("keep", [1, 2, 3, 5, 7, 9, 12, 15])
def test_top_members_cut_orders_signs_zeros_infinities_and_ties(keep, dtype):
    """The pass's cut (the keep-th largest score, found on the scores' bits): with q = 1 and D = 1 the scores are
    the keys themselves -- negatives, +0 and -0 (equal, so tied), numbers a hair either side of 0, infinities and
    repeats -- against sorting by (score descending, later position first), kept in position order."""
    values = [3.0, -1.0, 0.0, -0.0, -2.0, 5.0, 0.0, -1.0, 2.0, -1e-30, 1e-30, -0.0, math.inf, -math.inf, -1.0, 3.0]
    Nk = len(values)
    k = torch.tensor(values, dtype=dtype).view(1, 1, Nk, 1)
    q = torch.ones(1, 1, 1, 1, dtype=dtype)
    runs = la.SlotRuns(torch.arange(Nk).view(1, 1, Nk), torch.zeros(1, 1, 1, 1, dtype=torch.long),
                       torch.full((1, 1, 1, 1), Nk, dtype=torch.long), Nk)
    got = la.top_members(q, k, runs, per_group=1, keep=keep)
    scores = k.view(-1).tolist()
    expected = sorted(sorted(range(Nk), key=lambda j: (-scores[j], -j))[:keep])
    assert got.view(-1).tolist() == expected


def test_a_build_lock_left_by_an_interrupted_build_is_cleared_and_a_live_one_kept(tmp_path):
    """torch waits forever on a build directory's ``lock``: an old one (an interrupted build) is removed with a
    warning before the kernel loads, a recent one (a build running in another process) is left alone."""
    import os
    import time

    from clusterformer.ops.extensions import clear_stale_lock

    lock = tmp_path / "lock"
    assert not clear_stale_lock(tmp_path)  # no lock
    lock.write_text("")
    assert not clear_stale_lock(tmp_path, max_age_s=600) and lock.exists()  # a build under way
    old = time.time() - 3600
    os.utime(lock, (old, old))
    with pytest.warns(RuntimeWarning, match="interrupted build"):
        assert clear_stale_lock(tmp_path, max_age_s=600)
    assert not lock.exists()
