"""sorted_chunk_attention and cluster_causal_attention against dense float64 references."""

from __future__ import annotations

import itertools

import pytest
import torch

from clusterformer.masks import AttentionMask
from clusterformer.ops import cluster_causal_attention, cluster_causal_layout, sorted_chunk_attention, sorted_layout
from reference import cluster_causal_allowed, dense_reference, sorted_chunk_allowed
from seeds import fixed_seed


def _inputs(B, H, N, D, *, num_clusters, per_head, pad_fraction, dtype=torch.float64, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else fixed_seed())
    q, k, v = (torch.randn(B, H, N, D, generator=g, dtype=dtype) for _ in range(3))
    shape = (B, H, N) if per_head else (B, N)
    ids = torch.randint(0, num_clusters, shape, generator=g)
    pad = None
    if pad_fraction:
        pad = torch.rand(B, N, generator=g) < pad_fraction
    return q, k, v, ids, pad


def _ids_for(ids, b, h):
    return ids[b, h] if ids.dim() == 3 else ids[b]


def _pad_for(pad, b):
    return None if pad is None else pad[b]


SIZES = [  # (N, chunk_size): multiples, remainders, N < chunk_size, chunk of one, n_c = 2 (look-back
    # 2 reaches the own chunk twice: the set semantics must count it once)
    (16, 4), (13, 4), (3, 8), (7, 1), (20, 6), (1, 3), (7, 4), (10, 5),
]


@pytest.mark.parametrize(("N", "chunk_size"), SIZES)
@pytest.mark.parametrize("look_back", [0, 1, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_sorted_chunk_matches_dense_reference(N, chunk_size, look_back, causal):
    for per_head, pad_fraction in itertools.product([False, True], [0.0, 0.3]):
        q, k, v, ids, pad = _inputs(2, 3, N, 5, num_clusters=4, per_head=per_head, pad_fraction=pad_fraction)
        out = sorted_chunk_attention(
            q, k, v, ids, chunk_size, look_back=look_back, mask=AttentionMask(pad, causal))
        ref = dense_reference(
            q, k, v,
            lambda b, h: sorted_chunk_allowed(_ids_for(ids, b, h), chunk_size, look_back, causal, _pad_for(pad, b)),
        )
        real = torch.ones(2, N, dtype=torch.bool) if pad is None else ~pad
        real = real[:, None, :, None].expand_as(out)  # outputs at padded queries are unspecified
        torch.testing.assert_close(out[real], ref[real], rtol=1e-10, atol=1e-10)
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("look_back", [0, 1, 2, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_sorted_chunk_per_sequence_lengths_and_chunk_sizes(look_back, causal):
    """Each sequence is sorted and chunked over its own real tokens with its own chunk size (a (B,) tensor):
    right, left and scattered padding, a sequence of padding only, and sequences with fewer chunks than
    look_back + 1 (each chunk then sees every chunk once) beside ones with many."""
    B, H, N, D = 5, 2, 19, 4
    q, k, v, ids, _ = _inputs(B, H, N, D, num_clusters=4, per_head=True, pad_fraction=0.0)
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[0, 11:] = True  # right padding
    pad[1, :6] = True  # left padding
    pad[2, ::3] = True  # scattered
    pad[3, :] = True  # nothing real
    chunk = torch.tensor([3, 5, 2, 4, 7])
    out = sorted_chunk_attention(q, k, v, ids, chunk, look_back=look_back, mask=AttentionMask(pad, causal))
    ref = dense_reference(q, k, v, lambda b, h: sorted_chunk_allowed(
        ids[b, h], min(int(chunk[b]), max(int((~pad[b]).sum()), 1)), look_back, causal, pad[b]))
    real = (~pad)[:, None, :, None].expand_as(out)
    torch.testing.assert_close(out[real], ref[real], rtol=1e-10, atol=1e-10)
    assert torch.isfinite(out).all()
    # and alone: each sequence's real tokens, unpadded, give the same outputs
    for b in (0, 1, 2, 4):
        keep = ~pad[b]
        alone = sorted_chunk_attention(q[b:b + 1, :, keep], k[b:b + 1, :, keep], v[b:b + 1, :, keep],
                                       ids[b:b + 1, :, keep], int(chunk[b]), look_back=look_back,
                                       mask=AttentionMask(causal=causal))
        torch.testing.assert_close(out[b][:, keep], alone[0], rtol=1e-12, atol=1e-12)


def test_sorted_chunk_rejects_bad_chunk_size_tensors():
    q = torch.randn(2, 1, 5, 3)
    ids = torch.zeros(2, 5, dtype=torch.long)
    for bad, match in ((torch.tensor([2, 0]), ">= 1"), (torch.tensor([2]), r"\(B,\)"),
                       (torch.tensor([2.0, 3.0]), "integer tensor")):
        with pytest.raises(ValueError, match="chunk_size"):
            sorted_chunk_attention(q, q, q, ids, bad)
        with pytest.raises(ValueError, match=match):
            sorted_chunk_attention(q, q, q, ids, bad)


@pytest.mark.parametrize(("N", "chunk_size", "look_back"), [(13, 4, 1), (9, 3, 2), (5, 8, 1), (16, 4, 0)])
def test_sorted_chunk_gradients_match_dense_reference(N, chunk_size, look_back):
    for causal, per_head in itertools.product([False, True], [False, True]):
        q, k, v, ids, pad = _inputs(2, 2, N, 4, num_clusters=3, per_head=per_head, pad_fraction=0.25)
        weight = torch.randn(2, 2, N, 4, dtype=torch.float64)
        weight = weight * (~pad)[:, None, :, None]  # padded query outputs are unspecified
        grads = []
        for fn in ("ours", "ref"):
            qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
            if fn == "ours":
                out = sorted_chunk_attention(qq, kk, vv, ids, chunk_size, look_back=look_back,
                                             mask=AttentionMask(pad, causal))
            else:
                out = dense_reference(qq, kk, vv, lambda b, h: sorted_chunk_allowed(
                    _ids_for(ids, b, h), chunk_size, look_back, causal, pad[b]))
            (out * weight).sum().backward()
            grads.append((qq.grad, kk.grad, vv.grad))
        for ours, ref in zip(*grads, strict=True):
            assert torch.isfinite(ours).all()
            torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    ("N", "chunk_size", "look_back", "causal"), [(7, 3, 1, False), (6, 2, 2, True), (4, 5, 1, True)]
)
def test_sorted_chunk_gradcheck(N, chunk_size, look_back, causal):
    q, k, v, ids, _ = _inputs(1, 2, N, 3, num_clusters=3, per_head=False, pad_fraction=0.0, seed=N)
    pad = torch.zeros(1, N, dtype=torch.bool)
    pad[0, -1] = True
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))

    def fn(q, k, v):
        out = sorted_chunk_attention(q, k, v, ids, chunk_size, look_back=look_back,
                                     mask=AttentionMask(pad, causal))
        return out[:, :, :-1]  # the padded query's output is unspecified

    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_query_with_no_allowed_key_gives_zeros_and_finite_gradients():
    # Every key is padding in sequence 0, and causal + padding leaves early queries without keys.
    B, H, N, D = 2, 2, 6, 4
    q, k, v = (torch.randn(B, H, N, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ids = torch.randint(0, 3, (B, N))
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[0] = True
    pad[1, :3] = True
    out = sorted_chunk_attention(q, k, v, ids, 2, mask=AttentionMask(pad, causal=True))
    assert torch.isfinite(out).all()
    assert out[0].abs().sum() == 0  # no allowed key anywhere in sequence 0
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert q.grad[0].abs().sum() == 0


@pytest.mark.parametrize(("N", "chunk_size", "look_back"), [(17, 3, 1), (12, 4, 0), (9, 2, 2), (5, 7, 1), (1, 2, 1)])
def test_cluster_causal_matches_dense_reference(N, chunk_size, look_back):
    for per_head, pad_fraction in itertools.product([False, True], [0.0, 0.3]):
        q, k, v, ids, pad = _inputs(2, 2, N, 4, num_clusters=3, per_head=per_head, pad_fraction=pad_fraction)
        out = cluster_causal_attention(q, k, v, ids, chunk_size, 3, look_back=look_back,
                                       mask=AttentionMask(pad, causal=True))
        ref = dense_reference(q, k, v, lambda b, h: cluster_causal_allowed(
            _ids_for(ids, b, h), chunk_size, look_back, _pad_for(pad, b)))
        real = (torch.ones(2, N, dtype=torch.bool) if pad is None else ~pad)[:, None, :, None].expand_as(out)
        torch.testing.assert_close(out[real], ref[real], rtol=1e-10, atol=1e-10)


def test_cluster_causal_gradcheck():
    q, k, v, ids, _ = _inputs(1, 1, 7, 3, num_clusters=2, per_head=False, pad_fraction=0.0, seed=3)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda q, k, v: cluster_causal_attention(q, k, v, ids, 2, 2), (q, k, v))


def test_empty_batch_and_empty_sequence():
    for B, N in ((0, 5), (2, 0)):
        q = torch.randn(B, 2, N, 4, requires_grad=True)
        out = sorted_chunk_attention(q, q, q, torch.zeros(B, N, dtype=torch.long), 3)
        assert out.shape == (B, 2, N, 4)
        out.sum().backward()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_low_precision_is_finite(dtype):
    q, k, v = (torch.randn(2, 2, 50, 16) for _ in range(3))
    ids = torch.randint(0, 5, (2, 50))
    with torch.autocast("cpu", dtype=dtype):
        out = sorted_chunk_attention(q.to(dtype), k.to(dtype), v.to(dtype), ids, 8,
                                     mask=AttentionMask(causal=True))
    assert out.dtype == dtype
    ref = sorted_chunk_attention(q, k, v, ids, 8, mask=AttentionMask(causal=True))
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    q, k, v, ids, pad = _inputs(2, 3, 37, 8, num_clusters=5, per_head=False, pad_fraction=0.2, dtype=torch.float32)
    ref = sorted_chunk_attention(q, k, v, ids, 6, mask=AttentionMask(pad, causal=True))
    out = sorted_chunk_attention(q.cuda(), k.cuda(), v.cuda(), ids.cuda(), 6,
                                 mask=AttentionMask(pad.cuda(), causal=True))
    real = (~pad)[:, None, :, None].expand_as(ref)
    torch.testing.assert_close(out.cpu()[real], ref[real], rtol=1e-4, atol=1e-4)


def _good():
    q = torch.randn(2, 3, 10, 4)
    return q, q.clone(), q.clone(), torch.zeros(2, 10, dtype=torch.long)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda a: {**a, "q": a["q"][0]}, "q must be 4-D"),
        (lambda a: {**a, "k": a["k"][:, :, :5]}, "q, k and v must all have shape"),
        (lambda a: {**a, "v": a["v"].double()}, "share a dtype"),
        (lambda a: {**a, "q": a["q"].long()}, "q must have a floating-point dtype"),
        (lambda a: {**a, "cluster_ids": a["cluster_ids"].float()}, "cluster_ids must be an integer"),
        (lambda a: {**a, "cluster_ids": a["cluster_ids"] - 1}, "cluster_ids must be non-negative"),
        (lambda a: {**a, "cluster_ids": a["cluster_ids"][:, :4]}, r"cluster_ids must have shape"),
        (lambda a: {**a, "cluster_ids": a["cluster_ids"][0]}, r"cluster_ids must be 2-D or 3-D"),
        (lambda a: {**a, "chunk_size": 0}, "chunk_size must be >= 1"),
        (lambda a: {**a, "chunk_size": 2.5}, "chunk_size must be an int"),
        (lambda a: {**a, "look_back": -1}, "look_back must be >= 0"),
        (lambda a: {**a, "mask": AttentionMask(torch.zeros(2, 9, dtype=torch.bool))}, r"mask's padding must have"),
        (lambda a: {**a, "mask": torch.zeros(2, 10, dtype=torch.bool)}, "mask must be an AttentionMask"),
    ],
)
def test_bad_input_raises_value_error_naming_argument(change, match):
    q, k, v, ids = _good()
    args = change({"q": q, "k": k, "v": v, "cluster_ids": ids, "chunk_size": 3,
                   "look_back": 1, "mask": None})
    with pytest.raises(ValueError, match=match):
        sorted_chunk_attention(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("cluster_ids"),
                               args.pop("chunk_size"), **args)


@pytest.mark.parametrize(("w", "hops", "windows"), [(3, 1, 4), (2, 2, 5), (1, 3, 6), (4, 2, 1)])
def test_key_windows_custom_backward_gradcheck(w, hops, windows):
    from clusterformer.ops.windows import _KeyWindows

    rows = torch.randn(windows * w + (hops - 1) * w, 2, 3, dtype=torch.float64, requires_grad=True)
    out = _KeyWindows.apply(rows, w, hops, windows)
    assert out.shape == (windows, 2, hops * w, 3)
    for i in range(windows):  # window i is rows [i w, i w + hops w), heads moved in front
        torch.testing.assert_close(out[i], rows[i * w : i * w + hops * w].transpose(0, 1))
    assert torch.autograd.gradcheck(lambda r: _KeyWindows.apply(r, w, hops, windows), (rows,))


def test_cluster_causal_rejects_ids_out_of_range():
    q = torch.randn(1, 1, 5, 2)
    with pytest.raises(ValueError, match="cluster_ids must be < num_clusters=2"):
        cluster_causal_attention(q, q, q, torch.tensor([[0, 1, 2, 0, 1]]), 2, 2)


@pytest.mark.parametrize("causal_layout", [False, True])
def test_chunk_size_larger_than_the_sequence_is_clamped(causal_layout):
    """A 4-token input with chunk_size 2048 must not build a 2048-row buffer: the layout is the
    one of chunk_size = N, and so are the outputs."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 3, (2, 4), generator=g)
    if causal_layout:
        big, exact = cluster_causal_layout(ids, 2048, 3), cluster_causal_layout(ids, 4, 3)
    else:
        big, exact = sorted_layout(ids, 2048), sorted_layout(ids, 4)
    assert big.chunk_size == 4
    assert big.rows.numel() == exact.rows.numel() <= 2 * 3 * 4 * 2
    q, k, v = (torch.randn(2, 2, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    if causal_layout:
        a = cluster_causal_attention(q, k, v, ids, 2048, 3)
        b = cluster_causal_attention(q, k, v, ids, 4, 3)
    else:
        a = sorted_chunk_attention(q, k, v, ids, 2048, mask=AttentionMask(causal=True))
        b = sorted_chunk_attention(q, k, v, ids, 4, mask=AttentionMask(causal=True))
    assert torch.equal(a, b)


@pytest.mark.parametrize(("kernel", "chunk"), [("gather", None), ("dense-mask", None), ("banded", None),
                                               ("banded", 4)])
@pytest.mark.parametrize("causal", [True, False])
def test_selected_cluster_attention_with_summaries_gradcheck(kernel, chunk, causal, monkeypatch):
    """The summaries' prefix-sum differences (gather), matmuls (dense-mask) and chunk sums less the keys read alone
    (banded: 9 positions are 5 chunks causal, 9 non-causal, so whole chunks lie beyond every band; chunk 4: a
    window of 10 in bands of three or four chunks of 4 and 3, whose keys outside the window span more than a chunk,
    21 positions) have the gradients of their values: gradcheck in float64 with padding, on q, k and v."""
    from clusterformer.ops import selected_band, selected_cluster_attention
    if chunk is not None:
        monkeypatch.setattr(selected_band, "BAND_CHUNK", chunk)
    torch.manual_seed(fixed_seed())
    B, H, N, D, C = 1, 2, 9, 3, 3
    window = 2
    if chunk is not None:
        N, window = 21, 10
    q, k, v = (torch.randn(B, H, N, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    key_ids = torch.randint(0, C, (B, H, N))
    key_ids[..., -1] = C  # padding
    pad = key_ids[:, 0] == C
    selected = torch.stack([torch.randperm(C)[:2] for _ in range(B * H * N)]).view(B, H, N, 2)

    def fn(q, k, v):
        out = selected_cluster_attention(q, k, v, key_ids, selected, num_clusters=C, cluster_keys=1,
                                         window=window, mask=AttentionMask(pad, causal), kernel=kernel,
                                         summaries=True)
        return out[:, :, :-1]

    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_cluster_select_auto_kernel_is_the_dense_mask_to_256_positions_and_banded_beyond():
    from clusterformer.ops.selected import resolve_kernel

    assert [resolve_kernel("auto", n) for n in (1, 256, 257, 4096)] == ["dense-mask", "dense-mask", "banded", "banded"]
    assert [resolve_kernel(k, 10) for k in ("gather", "banded")] == ["gather", "banded"]
    assert resolve_kernel("dense-mask", 10**6) == "dense-mask"


@pytest.mark.parametrize(("N", "window"), [(1, 1), (7, 3), (13, 5), (33, 40), (40, 8)])
@pytest.mark.parametrize("causal", [True, False])
def test_cluster_layout_counts_match_a_count_by_position(N, window, causal):
    """The layout's members of each cluster before each query's window and before its end, built whole (a prefix
    count over every cluster) and searched for a few selected clusters (binary search in the sorted keys, the path
    taken without summaries), against a count written one query and cluster at a time; padding (id C) counts in no
    cluster."""
    from clusterformer.ops.selected_layout import cluster_layout

    g = torch.Generator().manual_seed(fixed_seed())
    B, H, C, S = 2, 2, 5, 3
    key_ids = torch.randint(0, C + 1, (B, H, N), generator=g)  # id C: padding
    selected = torch.rand(B, H, N, C, generator=g).argsort(-1)[..., :S]
    expected_below = torch.zeros(B, H, N, C, dtype=torch.long)
    expected_beyond = torch.zeros(B, H, N, C, dtype=torch.long)
    for b, h, t, c in itertools.product(range(B), range(H), range(N), range(C)):
        low, high = (t - window + 1, N) if causal else (t - window // 2, t + window - window // 2)
        members = [j for j in range(N) if key_ids[b, h, j] == c]
        expected_below[b, h, t, c] = sum(j < low for j in members)
        expected_beyond[b, h, t, c] = sum(j < high for j in members)
    searched = cluster_layout(key_ids, num_clusters=C, window=window, causal=causal).selected_counts(selected)
    whole = cluster_layout(key_ids, num_clusters=C, window=window, causal=causal)
    assert torch.equal(whole.below, expected_below) and torch.equal(whole.beyond, expected_beyond)
    assert torch.equal(whole.total, (key_ids.unsqueeze(-1) == torch.arange(C)).sum(2))
    for counts in (searched, whole.selected_counts(selected)):  # searched, and gathered from the built counts
        assert torch.equal(counts[0], expected_below.gather(-1, selected))
        assert torch.equal(counts[1], expected_beyond.gather(-1, selected))
