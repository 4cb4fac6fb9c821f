"""Attention over an explicit list of keys per query, as sparse matrices: no (B, H, N, M, D) gather.

A mechanism that reads, for each query n, the keys at ``positions[n, 0..M)`` (cluster-select's selected cluster
members) needs two products over those lists:

* the scores  s[n, m] = q_n . k_{positions[n, m]}        -- a sampled dense-dense product (SDDMM);
* the output  o_n = sum_m w[n, m] v_{positions[n, m]}    -- a sparse-dense product (SpMM).

Gathering the keys and values per query materialises (B, H, N, M, D) tensors (and their gradients, and an index
scatter-add in the backward): on a CPU at N = 1,024, M = 96, D = 64, batch 16 and 2 heads, 800 MB each and about
1.3 s for the scores alone. Here the lists are one CSR matrix of B H N rows (row n holds the M flat positions
``b h N + position``), and the four products of the forward and backward are ``torch.sparse.sampled_addmm`` and
CSR x dense matmuls over its B H N M entries:

    scores:   s = SDDMM(q, k)          ds -> dq = S(ds) k,  dk = S(ds)^T q
    output:   o = S(w) v               do -> dw = SDDMM(do, v),  dv = S(w)^T do

S^T comes from one stable sort of the column indices per :class:`KeyLists`, made at its first backward and shared
by every product of a layer's backward, so no CSR transpose is converted per product. Lists made of runs of
consecutive slots of a reordering of the keys (:func:`run_key_lists`: cluster-select's selected clusters, which are
runs in cluster-sorted order) build the transpose from the runs instead, with its rows in slot order: a sort of the
runs' starts, one per run rather than one per entry, and a count of the runs covering each slot. dk and dv then
come out in slot order and one gather puts them back in key order. An entry's value is computed
alone, so repeated or clamped positions are fine: a caller masks the entries it does not read (weight 0, score
ignored).
Cost O(B H N M D) time for each product, O(B H N M) memory. Measured against the gather in
docs/speed-and-memory.md#cluster-select-its-kernels-and-its-training-step.

The sparse path runs where CSR products exist for the dtype: float32 and float64 on the CPU; elsewhere (CUDA, half
precision, or lists longer than B H N) the same functions gather (:func:`uses_sparse`), with the same values and
gradients.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from .._checks import check_int

__all__ = ["KeyLists", "Runs", "key_lists", "listed_scores", "listed_sum", "run_key_lists", "uses_sparse"]


class _Transpose(NamedTuple):
    order: torch.Tensor
    crow_t: torch.Tensor
    columns_t: torch.Tensor


class Runs(NamedTuple):
    """Lists whose entries are runs of consecutive slots of a reordering of the keys (:func:`run_key_lists`).

    first: (B H N R,) flat slot (b h slots + slot) of each run's first entry, in entry order; length: entries per
    run; slots: slots per (b, h); key_slot: (B H N,) the flat slot of every flat key row."""

    first: torch.Tensor
    length: int
    slots: int
    key_slot: torch.Tensor


class KeyLists:
    """Each query's keys as a CSR pattern over the flattened (B H N) rows of q, k and v.

    shape: (B, H, N, M) of the lists; columns: (B H N M,) flat key row of every entry, in (row, m) order;
    crow: (B H N + 1,) row pointers (M per row). The transpose, which only a backward reads, is built on first use
    and kept (the scores' and the output's backward share it; a forward without gradients never builds it): order:
    (B H N M,) entries grouped by key (the transpose's entry order); crow_t: row pointers of the transpose;
    columns_t: (B H N M,) the query row of every entry of the transpose. Its rows are the key rows, or with
    ``runs`` (:func:`run_key_lists`) the slots, B H slots of them, which :meth:`to_keys` maps back to key rows."""

    def __init__(self, shape: tuple[int, int, int, int], columns: torch.Tensor, crow: torch.Tensor,
                 runs: Runs | None = None) -> None:
        self.shape, self.columns, self.crow, self.runs = shape, columns, crow, runs
        self._transpose: _Transpose | None = None

    @property
    def transpose_rows(self) -> int:
        """Rows of the transpose: the key rows, or the slots of ``runs``."""
        rows = self.crow.numel() - 1
        return rows if self.runs is None else rows // self.shape[2] * self.runs.slots

    def to_keys(self, x: torch.Tensor) -> torch.Tensor:
        """(transpose_rows, D) rows of a product with the transpose -> (B H N, D) in key order."""
        return x if self.runs is None else x.index_select(0, self.runs.key_slot)

    def transpose(self) -> _Transpose:
        if self._transpose is None:
            self._transpose = self._from_runs() if self.runs is not None else self._sorted()
        return self._transpose

    def _sorted(self) -> _Transpose:
        """The transpose by one stable sort of every entry's column."""
        rows, M = self.crow.numel() - 1, self.shape[-1]
        # argsort: without the sorted values, half the time of torch.sort's (30 ms against 63 ms for 3.1 M
        # int32 entries on one CPU thread); stable keeps each key's queries in row order, as CSR wants
        order = torch.argsort(self.columns, stable=True).to(self.columns.dtype)
        crow_t = torch.zeros_like(self.crow)
        crow_t[1:] = torch.bincount(self.columns, minlength=rows).cumsum(0)
        return _Transpose(order, crow_t, torch.div(order, max(M, 1), rounding_mode="floor"))

    def _from_runs(self) -> _Transpose:
        """The transpose in slot order from the runs, without sorting the entries: slot j is read by the runs that
        start in (j - length, j], which are consecutive once the runs are sorted by their start. Within a slot the
        queries come in the order of their runs' starts, not of their rows: a CSR product sums a row's entries in
        any order, so only the rounding of the sums can differ from the sorted transpose's."""
        first, length = self.runs.first, self.runs.length
        M, cols = self.shape[-1], self.transpose_rows
        device, index = first.device, self.columns.dtype  # int32 where it fits: its gathers take half the time
        by_start = torch.argsort(first).to(index)  # one entry per run, not per key read
        upto = torch.bincount(first, minlength=cols).cumsum(0)  # runs starting at or before each slot
        below = torch.cat([upto.new_zeros(length), upto])[:cols]  # ... at or before slot j - length
        count = upto - below  # the runs covering slot j
        crow_t = torch.zeros(cols + 1, dtype=index, device=device)
        crow_t[1:] = count.cumsum(0)
        total = first.numel() * length
        slot = torch.repeat_interleave(torch.arange(cols, dtype=index, device=device), count.to(index),
                                       output_size=total)
        # entry p of the transpose's row j is run by_start[below[j] + p - crow_t[j]], at offset j - its start;
        # index_select, not indexing: about 5x faster with int32 indices on a CPU
        shift = (below.to(index) - crow_t[:-1]).index_select(0, slot)
        run = by_start.index_select(0, torch.arange(total, dtype=index, device=device) + shift)
        order = run * length + (slot - first.to(index).index_select(0, run))
        row_of_run = torch.arange(first.numel(), dtype=index, device=device) // (M // length)
        return _Transpose(order, crow_t, row_of_run.index_select(0, run))

    @property
    def order(self) -> torch.Tensor:
        return self.transpose().order

    @property
    def crow_t(self) -> torch.Tensor:
        return self.transpose().crow_t

    @property
    def columns_t(self) -> torch.Tensor:
        return self.transpose().columns_t


def key_lists(positions: torch.Tensor) -> KeyLists:
    """(B, H, N, M) key positions in [0, N) per query -> their :class:`KeyLists` (the transpose's sort deferred to
    the first backward)."""
    if positions.dim() != 4:
        raise ValueError(f"positions must be (B, H, N, M); got shape {tuple(positions.shape)}")
    B, H, N, M = positions.shape
    rows = B * H * N
    device = positions.device
    # int32 indices while they fit: the sort and the CSR products take about half the time of int64's on a CPU
    index = torch.int32 if rows * M < 2**31 else torch.long
    columns = (positions + N * torch.arange(B * H, device=device).view(B, H, 1, 1)).reshape(-1).to(index)
    crow = torch.arange(rows + 1, device=device, dtype=index) * M
    return KeyLists((B, H, N, M), columns, crow)


def run_key_lists(positions: torch.Tensor, first: torch.Tensor, length: int, key_slot: torch.Tensor, slots: int
                  ) -> KeyLists:
    """:func:`key_lists` of ``positions`` (B, H, N, M) whose entries are runs of consecutive slots of a reordering of
    the keys: entry m = r length + o of query n sits at slot first[..., r] + o (``first`` (B, H, N, R), M = R
    length), in a slot space of ``slots`` per (b, h) in which key p sits at ``key_slot[..., p]`` (B, H, N); slots that
    hold no key pad the ends. The transpose is then built from the runs (:meth:`KeyLists._from_runs`), with no sort
    of the B H N M entries. An entry at a slot that holds no key, or whose slot holds another key than its position
    names, must get a zero gradient (a masked entry): the transpose files it under its slot."""
    check_int("length", length, minimum=1)
    lists = key_lists(positions)
    B, H, N, M = lists.shape
    if first.shape[:3] != (B, H, N) or first.shape[-1] * length != M:
        raise ValueError(f"first must be (B, H, N, M / length) = ({B}, {H}, {N}, {M // max(length, 1)}) for "
                         f"positions {tuple(positions.shape)} and length {length}; got {tuple(first.shape)}")
    # checked where it costs no device round trip (a CUDA graph captures the lists' construction)
    if first.device.type == "cpu" and first.numel() and (int(first.min()) < 0 or int(first.max()) + length > slots):
        raise ValueError(f"every run of length {length} must lie in [0, slots={slots}); got first slots from "
                         f"{int(first.min())} to {int(first.max())}")
    block = slots * torch.arange(B * H, device=first.device).view(B, H, 1)
    lists.runs = Runs((first + block.unsqueeze(-1)).reshape(-1), length, slots, (key_slot + block).reshape(-1))
    return lists


def uses_sparse(x: torch.Tensor, lists: KeyLists) -> bool:
    """Whether the CSR products serve tensors like ``x`` (float32 / float64 on the CPU) with these lists, else the
    gather does. ``sampled_addmm`` refuses a pattern with more entries than the dense matrix has cells, which lists
    longer than B H N (tiny inputs, clamped repeats) would make."""
    B, H, N, M = lists.shape
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and M <= B * H * N


def _matrix(lists: KeyLists, values: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """The (B H N, B H N) CSR matrix with ``values`` in entry order (``transpose``: its transpose, (transpose_rows,
    B H N), values already in the transpose's order)."""
    rows = lists.crow.numel() - 1
    shape = (lists.transpose_rows, rows) if transpose else (rows, rows)
    crow, columns = (lists.crow_t, lists.columns_t) if transpose else (lists.crow, lists.columns)
    with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta state": once per process, not ours
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return torch.sparse_csr_tensor(crow, columns, values, shape, check_invariants=False)


def _sampled(lists: KeyLists, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(B H N M,) entry values a[row] . b[column] for rows a, b (B H N, D)."""
    pattern = _matrix(lists, a.new_zeros(lists.columns.shape))
    return torch.sparse.sampled_addmm(pattern, a, b.t(), beta=0.0).values()


class _Scores(torch.autograd.Function):
    """s = SDDMM(q, k) over the lists, (B H N M,); backward: dq = S(ds) k, dk = S(ds)^T q (the dual of _Sum)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, lists: KeyLists) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(q, k)
        ctx.lists = lists
        return _sampled(lists, q, k)

    @staticmethod
    @once_differentiable  # the backward's sparse products are not differentiated again: a clear error, not zeros
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        q, k = ctx.saved_tensors
        lists = ctx.lists
        grad = grad.contiguous()
        dq = _matrix(lists, grad) @ k if ctx.needs_input_grad[0] else None
        dk = (lists.to_keys(_matrix(lists, grad.index_select(0, lists.order), transpose=True) @ q)
              if ctx.needs_input_grad[1] else None)
        return dq, dk, None


class _Sum(torch.autograd.Function):
    """o = S(w) v, (B H N, D); backward: dw = SDDMM(do, v), dv = S(w)^T do (the dual of _Scores)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, v: torch.Tensor, lists: KeyLists) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(w, v)
        ctx.lists = lists
        return _matrix(lists, w) @ v

    @staticmethod
    @once_differentiable  # the backward's sparse products are not differentiated again: a clear error, not zeros
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        w, v = ctx.saved_tensors
        lists = ctx.lists
        grad = grad.contiguous()
        dw = _sampled(lists, grad, v) if ctx.needs_input_grad[0] else None
        dv = (lists.to_keys(_matrix(lists, w.index_select(0, lists.order), transpose=True) @ grad)
              if ctx.needs_input_grad[1] else None)
        return dw, dv, None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(B, H, N, D) -> (B H N, D), contiguous."""
    return x.reshape(-1, x.shape[-1]).contiguous()


def _gathered(x: torch.Tensor, lists: KeyLists) -> torch.Tensor:
    """(B, H, N, D) -> (B, H, N, M, D): the rows each query lists (the fallback path)."""
    return _rows(x).index_select(0, lists.columns).view(*lists.shape, x.shape[-1])


def listed_scores(q: torch.Tensor, k: torch.Tensor, lists: KeyLists) -> torch.Tensor:
    """q (B, H, N, D), k (B, H, N, D) -> (B, H, N, M): q_n . k at each listed position (differentiable in both)."""
    if uses_sparse(q, lists):
        return _Scores.apply(_rows(q), _rows(k), lists).view(lists.shape)
    return (_gathered(k, lists) @ q.unsqueeze(-1)).squeeze(-1)


def listed_sum(w: torch.Tensor, v: torch.Tensor, lists: KeyLists) -> torch.Tensor:
    """w (B, H, N, M), v (B, H, N, D) -> (B, H, N, D): sum_m w[..., m] v at the m-th listed position
    (differentiable in both)."""
    if uses_sparse(v, lists):
        B, H, N, _ = lists.shape
        return _Sum.apply(w.reshape(-1).contiguous(), _rows(v), lists).view(B, H, N, v.shape[-1])
    return (w.unsqueeze(-2) @ _gathered(v, lists)).squeeze(-2)
