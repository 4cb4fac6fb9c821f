"""ops/key_lists.py: scores and weighted sums over each query's listed keys, as sparse CSR products and as the
gather they replace, against a float64 loop over queries and list entries, with gradcheck."""

from __future__ import annotations

import pytest
import torch

from clusterformer.ops import key_lists as kl
from seeds import fixed_seed

SHAPES = [  # (B, H, N, M, D): lists shorter and longer than N, a single position, one row, M above B H N
    (2, 3, 7, 5, 4), (1, 2, 13, 13, 3), (3, 1, 1, 2, 2), (1, 1, 4, 9, 5), (2, 2, 10, 1, 6),
]


def _inputs(B, H, N, M, D, dtype=torch.float64):
    g = torch.Generator().manual_seed(fixed_seed())
    positions = torch.randint(0, N, (B, H, N, M), generator=g)  # repeats within a list included
    q, k, v = (torch.randn(B, H, N, D, generator=g, dtype=dtype) for _ in range(3))
    w = torch.randn(B, H, N, M, generator=g, dtype=dtype)
    return positions, q, k, v, w


def _loop_reference(positions, q, k, v, w):
    B, H, N, M = positions.shape
    scores = torch.zeros(B, H, N, M, dtype=q.dtype)
    out = torch.zeros_like(q)
    for b in range(B):
        for h in range(H):
            for n in range(N):
                for m in range(M):
                    j = int(positions[b, h, n, m])
                    scores[b, h, n, m] = q[b, h, n] @ k[b, h, j]
                    out[b, h, n] += w[b, h, n, m] * v[b, h, j]
    return scores, out


@pytest.fixture(params=["sparse", "gather"])
def path(request, monkeypatch):
    if request.param == "gather":
        monkeypatch.setattr(kl, "uses_sparse", lambda x, lists: False)
    return request.param


@pytest.mark.parametrize("shape", SHAPES)
def test_listed_scores_and_sums_match_a_loop_over_the_lists(shape, path):
    positions, q, k, v, w = _inputs(*shape)
    lists = kl.key_lists(positions)
    scores, out = _loop_reference(positions, q, k, v, w)
    torch.testing.assert_close(kl.listed_scores(q, k, lists), scores, rtol=0, atol=1e-12)
    torch.testing.assert_close(kl.listed_sum(w, v, lists), out, rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_listed_products_gradcheck(shape, path):
    positions, q, k, v, w = _inputs(*shape)
    lists = kl.key_lists(positions)
    q, k, v, w = (x.requires_grad_() for x in (q, k, v, w))
    assert torch.autograd.gradcheck(lambda q, k: kl.listed_scores(q, k, lists), (q, k))
    assert torch.autograd.gradcheck(lambda w, v: kl.listed_sum(w, v, lists), (w, v))


def test_the_sparse_path_serves_float_cpu_tensors_and_lists_up_to_b_h_n():
    lists = kl.key_lists(torch.zeros(2, 1, 3, 6, dtype=torch.long))
    assert kl.uses_sparse(torch.zeros(1), lists) and kl.uses_sparse(torch.zeros(1, dtype=torch.float64), lists)
    assert not kl.uses_sparse(torch.zeros(1, dtype=torch.bfloat16), lists)
    assert not kl.uses_sparse(torch.zeros(1), kl.key_lists(torch.zeros(1, 1, 3, 4, dtype=torch.long)))


def test_transpose_lists_every_entry_once_by_key():
    """The transpose's pointers and rows, which the backward's dk and dv products read, against a direct count."""
    positions, *_ = _inputs(2, 2, 9, 4, 1)
    lists = kl.key_lists(positions)
    columns = lists.columns.tolist()
    for key in range(2 * 2 * 9):
        start, end = int(lists.crow_t[key]), int(lists.crow_t[key + 1])
        rows = sorted(lists.columns_t[start:end].tolist())
        assert rows == sorted(e // 4 for e, c in enumerate(columns) if c == key)


def test_key_lists_refuses_a_tensor_that_is_not_b_h_n_m():
    with pytest.raises(ValueError, match="positions"):
        kl.key_lists(torch.zeros(3, 4, dtype=torch.long))


RUN_SHAPES = [  # (B, H, N, runs, length, pad, D): overlapping runs, a run as long as the keys, runs of one key
    (2, 3, 7, 2, 3, 3, 4), (1, 2, 4, 3, 4, 4, 3), (3, 1, 6, 4, 1, 1, 2), (1, 1, 17, 1, 5, 5, 5),
]


def _run_inputs(B, H, N, R, length, pad, D, inside=True):
    """Runs over a random reordering of the keys (slot pad + i holds key order[..., i]); ``inside``: every run within
    the slots that hold keys, else anywhere in the padded slots (entries on the pad then name key order[..., 0] or
    order[..., N - 1], and must get a zero gradient)."""
    g = torch.Generator().manual_seed(fixed_seed())
    order = torch.stack([torch.randperm(N, generator=g) for _ in range(B * H)]).view(B, H, N)
    key_slot = torch.empty_like(order).scatter_(-1, order, torch.arange(N).expand(B, H, N)) + pad
    low, high = (pad, pad + N - length) if inside else (0, N + 2 * pad - length)
    first = torch.randint(low, high + 1, (B, H, N, R), generator=g)
    slot = (first.unsqueeze(-1) + torch.arange(length)).reshape(B, H, N, R * length)
    on_keys = (slot >= pad) & (slot < pad + N)
    positions = order.gather(-1, (slot - pad).clamp(0, N - 1).flatten(2)).view(B, H, N, R * length)
    q, k, v = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(3))
    w = torch.randn(B, H, N, R * length, generator=g, dtype=torch.float64)
    lists = kl.run_key_lists(positions, first, length, key_slot, N + 2 * pad)
    return lists, positions, on_keys, q, k, v, w


@pytest.mark.parametrize("shape", RUN_SHAPES)
def test_run_lists_match_a_loop_over_their_keys(shape, path):
    lists, positions, _, q, k, v, w = _run_inputs(*shape, inside=False)
    scores, out = _loop_reference(positions, q, k, v, w)
    torch.testing.assert_close(kl.listed_scores(q, k, lists), scores, rtol=0, atol=1e-12)
    torch.testing.assert_close(kl.listed_sum(w, v, lists), out, rtol=0, atol=1e-12)


@pytest.mark.parametrize("inside", [True, False])
@pytest.mark.parametrize("shape", RUN_SHAPES[:3])
def test_run_lists_gradcheck(shape, inside, path):
    """The backward's dk and dv come from the transpose built from the runs, in slot order; entries on the pad get
    a zero gradient, as the lists ask (the kernel masks them)."""
    lists, _, on_keys, q, k, v, w = _run_inputs(*shape, inside=inside)
    q, k, v, w = (x.requires_grad_() for x in (q, k, v, w))
    assert torch.autograd.gradcheck(lambda q, k: kl.listed_scores(q, k, lists).masked_fill(~on_keys, 0.0), (q, k))
    assert torch.autograd.gradcheck(lambda w, v: kl.listed_sum(w.masked_fill(~on_keys, 0.0), v, lists), (w, v))


@pytest.mark.parametrize("shape", RUN_SHAPES)
def test_the_transpose_from_runs_lists_each_key_s_entries_as_the_sort_does(shape):
    lists, *_ = _run_inputs(*shape)
    runs, sort = lists._from_runs(), lists._sorted()
    for key, slot in enumerate(lists.runs.key_slot.tolist()):  # the same entries and query rows per key
        start, end = int(runs.crow_t[slot]), int(runs.crow_t[slot + 1])
        by_key = slice(int(sort.crow_t[key]), int(sort.crow_t[key + 1]))
        assert sorted(runs.order[start:end].tolist()) == sorted(sort.order[by_key].tolist())
        assert sorted(runs.columns_t[start:end].tolist()) == sorted(sort.columns_t[by_key].tolist())
    on_keys = sum(int(runs.crow_t[slot + 1] - runs.crow_t[slot]) for slot in lists.runs.key_slot.tolist())
    assert on_keys == lists.columns.numel()  # and nothing else: no entry filed under a pad slot


def test_run_key_lists_refuses_runs_outside_the_slots():
    positions, key_slot = torch.zeros(1, 1, 1, 3, dtype=torch.long), torch.zeros(1, 1, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="slots=6"):
        kl.run_key_lists(positions, torch.tensor([4]).view(1, 1, 1, 1), 3, key_slot, 6)
    with pytest.raises(ValueError, match="slots=6"):
        kl.run_key_lists(positions, torch.tensor([-1]).view(1, 1, 1, 1), 3, key_slot, 6)
    with pytest.raises(ValueError, match="first must be"):
        kl.run_key_lists(positions, torch.zeros(1, 1, 1, 2, dtype=torch.long), 3, key_slot, 6)
