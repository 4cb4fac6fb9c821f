"""Softmax attention of each query over its own list of keys, fused into one C++ loop on the CPU.

For q (B, H, N, D), k and v (B, H, Nk, D) and ``index`` (B, H, N, M) -- the key positions each query reads, -1 for
none -- and optionally a contiguous ``window`` (query i also reads the keys at i - window_offset .. i -
window_offset + window - 1 that lie in [0, Nk) and are not padding), returns, over those keys j_m,

    out[b, h, i] = sum_m p_m v[b, h, j_m],   p = softmax_m(q[b, h, i] . k[b, h, j_m] * scale)
    lse[b, h, i] = log sum_m exp(q[b, h, i] . k[b, h, j_m] * scale)

(a query without keys: out 0, lse -inf). With ``summaries`` (:class:`RangeSummaries`), each query also reads, in
the same softmax, one summary per group: the mean key and value of some of the group's rows in a prefix-summed
order, with logit q . mean * scale + log n (cluster-select's cluster summaries, NSA's compressed branch on
clusters; the gradient reaches the prefix sums, and through them the keys and values). The window needs no index:
a (B, H, N, window) int64 list, its padding check and its concatenation cost more than the window's attention
(cluster-select's window of 128 at N = 1,024). ``lse`` lets a caller merge this softmax with another over other
keys exactly: out = (e^lse1 out1 + e^lse2 out2) / (e^lse1 + e^lse2).

Why a kernel of its own. Cluster-select's keys per query are a window, a sink and runs of cluster members: a list
of M positions. :mod:`clusterformer.ops.key_lists` reads them with sparse products (no (B, H, N, M, D) gather) but
still materialises (B, H, N, M) scores, weights and their gradients, each pass over them an element-wise kernel of
its own. Here the forward is one pass per query (scores, running maximum, weighted sum, kept only as ``lse``) and
the backward another (the scores recomputed from ``lse``, then dq, dk and dv), work split over the (b, h) pairs so
that the scatter into dk and dv has no race. Memory: O(B H N) beyond the inputs and outputs. Measured in
docs/speed-and-memory.md#cluster-select-its-kernels-and-its-training-step.

The kernel is C++ (``csrc/listed_attention.cpp``), compiled on first use (:mod:`clusterformer.ops.extensions`: about
30 s, once per machine, for the CPU's vector width). It needs a C++ compiler and ninja; without them, or with
``CLUSTERFORMER_NO_EXTENSIONS=1``, :func:`extension_available` is False (:func:`extension_error` says why) and
callers fall back to the unfused kernels. :func:`listed_attention_reference` is the same function by a gather, for
tests and for tensors the kernel does not take (CUDA, half precision).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..masks import NO_MASK, AttentionMask, check_mask
from .extensions import CppExtension
from .heads import empty_heads, gradient_buffers, unit_rows

__all__ = ["RangeSummaries", "SlotRuns", "bound_groups", "extension_available", "extension_error",
           "listed_attention", "listed_attention_reference", "summary_logits", "top_members"]

_KERNEL = CppExtension("listed_attention", "the fused key-list kernel")


def extension_available() -> bool:
    """Whether the fused kernel is built (building it now if it was not)."""
    return _KERNEL.available()


def extension_error() -> str | None:
    """Why the fused kernel is not available, or None when it is (or has not been tried)."""
    return _KERNEL.error


class RangeSummaries(NamedTuple):
    """One summary per (query, group) of rows in a prefix-summed order (cluster-select: keys sorted by cluster).

    prefix_k, prefix_v: (B, H, R + 1, D) prefix sums of keys and values in that order (row 0 zero); start, total:
    (B, H, C) int64, each group's first row and size; lower, upper: (B, H, N, C) int64. Query i's summary of group c
    holds the rows start + [0, lower) and start + [upper, total): n = lower + total - upper of them (no summary where
    n <= 0); key = their sum of keys / n, value = their sum of values / n, logit = q . key * scale + log n."""

    prefix_k: torch.Tensor
    prefix_v: torch.Tensor
    start: torch.Tensor
    total: torch.Tensor
    lower: torch.Tensor
    upper: torch.Tensor


class SlotRuns(NamedTuple):
    """Keys listed as runs of consecutive slots of a sorted order, without an index per key (cluster-select: each
    selected cluster's members that a query reads alone are consecutive in cluster-sorted order).

    order: (B, H, Nk) int64 slot -> key position; first, length: (B, H, N, R) int64; capacity: the most keys of
    one run. Query i reads the keys order[first[..., r] + u] for u < length[..., r], each run r. ``length`` 0: none."""

    order: torch.Tensor
    first: torch.Tensor
    length: torch.Tensor
    capacity: int

    def as_index(self) -> torch.Tensor:
        """The same keys as an index (B, H, N, R * capacity), -1 where a run has fewer than ``capacity``."""
        B, H, N, R = self.first.shape
        steps = torch.arange(self.capacity, device=self.first.device)
        slots = (self.first.unsqueeze(-1) + steps).clamp(max=max(self.order.shape[2] - 1, 0))
        positions = self.order.gather(2, slots.view(B, H, N * R * self.capacity)).view(B, H, N, R * self.capacity)
        return torch.where((steps < self.length.unsqueeze(-1)).view(B, H, N, -1), positions, -1)


_NO_LONGS = torch.empty(0, dtype=torch.long)


class _ListedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_k: torch.Tensor,
                prefix_v: torch.Tensor, index: torch.Tensor, runs: tuple[torch.Tensor, ...], capacity: int,
                key_real: torch.Tensor, ranges: tuple[torch.Tensor, ...], window: int, offset: int, scale: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
        B, H, N, D = q.shape
        # read in place (views of the fused projection); out in the order the heads are joined in
        q, k, v = unit_rows(q), unit_rows(k), unit_rows(v)
        out, lse = _KERNEL.load().forward(q, k, v, index, *runs, capacity, key_real, window, offset, prefix_k,
                                          prefix_v, *ranges, empty_heads(B, H, N, D, like=q), scale)
        ctx.save_for_backward(q, k, v, prefix_k, prefix_v, index, key_real, out, lse, *runs, *ranges)
        ctx.window, ctx.offset, ctx.scale, ctx.capacity = window, offset, scale, capacity
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        q, k, v, prefix_k, prefix_v, index, key_real, out, lse, *rest = ctx.saved_tensors
        runs, ranges = rest[:3], rest[3:]
        dout = torch.zeros_like(out) if dout is None else unit_rows(dout)
        dlse = torch.zeros_like(lse) if dlse is None else dlse.contiguous()
        # dq written whole by the kernel, dk and dv accumulated; in the projection's layout when q, k, v are its
        # views (ops/heads.py: its split's backward then copies nothing)
        dq, dk, dv = gradient_buffers(q, k, v, zero=(False, True, True))
        dprefix_k, dprefix_v = _KERNEL.load().backward(
            q, k, v, index, *runs, ctx.capacity, key_real, ctx.window, ctx.offset, prefix_k, prefix_v, *ranges, out,
            lse, dout, dlse, dq, dk, dv, ctx.scale)
        has = prefix_k.numel() > 0
        return (dq, dk, dv, dprefix_k if has else None, dprefix_v if has else None, None, None, None, None, None,
                None, None, None)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, window: int,
           mask: AttentionMask, summaries: RangeSummaries | None = None,
           runs: SlotRuns | None = None) -> None:
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D (B, H, N, D); got shape {tuple(q.shape)}")
    if k.dim() != 4 or k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"k and v must both have shape (B, H, Nk, D) matching q {tuple(q.shape)}; got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if index.dim() != 4 or index.shape[:3] != q.shape[:3]:
        raise ValueError(f"index must have shape (B, H, N, M) = {tuple(q.shape[:3])} + (M,); got {tuple(index.shape)}")
    if index.dtype != torch.long:
        raise ValueError(f"index must be int64; got {index.dtype}")
    if index.numel() and not (int(index.min()) >= -1 and int(index.max()) < k.shape[2]):
        raise ValueError(f"index must hold -1 (no key) or positions in [0, {k.shape[2]}); got values in "
                         f"[{int(index.min())}, {int(index.max())}]")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"q, k and v must share a floating-point dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0; got {window!r}")
    check_mask(mask, q.shape[0], k.shape[2])
    if runs is not None:
        _check_runs(runs, q, k)
    if summaries is not None:
        B, H, N, D = q.shape
        pk, pv, start, total, lower, upper = summaries
        if pk.dim() != 4 or pk.shape != pv.shape or pk.shape[:2] != (B, H) or pk.shape[3] != D or pk.dtype != q.dtype:
            raise ValueError(f"summaries.prefix_k and prefix_v must have shape (B, H, R + 1, D) with B, H, D = "
                             f"{(B, H, D)} and q's dtype; got {tuple(pk.shape)}, {tuple(pv.shape)}")
        if start.dim() != 3 or start.shape[:2] != (B, H) or total.shape != start.shape:
            raise ValueError(f"summaries.start and total must have shape (B, H, C); got {tuple(start.shape)}, "
                             f"{tuple(total.shape)}")
        if lower.shape != (B, H, N, start.shape[2]) or upper.shape != lower.shape:
            raise ValueError(f"summaries.lower and upper must have shape (B, H, N, C) = {(B, H, N, start.shape[2])}; "
                             f"got {tuple(lower.shape)}, {tuple(upper.shape)}")
        if any(t.dtype != torch.long for t in (start, total, lower, upper)):
            raise ValueError("summaries.start, total, lower and upper must be int64")
        rows = pk.shape[2] - 1
        if start.numel() and (int(start.min()) < 0 or int((start + total).max()) > rows):
            raise ValueError(f"summaries: every group's rows must lie in [0, {rows}) (the prefix sums' rows - 1)")
        if lower.numel() and (int(lower.min()) < 0 or bool((upper > total[:, :, None]).any())
                              or bool((lower > total[:, :, None]).any()) or int(upper.min()) < 0):
            raise ValueError("summaries: lower and upper must lie in [0, total] of their group")


def listed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor,
                     scale: float | None = None, *, window: int = 0, window_offset: int = 0,
                     mask: AttentionMask = NO_MASK, summaries: RangeSummaries | None = None,
                     runs: SlotRuns | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, H, N, D), lse (B, H, N)) of each query over the keys ``index`` lists, the keys of its ``runs``
    (:class:`SlotRuns`) and its ``window`` (module docstring); ``scale`` defaults to D^-0.5. Positions in ``index``
    must be -1 (none) or in [0, Nk); a key listed twice, or listed and in the window, counts twice.
    ``mask``: an :class:`~clusterformer.masks.AttentionMask` whose padding is (B, Nk) or None: the window skips
    its padding keys (the lists and runs are taken as given; the window's place is ``window_offset``).
    ``summaries``: one more logit per group (:class:`RangeSummaries`). The fused kernel on float32/float64 CPU
    tensors when it is built (:func:`extension_available`), else :func:`listed_attention_reference`; the same
    values and gradients either way. The kernel reads q, k, v with any strides but a unit one along D (views of a
    fused projection, :mod:`clusterformer.ops.heads`) and lays ``out`` out as (B, N, H, D), so that joining its heads
    is a view; its gradients of such views come back in the projection's layout."""
    _check(q, k, v, index, window, mask, summaries, runs)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    fused = (q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64) and extension_available())
    if not fused:
        return listed_attention_reference(q, k, v, index, scale, window=window, window_offset=window_offset,
                                          mask=mask, summaries=summaries, runs=runs)
    key_real = (torch.empty(0, dtype=torch.bool) if mask.padding is None
                else mask.real(q.shape[0], k.shape[2], q.device).contiguous())
    if summaries is None:
        prefix_k = prefix_v = q.new_empty(0)
        ranges = (_NO_LONGS,) * 4
    else:
        prefix_k, prefix_v = summaries.prefix_k.contiguous(), summaries.prefix_v.contiguous()
        ranges = tuple(t.contiguous() for t in summaries[2:])
    slot_runs, capacity = (_NO_LONGS,) * 3, 0
    if runs is not None:
        slot_runs = (runs.order.contiguous(), runs.first.contiguous(), runs.length.contiguous())
        capacity = runs.capacity
    return _ListedAttention.apply(q, k, v, prefix_k, prefix_v,
                                  index.contiguous(), slot_runs, capacity, key_real, ranges, window,
                                  int(window_offset), scale)


def listed_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor,
                               scale: float | None = None, *, window: int = 0, window_offset: int = 0,
                               mask: AttentionMask = NO_MASK, summaries: RangeSummaries | None = None,
                               runs: SlotRuns | None = None, dropout_p: float = 0.0
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`listed_attention` by a gather of the listed keys and values, (B, H, N, window + M, D), the window's
    positions listed first and the runs' keys last (:meth:`SlotRuns.as_index`), and of the summaries' prefix rows,
    (B, H, N, C, D): the definition, written plainly (autograd does the backward). ``dropout_p``: the weights dropped
    out as SDPA drops them (a training forward; ``lse`` is of the weights before it)."""
    _check(q, k, v, index, window, mask, summaries, runs)
    if runs is not None:
        index = torch.cat([index, runs.as_index()], dim=-1)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if window:
        B, H, N, _ = index.shape
        Nk = k.shape[2]
        spans = torch.arange(N, device=q.device)[:, None] - window_offset + torch.arange(window, device=q.device)
        inside = (spans >= 0) & (spans < Nk)
        if mask.padding is not None:  # (B, N, window): the window's real keys
            inside = inside & mask.real(B, Nk, q.device)[:, spans.clamp(0, max(Nk - 1, 0))]
        spans = torch.where(inside, spans, -1).expand(B, N, window)  # -1: outside [0, Nk), or padding
        index = torch.cat([spans[:, None].expand(B, H, N, window), index], dim=-1)
    B, H, N, M = index.shape
    D = q.shape[-1]
    listed = index >= 0
    flat = index.clamp(min=0).reshape(B, H, N * M, 1).expand(-1, -1, -1, D)
    keys, values = (t.gather(2, flat).view(B, H, N, M, -1) for t in (k, v))
    scores = torch.einsum("bhnd,bhnmd->bhnm", q, keys).mul(scale).masked_fill(~listed, float("-inf"))
    if summaries is not None:  # one more key per group: the mean of its rows, logit + log n
        summary_scores, n = _summary_scores(q, summaries, scale)
        summary_values = _range_sums(summaries.prefix_v, summaries) / n.clamp(min=1).unsqueeze(-1)
        scores = torch.cat([scores, summary_scores], dim=-1)
        values = torch.cat([values, summary_values], dim=3)
        listed = torch.cat([listed, n > 0], dim=-1)
    empty = ~listed.any(-1, keepdim=True)
    lse = torch.logsumexp(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty.squeeze(-1), float("-inf"))
    weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    if dropout_p:
        weights = F.dropout(weights, dropout_p)
    return torch.einsum("bhnm,bhnmd->bhnd", weights, values), lse


def _check_runs(runs: SlotRuns, q: torch.Tensor, k: torch.Tensor) -> None:
    B, H, N, _ = q.shape
    Nk = k.shape[2]
    order, first, length, capacity = runs
    if order.shape != (B, H, Nk) or order.dtype != torch.long:
        raise ValueError(f"runs.order must be an int64 tensor of shape (B, H, Nk) = {(B, H, Nk)}; got {order.dtype} "
                         f"{tuple(order.shape)}")
    if (first.dim() != 4 or first.shape[:3] != (B, H, N) or length.shape != first.shape
            or first.dtype != torch.long or length.dtype != torch.long):
        raise ValueError(f"runs.first and runs.length must be int64 tensors of shape (B, H, N, R) with (B, H, N) = "
                         f"{(B, H, N)}; got {tuple(first.shape)}, {tuple(length.shape)}")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise ValueError(f"runs.capacity must be an int >= 0; got {capacity!r}")
    if first.numel() and (int(length.min()) < 0 or int(length.max()) > capacity):
        raise ValueError(f"runs.length must lie in [0, capacity={capacity}]; got [{int(length.min())}, "
                         f"{int(length.max())}]")
    if first.numel() and (int(first.min()) < 0 or int((first + length).max()) > Nk):
        raise ValueError(f"runs: every run's slots first .. first + length - 1 must lie in [0, {Nk})")
    if order.numel() and (int(order.min()) < 0 or int(order.max()) >= Nk):
        raise ValueError(f"runs.order must hold key positions in [0, {Nk})")


def summary_logits(q: torch.Tensor, summaries: RangeSummaries, scale: float | None = None) -> torch.Tensor:
    """The summaries' logits alone, (B, H, N, C): q . mean key * scale + log n, -inf where a summary holds no row (to
    rank groups: no gradient). The fused kernel where it runs, else a gather of the prefix rows; ``prefix_v`` is not
    read."""
    _check(q, q, q, q.new_empty(*q.shape[:3], 0, dtype=torch.long), 0, None, summaries)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    with torch.no_grad():
        if q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64) and extension_available():
            return _KERNEL.load().summary_logits(unit_rows(q.detach()), summaries.prefix_k.detach().contiguous(),
                                          *(t.contiguous() for t in summaries[2:]), scale)
        return _summary_scores(q, summaries, scale)[0]


def bound_groups(q: torch.Tensor, k: torch.Tensor, key_ids: torch.Tensor, *, num_groups: int, window: int,
                 causal: bool, block: int, select: int = 0, scale: float = 1.0) -> torch.Tensor:
    """Cluster-select's ``selection="bound"`` in one C++ pass per (sequence, head): for q (B, H, N, D) times
    ``scale`` (applied row by row in the kernel: the same bits as scaling q first, without its copy), k (B, H, N, D)
    and ``key_ids`` (B, H, N) in [0, num_groups] (num_groups: in no group), the upper bound
    sum_d max(q_d hi_d, q_d lo_d) of q . k over each group's members in the whole blocks of ``block`` positions
    outside the query's window (:func:`clusterformer.ops.selected_ranking.bound_logits`, which is its definition in
    tensor operations), built from running extremes as the queries move, not from a state per block. With
    ``select`` > 0, the ``select`` groups of largest bound per query, (B, H, N, select), best first, ties to the
    lower group id (:func:`clusterformer.ops.selected_ranking.top_groups`' rule); with 0 the bounds (B, H, N, G),
    -inf where a group has no such member. No gradient. Needs the fused kernel (:func:`extension_available`)."""
    if not extension_available():
        raise ValueError(f"bound_groups needs the fused kernel: {extension_error()}")
    if q.dim() != 4 or k.shape != q.shape or q.device.type != "cpu" or q.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"q and k must be float32/float64 CPU tensors of one shape (B, H, N, D); got {q.dtype} "
                         f"{tuple(q.shape)} on {q.device} and {tuple(k.shape)}")
    if key_ids.shape != q.shape[:3] or key_ids.dtype != torch.long:
        raise ValueError(f"key_ids must be an int64 tensor of shape (B, H, N) = {tuple(q.shape[:3])}; got "
                         f"{key_ids.dtype} {tuple(key_ids.shape)}")
    for name, value, least in (("num_groups", num_groups, 1), ("window", window, 0), ("block", block, 1),
                               ("select", select, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}; got {value!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite float > 0; got {scale!r}")
    if select > num_groups:
        raise ValueError(f"select must be at most num_groups={num_groups}; got {select}")
    if key_ids.numel() and (int(key_ids.min()) < 0 or int(key_ids.max()) > num_groups):
        raise ValueError(f"key_ids must lie in [0, num_groups={num_groups}]")
    with torch.no_grad():
        return _KERNEL.load().bound_select(unit_rows(q.detach()), unit_rows(k.detach().to(q.dtype)),
                                    key_ids.contiguous(), num_groups, select, window, block, causal, float(scale))


def top_members(q: torch.Tensor, k: torch.Tensor, runs: SlotRuns, *, per_group: int, keep: int) -> torch.Tensor:
    """Cluster-select's ``members="score"`` in one C++ pass: for q (B, H, N, D) and k (B, H, Nk, D), the candidates
    of each group s are the keys of its ``per_group`` runs (runs s * per_group .. (s + 1) * per_group - 1 of
    ``runs``, :class:`SlotRuns`, whose slots hold a group's members in position order); returns (B, H, N, groups *
    keep) int64, per group its ``keep`` candidates of largest q . k in slot order (equal scores at the cut: the later
    slot is kept), -1 after them where it has fewer (a group with at most ``keep`` is copied whole). No gradient. Needs
    the fused kernel (:func:`extension_available`); :func:`clusterformer.ops.selected_ranking.scored_members` falls
    back to tensor operations without it."""
    if not extension_available():
        raise ValueError(f"top_members needs the fused kernel: {extension_error()}")
    if q.dim() != 4 or q.device.type != "cpu" or q.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"q must be a float32/float64 CPU tensor (B, H, N, D); got {q.dtype} {tuple(q.shape)} on "
                         f"{q.device}")
    _check_runs(runs, q, k)
    for name, value in (("per_group", per_group), ("keep", keep)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1; got {value!r}")
    if runs.first.shape[-1] % per_group:
        raise ValueError(f"runs hold {runs.first.shape[-1]} runs per query: not a multiple of per_group={per_group}")
    with torch.no_grad():
        return _KERNEL.load().top_members(unit_rows(q.detach()), unit_rows(k.detach().to(q.dtype)),
                                          runs.order.contiguous(), runs.first.contiguous(), runs.length.contiguous(),
                                          per_group, keep)


def _range_sums(prefix: torch.Tensor, summaries: RangeSummaries) -> torch.Tensor:
    """Per query and group, the sum of the summary's rows of ``prefix`` (B, H, R + 1, D): (B, H, N, C, D)."""
    _, _, start, total, lower, upper = summaries
    B, H, N, C = lower.shape
    D = prefix.shape[-1]
    first, size = start[:, :, None].expand(B, H, N, C), total[:, :, None].expand(B, H, N, C)
    rows = torch.stack([first + lower, first, first + size, first + upper], dim=2)  # (B, H, 4, N, C)
    a, b, c, d = prefix.gather(2, rows.reshape(B, H, 4 * N * C, 1).expand(-1, -1, -1, D)).view(
        B, H, 4, N, C, D).unbind(2)
    return (a - b) + (c - d)


def _summary_scores(q: torch.Tensor, summaries: RangeSummaries, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The summaries' logits (B, H, N, C), q . mean key * scale + log n (-inf where n = 0), and n, by a gather."""
    n = (summaries.lower + summaries.total[:, :, None] - summaries.upper).to(q.dtype)
    keys = _range_sums(summaries.prefix_k, summaries) / n.clamp(min=1).unsqueeze(-1)
    scores = torch.einsum("bhnd,bhncd->bhnc", q, keys) * scale + n.clamp(min=1).log()
    return scores.masked_fill(n <= 0, float("-inf")), n
