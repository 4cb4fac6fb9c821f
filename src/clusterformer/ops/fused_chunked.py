"""Fused sorted-chunk attention (Triton): each query chunk reads its key window in place.

The window buffer of :mod:`clusterformer.ops.layouts` puts the keys of chunk c -- chunks c-L..c -- in
*contiguous* rows (L = look-back, ``hops = L + 1`` chunks per window). The unfused path turns those rows
into (windows, heads, hops * w, D) key/value tensors for SDPA, whose backward then allocates gradients for
windows ``hops`` times the size of K and V. These kernels never build windows:

* forward: program (window i, query tile, head) streams key rows ``[i w, i w + hops w)`` in tiles with an
  online softmax (FlashAttention-2), writing the output and each query's log-sum-exp;
* backward, dQ: the same loop, recomputing the probabilities from the saved log-sum-exp;
* backward, dK/dV: program (key tile, head) visits the windows that contain its rows -- at most
  hops + 1 of them -- and accumulates into its own rows, so no atomics and no window-sized gradients.

Which keys a query may see is computed in the kernel from per-row metadata, never from a dense mask:
the key row holds a token (``key_ok``, padding folded in), ``pos_q >= pos_k`` when causal, same
``group`` in the strict-causal layout, and, with ``exclude_self``, not the query's own row unless it
has no other allowed key (Reformer's shared-QK rule). A query with no allowed key outputs zeros and a
log-sum-exp of ``-inf``, exactly as :func:`clusterformer.ops.windowed_attention_lse`.

Scores and the softmax run in float32 (float64 for float64 inputs, which only the Triton interpreter
runs: the tests use it on CPU with ``TRITON_INTERPRET=1``). Float32 inputs use IEEE float32 products
unless ``torch.backends.cuda.matmul.allow_tf32`` is set. Dropout is not fused: callers fall back to
the unfused path when ``dropout_p > 0``.

Cost: the same FLOPs as the unfused path; memory O(rows x D) beyond the inputs (output, log-sum-exp, the
gradients of Q, K and V), no O(hops) factor.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

try:  # Triton is optional: the unfused path runs everywhere
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
    tl = None

__all__ = ["fused_available", "fused_chunk_attention"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def fused_available(t: torch.Tensor) -> bool:
    """Whether :func:`fused_chunk_attention` can run on tensors like ``t``: Triton is installed and either
    ``t`` is a CUDA tensor of float16/bfloat16/float32, or Triton's interpreter is on (any floating dtype,
    CPU tensors; slow, for tests)."""
    if triton is None:
        return False
    if interpreting():
        return t.is_floating_point()
    return t.is_cuda and t.dtype in _DTYPES


if triton is not None:

    @triton.jit
    def _allowed(n, n_ok, self_row, m_ok, KEY_OK, POS, GRP, SELF_ONLY_ROWS,
                 HAS_POS: tl.constexpr, HAS_GRP: tl.constexpr, EXCLUDE_SELF: tl.constexpr,
                 USE_SELF_ONLY: tl.constexpr):
        """(BLOCK_M, BLOCK_N) bool: query rows ``self_row`` may attend to key rows ``n``."""
        ok = tl.load(KEY_OK + n, mask=n_ok, other=0) != 0
        allowed = ok[None, :] & m_ok[:, None]
        if HAS_POS:
            pos_q = tl.load(POS + self_row, mask=m_ok, other=0)
            pos_k = tl.load(POS + n, mask=n_ok, other=0)
            allowed = allowed & (pos_q[:, None] >= pos_k[None, :])
        if HAS_GRP:
            grp_q = tl.load(GRP + self_row, mask=m_ok, other=-1)
            grp_k = tl.load(GRP + n, mask=n_ok, other=-2)
            allowed = allowed & (grp_q[:, None] == grp_k[None, :])
        if EXCLUDE_SELF:
            is_self = n[None, :] == self_row[:, None]
            if USE_SELF_ONLY:  # backward: the forward decided which rows fell back to their own key
                allowed = tl.where(SELF_ONLY_ROWS[:, None], is_self & allowed, allowed & ~is_self)
            else:
                allowed = allowed & ~is_self
        return allowed

    @triton.jit
    def _query_tile(w, hops, BLOCK_M: tl.constexpr):
        """This program's head and query tile: (head, query-buffer rows, the same tokens' key rows, valid rows, and
        its window's key rows [start, end))."""
        tiles = tl.cdiv(w, BLOCK_M)
        win = tl.program_id(0) // tiles
        local = (tl.program_id(0) % tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
        q_row = win * w + local  # row in the query buffer
        # key row r + (hops - 1) w is query row r
        return tl.program_id(1), q_row, q_row + (hops - 1) * w, local < w, win * w, win * w + hops * w

    @triton.jit
    def _channels(D, BLOCK_D: tl.constexpr):
        """The tile's channels and which of them are real (< D)."""
        d = tl.arange(0, BLOCK_D)
        return d, d < D

    @triton.jit
    def _rows(X, rows, ok, h, stride_m, stride_h, d, d_ok):
        """The tile (rows, BLOCK_D) of head h's rows ``rows`` of X, zero where a row is not ``ok`` or beyond D."""
        return tl.load(X + rows[:, None] * stride_m + h * stride_h + d[None, :], mask=ok[:, None] & d_ok[None, :],
                       other=0.0)

    @triton.jit
    def _key_tile(K, V, first, end, h, stride_km, stride_kh, stride_vm, stride_vh, d, d_ok, BLOCK_N: tl.constexpr):
        """Key rows ``first .. first + BLOCK_N`` (below ``end``): (rows, valid rows, their keys, their values)."""
        n = first + tl.arange(0, BLOCK_N)
        n_ok = n < end
        return (n, n_ok, _rows(K, n, n_ok, h, stride_km, stride_kh, d, d_ok),
                _rows(V, n, n_ok, h, stride_vm, stride_vh, d, d_ok))

    @triton.jit
    def _scores(q, k, scale, ACC: tl.constexpr, PRECISION: tl.constexpr):
        """(BLOCK_M, BLOCK_N) q . k * scale, accumulated in ACC."""
        return (tl.dot(q, tl.trans(k), input_precision=PRECISION, out_dtype=ACC) * scale).to(ACC)

    @triton.jit
    def _query_rows(Q, DO, LSE, DELTA, SELF_ONLY, q_row, m_ok, h, H, stride_qm, stride_qh, stride_dom, stride_doh,
                    d, d_ok, EXCLUDE_SELF: tl.constexpr):
        """What the backward reads of query rows ``q_row``: (q, dO, the log-sum-exp, delta = dO . O, which rows fell
        back to their own key in the forward: all valid rows unless ``EXCLUDE_SELF``)."""
        q = _rows(Q, q_row, m_ok, h, stride_qm, stride_qh, d, d_ok)
        do = _rows(DO, q_row, m_ok, h, stride_dom, stride_doh, d, d_ok)
        lse = tl.load(LSE + q_row * H + h, mask=m_ok, other=float("inf"))
        delta = tl.load(DELTA + q_row * H + h, mask=m_ok, other=0.0)
        self_only = m_ok
        if EXCLUDE_SELF:
            self_only = tl.load(SELF_ONLY + q_row * H + h, mask=m_ok, other=0) != 0
        return q, do, lse, delta, self_only

    @triton.jit
    def _fwd_kernel(
        Q, K, V, OUT, LSE, SELF_ONLY, KEY_OK, POS, GRP,
        stride_qm, stride_qh, stride_km, stride_kh, stride_vm, stride_vh, stride_om, stride_oh,
        H, w, hops, scale, D,
        HAS_POS: tl.constexpr, HAS_GRP: tl.constexpr, EXCLUDE_SELF: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        ACC: tl.constexpr, PRECISION: tl.constexpr,
    ):
        h, q_row, self_row, m_ok, start, end = _query_tile(w, hops, BLOCK_M)
        d, d_ok = _channels(D, BLOCK_D)
        q = _rows(Q, q_row, m_ok, h, stride_qm, stride_qh, d, d_ok)
        m_i = tl.full([BLOCK_M], float("-inf"), ACC)
        l_i = tl.zeros([BLOCK_M], ACC)
        acc = tl.zeros([BLOCK_M, BLOCK_D], ACC)
        for kb in range(start, end, BLOCK_N):  # the key window, read in place
            n, n_ok, k, v = _key_tile(K, V, kb, end, h, stride_km, stride_kh, stride_vm, stride_vh, d, d_ok, BLOCK_N)
            allowed = _allowed(n, n_ok, self_row, m_ok, KEY_OK, POS, GRP, m_ok,
                               HAS_POS, HAS_GRP, EXCLUDE_SELF, False)
            s = tl.where(allowed, _scores(q, k, scale, ACC, PRECISION), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet stay at zero
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION, out_dtype=ACC)
            m_i = m_new
        has_key = l_i > 0
        l_safe = tl.where(has_key, l_i, 1.0)
        out = acc / l_safe[:, None]
        lse = tl.where(has_key, m_i + tl.log(l_safe), float("-inf"))
        if EXCLUDE_SELF:  # no other key: the query attends to its own key alone (weight 1)
            self_ok = tl.load(KEY_OK + self_row, mask=m_ok, other=0) != 0
            fallback = (l_i == 0) & self_ok & m_ok
            k_self = _rows(K, self_row, m_ok, h, stride_km, stride_kh, d, d_ok)
            v_self = _rows(V, self_row, m_ok, h, stride_vm, stride_vh, d, d_ok)
            s_self = (tl.sum(q.to(ACC) * k_self.to(ACC), 1) * scale).to(ACC)
            out = tl.where(fallback[:, None], v_self.to(ACC), out)
            lse = tl.where(fallback, s_self, lse)
            tl.store(SELF_ONLY + q_row * H + h, fallback.to(tl.int8), mask=m_ok)
        tl.store(OUT + q_row[:, None] * stride_om + h * stride_oh + d[None, :], out.to(OUT.dtype.element_ty),
                 mask=m_ok[:, None] & d_ok[None, :])
        tl.store(LSE + q_row * H + h, lse, mask=m_ok)

    @triton.jit
    def _bwd_dq_kernel(
        Q, K, V, DO, DQ, LSE, DELTA, SELF_ONLY, KEY_OK, POS, GRP,
        stride_qm, stride_qh, stride_km, stride_kh, stride_vm, stride_vh, stride_dom, stride_doh,
        stride_gm, stride_gh, H, w, hops, scale, D,
        HAS_POS: tl.constexpr, HAS_GRP: tl.constexpr, EXCLUDE_SELF: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        ACC: tl.constexpr, PRECISION: tl.constexpr,
    ):
        h, q_row, self_row, m_ok, start, end = _query_tile(w, hops, BLOCK_M)
        d, d_ok = _channels(D, BLOCK_D)
        q, do, lse, delta, self_only = _query_rows(Q, DO, LSE, DELTA, SELF_ONLY, q_row, m_ok, h, H, stride_qm,
                                                   stride_qh, stride_dom, stride_doh, d, d_ok, EXCLUDE_SELF)
        dq = tl.zeros([BLOCK_M, BLOCK_D], ACC)
        for kb in range(start, end, BLOCK_N):
            n, n_ok, k, v = _key_tile(K, V, kb, end, h, stride_km, stride_kh, stride_vm, stride_vh, d, d_ok, BLOCK_N)
            allowed = _allowed(n, n_ok, self_row, m_ok, KEY_OK, POS, GRP, self_only,
                               HAS_POS, HAS_GRP, EXCLUDE_SELF, True)
            p = tl.exp(tl.where(allowed, _scores(q, k, scale, ACC, PRECISION), float("-inf")) - lse[:, None])
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION, out_dtype=ACC)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION, out_dtype=ACC)
        dq = (dq * scale).to(ACC)
        tl.store(DQ + q_row[:, None] * stride_gm + h * stride_gh + d[None, :], dq.to(DQ.dtype.element_ty),
                 mask=m_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _bwd_dkdv_kernel(
        Q, K, V, DO, DK, DV, LSE, DELTA, SELF_ONLY, KEY_OK, POS, GRP,
        stride_qm, stride_qh, stride_km, stride_kh, stride_vm, stride_vh, stride_dom, stride_doh,
        stride_gm, stride_gh,
        H, w, hops, num_windows, num_rows, scale, D,
        HAS_POS: tl.constexpr, HAS_GRP: tl.constexpr, EXCLUDE_SELF: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        ACC: tl.constexpr, PRECISION: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        h = tl.program_id(1)
        first = pid_n * BLOCK_N
        n = first + tl.arange(0, BLOCK_N)
        n_ok = n < num_rows
        d, d_ok = _channels(D, BLOCK_D)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = _rows(K, n, n_ok, h, stride_km, stride_kh, d, d_ok)
        v = _rows(V, n, n_ok, h, stride_vm, stride_vh, d, d_ok)
        dk = tl.zeros([BLOCK_N, BLOCK_D], ACC)
        dv = tl.zeros([BLOCK_N, BLOCK_D], ACC)
        last = tl.minimum(first + BLOCK_N, num_rows) - 1
        # Window i holds key rows [i w, i w + hops w): the windows touching this tile.
        win_lo = tl.maximum(first // w - hops + 1, 0)
        win_hi = tl.minimum(last // w, num_windows - 1)
        for win in range(win_lo, win_hi + 1):
            n_in = n_ok & (n >= win * w) & (n < win * w + hops * w)
            for t in range(0, w, BLOCK_M):
                local = t + tl.arange(0, BLOCK_M)
                m_ok = local < w
                q_row = win * w + local
                self_row = q_row + (hops - 1) * w
                q, do, lse, delta, self_only = _query_rows(Q, DO, LSE, DELTA, SELF_ONLY, q_row, m_ok, h, H, stride_qm,
                                                           stride_qh, stride_dom, stride_doh, d, d_ok, EXCLUDE_SELF)
                allowed = _allowed(n, n_in, self_row, m_ok, KEY_OK, POS, GRP, self_only,
                                   HAS_POS, HAS_GRP, EXCLUDE_SELF, True)
                p = tl.exp(tl.where(allowed, _scores(q, k, scale, ACC, PRECISION), float("-inf")) - lse[:, None])
                dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION, out_dtype=ACC)
                dp = tl.dot(do, tl.trans(v), input_precision=PRECISION, out_dtype=ACC)
                ds = p * (dp - delta[:, None])
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION, out_dtype=ACC)
        dk = (dk * scale).to(ACC)
        g_rows = n[:, None] * stride_gm + h * stride_gh + d[None, :]  # dK and dV share a contiguous layout
        tl.store(DK + g_rows, dk.to(DK.dtype.element_ty), mask=kv_mask)
        tl.store(DV + g_rows, dv.to(DV.dtype.element_ty), mask=kv_mask)


def _config(q: torch.Tensor) -> dict:
    D = q.shape[-1]
    block_d = max(16, triton.next_power_of_2(D))
    if interpreting():  # small tiles keep the interpreter's numpy work small
        block_m = block_n = 16
    else:
        block_m, block_n = (64, 64) if block_d <= 64 else (64, 32)
    if q.dtype == torch.float64:
        acc, precision = tl.float64, "ieee"
    else:
        acc = tl.float32
        precision = "ieee" if q.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32 else "tf32"
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": block_d, "ACC": acc, "PRECISION": precision}


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _rebuildable(given: torch.Tensor, used: torch.Tensor, recipe: Callable[[], torch.Tensor] | None
                 ) -> tuple[Callable[[], torch.Tensor], tuple, tuple, int] | None:
    """How the backward rebuilds ``used`` (the kernel's view of the input ``given``) from ``recipe``, or None
    (no recipe, or ``used`` is a copy). Only the geometry: keeping ``given`` would keep its memory."""
    if recipe is None or used.untyped_storage().data_ptr() != given.untyped_storage().data_ptr():
        return None
    return recipe, tuple(used.shape), used.stride(), used.storage_offset()


class _FusedChunkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, key_ok, pos, grp, w, hops, scale, exclude_self, recipes):
        given = (q, k, v)
        q, k, v = _as_rows(q), _as_rows(k), _as_rows(v)
        rows_q, H, D = q.shape
        num_windows = rows_q // w
        cfg = _config(q)
        out = q.new_empty(q.shape)
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        lse = torch.empty(rows_q, H, dtype=lse_dtype, device=q.device)
        self_only = torch.zeros(rows_q, H, dtype=torch.int8, device=q.device) if exclude_self else lse
        pos_t = pos if pos is not None else key_ok
        grp_t = grp if grp is not None else key_ok
        flags = {"HAS_POS": pos is not None, "HAS_GRP": grp is not None, "EXCLUDE_SELF": exclude_self}
        grid = (num_windows * triton.cdiv(w, cfg["BLOCK_M"]), H)
        _fwd_kernel[grid](
            q, k, v, out, lse, self_only, key_ok, pos_t, grp_t,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1),
            H, w, hops, scale, D, **flags, **cfg,
        )
        # An input with a recipe is not kept: the backward rebuilds it (the same values, so the same gradients)
        ctx.rebuild = [_rebuildable(g, u, r) for g, u, r in zip(given, (q, k, v), recipes, strict=True)]
        kept = [None if rebuild is not None else t for t, rebuild in zip((q, k, v), ctx.rebuild, strict=True)]
        ctx.save_for_backward(*kept, out, lse, self_only, key_ok, pos_t, grp_t)
        ctx.meta = (w, hops, scale, flags)
        return out, lse

    @staticmethod
    def backward(ctx, g_out, g_lse):
        q, k, v, out, lse, self_only, key_ok, pos_t, grp_t = ctx.saved_tensors
        q, k, v = (t if rebuild is None else rebuild[0]().as_strided(*rebuild[1:])
                   for t, rebuild in zip((q, k, v), ctx.rebuild, strict=True))
        w, hops, scale, flags = ctx.meta
        rows_q, H, D = q.shape
        num_windows = rows_q // w
        if g_out is None:
            g_out = torch.zeros_like(out)
        g_out = g_out.contiguous()
        # D_i = sum_d dO_id O_id; the log-sum-exp's own gradient enters as dS += P * g_lse.
        delta = (g_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
        if g_lse is not None:
            delta = delta - g_lse.to(lse.dtype)
        delta = delta.contiguous()
        # Queries with no allowed key (lse = -inf) get P = exp(-inf) = 0 everywhere instead of NaN.
        lse = lse.masked_fill(torch.isneginf(lse), float("inf"))
        cfg = _config(q)
        # Gradients are fresh contiguous tensors (the inputs may be strided views), with their own strides.
        dq = q.new_empty(q.shape)
        dk = k.new_empty(k.shape)
        dv = v.new_empty(v.shape)
        common = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                  g_out.stride(0), g_out.stride(1))
        _bwd_dq_kernel[(num_windows * triton.cdiv(w, cfg["BLOCK_M"]), H)](
            q, k, v, g_out, dq, lse, delta, self_only, key_ok, pos_t, grp_t, *common, dq.stride(0), dq.stride(1),
            H, w, hops, scale, D, **flags, **cfg,
        )
        num_rows = k.shape[0]
        _bwd_dkdv_kernel[(triton.cdiv(num_rows, cfg["BLOCK_N"]), H)](
            q, k, v, g_out, dk, dv, lse, delta, self_only, key_ok, pos_t, grp_t, *common,
            dk.stride(0), dk.stride(1), H, w, hops, num_windows, num_rows, scale, D, **flags, **cfg,
        )
        return dq, dk, dv, None, None, None, None, None, None, None, None


def fused_chunk_attention(
    q_rows: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    key_ok: torch.Tensor,
    chunk_size: int,
    hops: int,
    *,
    positions: torch.Tensor | None = None,
    groups: torch.Tensor | None = None,
    exclude_self: bool = False,
    scale: float,
    recipes: tuple[Callable[[], torch.Tensor] | None, ...] = (None, None, None),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every chunk of query rows to its window of ``hops`` chunks of key rows.

    Args:
        q_rows: (W * w, H, D) queries, window i's queries in rows [i w, (i + 1) w).
        k_rows, v_rows: ((W + hops - 1) * w, H, D); window i's keys are rows [i w, i w + hops w), and query
            row r is the same token as key row r + (hops - 1) w.
        key_ok: (R,) bool or int8 -- the key row may be attended to (holds a token, not padding).
        chunk_size: w. hops: chunks per key window.
        positions: optional (R,) int -- mask keys whose position is after the query's (causal).
        groups: optional (R,) int -- keys must share the query's group (strict-causal layout).
        exclude_self: a query sees its own key only when it has no other allowed key.
        scale: multiplies q.k (pass 1.0 when the scale is already folded into q).
        recipes: for q_rows, k_rows, v_rows, None or a function that recomputes the tensor (any view of memory laid
            out as the argument's is): the backward calls it instead of keeping the argument from the forward
            (rows gathered per hashing round are cheap to gather again). The gradients are the same.

    Returns:
        out (W * w, H, D) in the query rows' order and lse (W * w, H) in float32 (float64 for float64
        inputs); rows with no allowed key give 0 and -inf. Differentiable in q, k, v (and through lse).
    """
    if triton is None:
        raise RuntimeError("fused_chunk_attention needs Triton (pip install triton)")
    key_ok = key_ok.to(torch.int8).contiguous()
    positions = None if positions is None else positions.to(torch.int32).contiguous()
    groups = None if groups is None else groups.to(torch.int32).contiguous()
    if len(recipes) != 3:
        raise ValueError(f"recipes must hold one entry (None or a function) for each of q_rows, k_rows, v_rows; "
                         f"got {len(recipes)}")
    return _FusedChunkAttention.apply(q_rows, k_rows, v_rows, key_ok, positions, groups, chunk_size, hops,
                                      float(scale), bool(exclude_self), tuple(recipes))
