"""Attention of every chunk's queries to its key window in the window buffer (:mod:`clusterformer.ops.layouts`).

Keys and values are buffer rows; a window is ``hops`` consecutive chunks of rows, taken as a strided view
(:class:`_KeyWindows`), never a copy. Masks are built from the predicates of :mod:`clusterformer.masks`
over buffer-row indices -- the key is a real token, causal order, same group (strict per-cluster chunking),
and the shared-QK rule "self only when alone" -- and follow its one rule for a query with no allowed key.
Two ways to attend: SDPA over the views (:func:`windowed_attention`), or explicit scores with each query's
log-sum-exp (:func:`windowed_attention_lse`, for merging hash rounds); both dispatch to the fused Triton kernel
(:mod:`clusterformer.ops.fused_chunked`) where :func:`use_fused_kernel` says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .._checks import check_choice
from ..masks import (
    NO_MASK,
    AttentionMask,
    allow_empty_rows,
    and_masks,
    local_blocks,
    not_mask,
    same_group,
    self_only_when_alone,
)
from .layouts import ChunkLayout
from .recompute import attach_recipe, recipe_of, recompute_saved_all

__all__ = ["KERNELS", "use_fused_kernel", "windowed_attention", "windowed_attention_lse"]


class _KeyWindows(torch.autograd.Function):
    """rows (R, H, D) -> windows (W, H, hops * w, D), window i = rows [i w, i w + hops w), as a view.

    ``unfold`` gives the same view, but its generic backward is several times slower on CPU than adding
    the hops shifted gradient slices in place, which is all the backward is."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, w: int, hops: int, num_windows: int) -> torch.Tensor:
        ctx.meta = (rows.shape, w, hops, num_windows)
        span = num_windows * w + (hops - 1) * w
        return rows[:span].unfold(0, hops * w, w).permute(0, 1, 3, 2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, w, hops, W = ctx.meta
        out = grad.new_zeros(shape)
        H, D = shape[1], shape[2]
        for o in range(hops):  # a constant number of chunk offsets, not a loop over chunks
            out[o * w : o * w + W * w].view(W, w, H, D).add_(grad[:, :, o * w : (o + 1) * w].transpose(1, 2))
        return out, None, None, None


def _window_meta(layout: ChunkLayout, per_row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row metadata (R,) -> query part (W, w, 1) and key windows (W, 1, hops * w)."""
    w, W = layout.chunk_size, layout.num_windows
    q_part = layout.query_rows(per_row).view(W, w, 1)
    k_part = per_row[: W * w + (layout.hops - 1) * w].unfold(0, layout.hops * w, w).unsqueeze(1)
    return q_part, k_part


def windowed_attention(
    q: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    layout: ChunkLayout,
    *,
    mask: AttentionMask | None = None,
    dropout_p: float = 0.0,
    kernel: str = "auto",
    with_recipe: bool = False,
) -> torch.Tensor:
    """Attention of every chunk's queries to its key window.

    Args:
        q: (W, H, w, D) queries (any strides with unit last stride), e.g. a view of the query rows.
        k_rows, v_rows: (R, H, D) keys and values for every buffer row.
        layout: the :class:`ChunkLayout` the rows were gathered with.
        mask: the call's :class:`~clusterformer.masks.AttentionMask` (None: none): its padding (B, N), whose
            sequence b every block b * repeat .. b * repeat + repeat - 1 of the layout reads (one block per head,
            or per head and round), and with ``causal`` no key at a later original position.
        kernel: ``"auto"`` (the fused Triton kernel where :func:`use_fused_kernel` says so, else SDPA over
            key-window views), ``"fused"`` (require the kernel) or ``"sdpa"``.
        with_recipe: mark the output with the recipe that rebuilds it from the attention's own saved output
            (:func:`clusterformer.ops.recompute.attach_recipe`), for a consumer that would otherwise keep the
            reordered copy (neural clustering's output projection).

    Returns:
        (blocks * N, H, D): each token's output, in flat token order.
    """
    W, H, w, D = q.shape
    mask = NO_MASK if mask is None else mask
    if use_fused_kernel(q, dropout_p, kernel):
        return _fused_windowed(q, k_rows, v_rows, layout, mask, False, 1.0 / math.sqrt(D), with_recipe)[0]
    k = _KeyWindows.apply(k_rows, w, layout.hops, W)
    v = _KeyWindows.apply(v_rows, w, layout.hops, W)
    attn_mask, no_key = _window_mask(layout, w, mask, exclude_self=False)
    attended = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)

    def in_token_order() -> torch.Tensor:  # from SDPA's output, which its backward keeps anyway
        out = attended if no_key is None else attended.masked_fill(no_key, 0.0)
        return out.transpose(1, 2).reshape(W * w, H, D).index_select(0, layout.out_rows)

    out = in_token_order()
    return attach_recipe(out, in_token_order) if with_recipe else out


KERNELS = ("auto", "fused", "sdpa")


def use_fused_kernel(q: torch.Tensor, dropout_p: float, kernel: str = "auto") -> bool:
    """Whether windowed attention runs the fused Triton kernel (:mod:`clusterformer.ops.fused_chunked`).

    ``"auto"``: on CUDA tensors of float16/bfloat16/float32 when Triton is installed and there is no
    attention dropout (the kernel does not fuse dropout). ``"fused"``: always, or a ``ValueError`` saying
    why not; on CPU this needs Triton's interpreter (``TRITON_INTERPRET=1``, for tests). ``"sdpa"``: never.
    """
    check_choice("kernel", kernel, KERNELS)
    if kernel == "sdpa":
        return False
    from .fused_chunked import fused_available

    available = fused_available(q)
    if kernel == "auto":  # the interpreter is for tests: "auto" never sends CPU tensors to it
        return available and q.is_cuda and not dropout_p
    if not available:
        raise ValueError(
            "kernel='fused' needs Triton and a CUDA tensor of float16/bfloat16/float32 (or TRITON_INTERPRET=1 "
            f"on CPU); got a {q.dtype} tensor on {q.device}"
        )
    if dropout_p:
        raise ValueError(f"kernel='fused' does not support attention dropout; got dropout_p={dropout_p}")
    return True


def _fused_windowed(
    q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, layout: ChunkLayout, mask: AttentionMask,
    exclude_self: bool, scale: float, with_recipe: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Windowed attention by the fused kernel: (out (blocks * N, H, D), lse (blocks * N, H)) in token order."""
    from .fused_chunked import fused_chunk_attention

    W, H, w, D = q.shape
    # The kernel multiplies in one dtype. Under autocast the mechanisms' own float32 steps (normalised keys,
    # say) meet half-precision projections; SDPA would run in autocast's dtype, so cast to it, else promote.
    if torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
    else:
        dtype = torch.promote_types(torch.promote_types(q.dtype, k_rows.dtype), v_rows.dtype)
    # Inputs that carry a recipe (rows gathered per hashing round, :func:`attach_recipe`) are rebuilt by the
    # kernel's backward instead of kept; the casts are part of the recipe (no-ops when the dtype already matches).
    def cast(t: torch.Tensor, as_query_rows: bool = False) -> Callable[[], torch.Tensor] | None:
        recipe = recipe_of(t)
        if recipe is None:
            return None
        if as_query_rows:  # q reaches the kernel as rows
            return lambda: recipe().to(dtype).transpose(1, 2).reshape(W * w, H, D)
        return lambda: recipe().to(dtype)

    if mask.window is not None:
        raise ValueError("mask: the fused kernel has no local-window predicate; use kernel='sdpa'")
    recipes = (cast(q, as_query_rows=True), cast(k_rows), cast(v_rows))
    q, k_rows, v_rows = q.to(dtype), k_rows.to(dtype), v_rows.to(dtype)
    key_ok, positions = _row_meta(layout, mask)
    out, lse = fused_chunk_attention(
        q.transpose(1, 2).reshape(W * w, H, D), k_rows, v_rows, key_ok, w, layout.hops,
        positions=positions, groups=layout.row_group, exclude_self=exclude_self, scale=scale, recipes=recipes,
    )
    reordered = out.index_select(0, layout.out_rows)
    if with_recipe:  # the kernel's backward keeps ``out``: a consumer of the reordered copy can rebuild it from there
        attach_recipe(reordered, lambda: out.index_select(0, layout.out_rows))
    return reordered, lse.index_select(0, layout.out_rows)


def _row_meta(layout: ChunkLayout, mask: AttentionMask) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per buffer row: may it be attended to (holds a token, not padding), and its position when causal: the
    typed mask's row tables (:meth:`clusterformer.masks.AttentionMask.rows`), which the fused kernel reads. The
    layout's blocks are ``repeat`` consecutive copies of each of the mask's sequences."""
    blocks = layout.out_rows.shape[0] // max(layout.length, 1)
    return mask.rows(layout.rows, layout.length, layout.row_valid, mask.repeats(blocks))


def _needs_mask(layout: ChunkLayout, mask: AttentionMask, local: tuple[int, bool] | None = None) -> bool:
    """Whether any key of any window can be disallowed (besides a shared-QK query's own key)."""
    return bool(mask.causal or mask.padding is not None or mask.window is not None or layout.row_group is not None
                or layout.has_empty_slots or local is not None)


def _window_mask(
    layout: ChunkLayout, w: int, mask: AttentionMask, exclude_self: bool, local: tuple[int, bool] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The SDPA mask of every window, (W, 1, w, hops w) bool (True = attend), and the queries with no
    allowed key, (W, 1, w, 1); (None, None) when every key of every window is allowed.

    The mask is the conjunction of predicates over buffer rows (:mod:`clusterformer.masks`): the typed
    mask's (the key is a real token, and with ``causal`` not after the query), and with a grouped layout
    (strict per-cluster chunking) in the query's group. With ``exclude_self`` a query may attend to its own
    token only when it has no other allowed key (Reformer's shared-QK rule, where q.k_self would dominate). A
    query with no allowed key follows the package's one rule (:func:`clusterformer.masks.allow_empty_rows`).
    Never NaN."""
    if not _needs_mask(layout, mask):
        return None, None
    q_index, k_index = _window_meta(layout, torch.arange(layout.rows.shape[0], device=layout.rows.device))
    predicates = [mask.predicate(*_row_meta(layout, mask))]
    if layout.row_group is not None:
        predicates.append(same_group(layout.row_group))
    if local is not None:  # (block, keep): only the keys in the query's local blocks, or all but them
        block, keep = local
        in_blocks = local_blocks(layout.rows % max(layout.length, 1), block)
        predicates.append(in_blocks if keep else not_mask(in_blocks))
    allowed = and_masks(*predicates)(q_index, k_index).expand(layout.num_windows, w, layout.hops * w)
    if exclude_self:
        tokens = torch.where(layout.row_valid, layout.rows, -1)
        allowed = self_only_when_alone(allowed, tokens[q_index] == tokens[k_index])
    return allow_empty_rows(allowed.unsqueeze(1))


def windowed_attention_lse(
    q: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    layout: ChunkLayout,
    *,
    mask: AttentionMask | None = None,
    exclude_self: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    kernel: str = "auto",
    local: tuple[int, bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`windowed_attention` with explicit scores, also returning each query's log-sum-exp.

    Used where rounds of attention are merged (Reformer: ``o = sum_r softmax_r(lse_r) o_r``) and for the
    shared-QK rule ``exclude_self``. Memory O(N hops w) per head for the scores.

    ``scale``: None applies 1/sqrt(D) to the scores; pass the scale you already folded into ``q`` (it is then
    not applied again; only documentation of what the caller did). ``kernel``: as in
    :func:`windowed_attention`. ``local``: (block, keep) -- with positions cut into blocks of ``block``, allow only
    the keys in the query's block or the one before (``keep=True``), or only the others (``keep=False``)
    (:func:`clusterformer.masks.local_blocks`; the two halves of neural-clustering's ``local_window``). The fused
    kernel has no such predicate: ``local`` runs the explicit-score path (``kernel="fused"`` is refused).

    Memory: ``q``, ``k_rows`` and ``v_rows`` that carry a recipe (:func:`clusterformer.ops.recompute.attach_recipe`)
    are rebuilt in the backward instead of kept (both kernels). On the fused kernel the returned ``out`` carries a
    recipe too: it is a reorder of the kernel's own saved output.

    Returns:
        out (blocks * N, H, D) and lse (blocks * N, H); lse is -inf for a query with no allowed key
        (its output is zero).
    """
    W, H, w, D = q.shape
    mask = NO_MASK if mask is None else mask
    if local is not None:
        if kernel == "fused":
            raise ValueError("kernel='fused' has no local-block predicate; use kernel='auto' or 'sdpa' with local")
        kernel = "sdpa"
    if use_fused_kernel(q, dropout_p, kernel):
        out, lse = _fused_windowed(q, k_rows, v_rows, layout, mask, exclude_self,
                                   1.0 / math.sqrt(D) if scale is None else 1.0, with_recipe=True)
        return out, lse.to(q.dtype)
    k = _KeyWindows.apply(k_rows, w, layout.hops, W)
    v = _KeyWindows.apply(v_rows, w, layout.hops, W)
    # q, k_rows, v_rows with a recipe (attach_recipe) are not kept by the products that read them: their views
    # (the key windows are views of the rows) are rebuilt in the backward. The blocks hold only the products,
    # which do not save their own outputs (see recompute_saved).
    with recompute_saved_all([(q, recipe_of(q)), (k_rows, recipe_of(k_rows))]):
        scores = q @ k.transpose(-1, -2)  # (W, H, w, hops w)
    if scale is None:
        scores = scores * (1.0 / math.sqrt(D))
    if exclude_self and not _needs_mask(layout, mask, local) and layout.hops * w > 1:
        # Every slot holds a token and each chunk appears once per window, so a query's own key sits at
        # column (hops - 1) w + i of its row i: mask that diagonal in place (autograd-tracked; the product's
        # backward does not need its output) instead of building a (W, w, hops w) mask.
        scores.diagonal(offset=(layout.hops - 1) * w, dim1=-2, dim2=-1).fill_(float("-inf"))
        attn_mask = no_key = None
    else:
        attn_mask, no_key = _window_mask(layout, w, mask, exclude_self, local)
    weights, lse = _SoftmaxLSE.apply(scores, attn_mask)
    if dropout_p:
        weights = F.dropout(weights, p=dropout_p)
    with recompute_saved_all([(v_rows, recipe_of(v_rows))]):
        out = weights @ v
    if no_key is not None:
        out = out.masked_fill(no_key, 0.0)
        lse = lse.masked_fill(no_key, float("-inf"))
    out = out.transpose(1, 2).reshape(W * w, H, D).index_select(0, layout.out_rows)
    lse = lse.squeeze(-1).transpose(1, 2).reshape(W * w, H).index_select(0, layout.out_rows)
    return out, lse


class _SoftmaxLSE(torch.autograd.Function):
    """(scores, mask) -> (softmax over allowed keys, log-sum-exp), keeping only the softmax for the backward.

    d scores = p * (g_p - sum(g_p p) + g_lse): the softmax backward plus the log-sum-exp's (whose gradient is
    p itself); masked scores get p = 0 and hence zero gradient.
    Every row must have an allowed key (callers allow all keys in rows without one and zero them after).
    Saves memory and passes over the (W, H, w, hops w) scores compared with ``masked_fill`` + ``softmax`` +
    ``logsumexp``."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, mask: torch.Tensor | None):
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        # lse = s_j - log p_j for any allowed j; j = the argmax keeps p_j >= 1 / n, so the log is safe. Two
        # reductions instead of a second exp pass over the scores.
        lse = scores.amax(dim=-1, keepdim=True) - torch.log(p.amax(dim=-1, keepdim=True))
        ctx.save_for_backward(p)
        return p, lse

    @staticmethod
    def backward(ctx, g_p: torch.Tensor | None, g_lse: torch.Tensor | None):
        (p,) = ctx.saved_tensors
        grad = torch.zeros_like(p) if g_p is None else torch._softmax_backward_data(g_p, p, -1, p.dtype)
        if g_lse is not None:
            grad = grad.addcmul_(p, g_lse)  # d lse / d s = p
        return grad, None
