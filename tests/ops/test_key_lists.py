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


RUN_SHAPES = [  # (B, H, N, runs, length, key rows, D): overlapping runs, a run as long as the keys, runs of one key
    (2, 3, 7, 2, 3, 11, 4), (1, 2, 5, 3, 4, 4, 3), (3, 1, 2, 4, 1, 6, 2), (1, 1, 9, 1, 5, 17, 5),
]


def _run_inputs(B, H, N, R, length, rows, D):
    g = torch.Generator().manual_seed(fixed_seed())
    first = torch.randint(0, rows - length + 1, (B, H, N, R), generator=g)
    positions = (first.unsqueeze(-1) + torch.arange(length)).reshape(B, H, N, R * length)
    q = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, H, rows, D, generator=g, dtype=torch.float64) for _ in range(2))
    w = torch.randn(B, H, N, R * length, generator=g, dtype=torch.float64)
    return first, positions, q, k, v, w


@pytest.mark.parametrize("shape", RUN_SHAPES)
def test_run_lists_match_a_loop_over_their_keys(shape, path):
    first, positions, q, k, v, w = _run_inputs(*shape)
    lists = kl.run_key_lists(first, shape[4], shape[5])
    scores, out = _loop_reference(positions, q, k, v, w)
    torch.testing.assert_close(kl.listed_scores(q, k, lists), scores, rtol=0, atol=1e-12)
    torch.testing.assert_close(kl.listed_sum(w, v, lists), out, rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape", RUN_SHAPES[:3])
def test_run_lists_gradcheck(shape, path):
    """The backward's dk and dv read the transpose built from the runs."""
    first, _, q, k, v, w = _run_inputs(*shape)
    lists = kl.run_key_lists(first, shape[4], shape[5])
    q, k, v, w = (x.requires_grad_() for x in (q, k, v, w))
    assert torch.autograd.gradcheck(lambda q, k: kl.listed_scores(q, k, lists), (q, k))
    assert torch.autograd.gradcheck(lambda w, v: kl.listed_sum(w, v, lists), (w, v))


@pytest.mark.parametrize("shape", RUN_SHAPES)
def test_the_transpose_from_runs_lists_each_key_s_entries_as_the_sort_does(shape):
    first, *_ = _run_inputs(*shape)
    lists = kl.run_key_lists(first, shape[4], shape[5])
    runs, sort = lists._from_runs(), lists._sorted()
    assert torch.equal(runs.crow_t, sort.crow_t)
    for key in range(lists.num_columns):  # the same entries and query rows per key, in any order
        start, end = int(sort.crow_t[key]), int(sort.crow_t[key + 1])
        assert sorted(runs.order[start:end].tolist()) == sorted(sort.order[start:end].tolist())
        assert sorted(runs.columns_t[start:end].tolist()) == sorted(sort.columns_t[start:end].tolist())


def test_run_key_lists_refuses_runs_outside_the_keys():
    with pytest.raises(ValueError, match="num_keys=6"):
        kl.run_key_lists(torch.tensor([4]).view(1, 1, 1, 1), 3, 6)
    with pytest.raises(ValueError, match="num_keys=6"):
        kl.run_key_lists(torch.tensor([-1]).view(1, 1, 1, 1), 2, 6)
    with pytest.raises(ValueError, match="first"):
        kl.run_key_lists(torch.zeros(3, 4, dtype=torch.long), 2, 6)
