"""Attention over the keys of *selected* clusters plus a local window (``"cluster-select"``): the kernels.

Which keys and summaries each query reads is :mod:`clusterformer.ops.selected_layout`'s (the window, the selected
clusters' members nearest to it, one summary per cluster of the rest outside the window); how queries rank the
clusters, :mod:`clusterformer.ops.selected_ranking`'s. :func:`selected_cluster_attention` attends them, in one
softmax, by one of four kernels -- the same function, differing in rounding and speed (:func:`resolve_kernel`):

* ``"gather"``: the keys each query reads, M = S * cluster_keys + window, as sparse key lists
  (:mod:`clusterformer.ops.key_lists`: the scores by a sampled product, the output by a CSR product, no (B, H, N,
  M, D) gather), attended with explicit scores: O(N M D) time, O(N M) memory; the summaries gathered per query.
* ``"dense-mask"``: the same set as an (N, N) boolean mask for one SDPA call (the summaries by (N, N) matmuls).
* ``"banded"``: the window from chunk bands (:mod:`clusterformer.ops.selected_band`), the cluster keys listed, the
  summaries from per-chunk sums; no (N, N) or (N, C, D) tensor.
* ``"fused"`` (CPU, :mod:`clusterformer.ops.listed_attention`): the window read in place, the selected clusters'
  keys as runs of consecutive slots of the cluster-sorted order
  (:func:`~clusterformer.ops.selected_layout.cluster_runs`: one run per selected cluster, two without a causal
  mask) and the summaries from each cluster's own prefix sums, in one C++ pass.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F

from ..masks import NO_MASK, AttentionMask, check_mask, masked_sdpa
from .key_lists import KeyLists, key_lists, listed_scores, listed_sum, run_key_lists
from .listed_attention import RangeSummaries, extension_available, extension_error, listed_attention
from .recompute import recompute_saved
from .selected_band import ChunkBand, chunk_band, from_chunks, to_chunks
from .selected_layout import (
    ClusterLayout,
    cluster_layout,
    cluster_runs,
    cluster_summaries,
    listed_positions,
    log_count,
    outside_window,
    summary_counts,
    summary_ranges,
    with_window,
)

__all__ = ["DENSE_MASK_UP_TO", "KERNELS", "fused_usable", "resolve_kernel", "selected_cluster_attention"]


KERNELS = ("auto", "gather", "dense-mask", "banded", "fused")


DENSE_MASK_UP_TO = 256  # "auto" takes the dense mask to this length, the banded kernel beyond


def fused_usable(q: torch.Tensor, *, dropout_p: float = 0.0) -> str | None:
    """Why the ``"fused"`` kernel cannot take these queries, or None when it can: it runs float32/float64 CPU tensors
    without attention dropout, once its C++ kernel is built (:mod:`clusterformer.ops.listed_attention`)."""
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.float64):
        return f"it runs float32/float64 CPU tensors; got {q.dtype} on {q.device}"
    if dropout_p:
        return f"it has no attention dropout; got dropout_p={dropout_p}"
    if not extension_available():
        return f"its C++ kernel is not built here ({extension_error()})"
    return None


def resolve_kernel(kernel: str, length: int, *, q: torch.Tensor | None = None, dropout_p: float = 0.0) -> str:
    """The kernel that ``kernel`` names at this length: "gather", "dense-mask", "banded" or "fused" as given ("fused"
    with ``q``: a ``ValueError`` saying why where it cannot run, :func:`fused_usable`); "auto" takes the fused kernel
    for queries ``q`` it can run, else the dense mask while N <= 256 and the banded kernel beyond. Measured on the CPU
    (one thread, a layer's forward and backward,
    docs/speed-and-memory.md#cluster-select-its-kernels-and-its-training-step): the dense mask took 0.77x the banded
    kernel's time at N = 256 (causal, 64 keys) and 0.97x at N = 256 (non-causal, 144 keys); the banded kernel took 0.47x
    the dense mask's at N = 384, 0.37x at 512, 0.26-0.45x at 1,024, 0.09x at 1,500 and 0.10x at 4,096. The gather kernel
    (every key, window included, listed per query) is the reference form; it is slower than one of them at every length
    measured. The fused kernel reads the same keys and summaries in one C++ pass, and was faster than the three at every
    length and shape measured."""
    if kernel == "fused" and q is not None:
        reason = fused_usable(q, dropout_p=dropout_p)
        if reason:
            raise ValueError(f"cluster-select's kernel='fused' cannot run here: {reason}; use kernel='auto'")
    if kernel != "auto":
        return kernel
    if q is not None and fused_usable(q, dropout_p=dropout_p) is None:
        return "fused"
    return "dense-mask" if length <= DENSE_MASK_UP_TO else "banded"


def _weights(scores: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Softmax over the last axis of scores with -inf for keys not read; a row without keys gets weights 0."""
    empty = (scores == float("-inf")).all(-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return F.dropout(weights, dropout_p) if dropout_p else weights


def selected_cluster_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_ids: torch.Tensor, selected: torch.Tensor, *,
    num_clusters: int, cluster_keys: int, window: int, mask: AttentionMask = NO_MASK,
    dropout_p: float = 0.0, kernel: str = "auto", summaries: bool = False, layout: ClusterLayout | None = None,
    band: ChunkBand | None = None, members: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of each query over its window and its selected clusters' keys (module docstring).

    q, k, v: (B, H, N, D); key_ids (B, H, N) in [0, num_clusters] (num_clusters: padding); selected (B, H, N, S)
    distinct cluster ids. ``kernel``: "gather" (every key each query reads as sparse key lists: O(N M D); the name
    is the historical one), "banded" (the window from chunk bands, the cluster keys listed, the summaries from
    per-chunk prefix sums: O(N (M + C) D), no (N, N) or (N, C, D) tensor), "dense-mask" (the same set as an (N, N)
    boolean mask for one SDPA call: O(N^2 D) but matmul-shaped, faster at a few hundred positions), "fused" (the
    gather kernel's lists and the summaries read by one C++ pass, :mod:`clusterformer.ops.listed_attention`; no
    attention dropout) or
    "auto" (:func:`resolve_kernel`).
    ``summaries``: also one summary per cluster of the members not read alone outside the window, in the same
    softmax (:func:`cluster_summaries`). ``layout``: :func:`cluster_layout` of ``key_ids``, if the caller has it;
    ``band``: with the banded kernel, the layer's :func:`chunk_band` of q / sqrt(D), k and v (with summaries when
    ``summaries``), if the caller has it (the summaries' selection reads the same band).
    ``members``: (B, H, N, M) the key positions each query reads alone from its clusters (-1: none), in place of
    each selected cluster's members nearest to the window (:func:`scored_members`: ``members="score"``); not with
    ``summaries``, whose ranges leave out the nearest members.
    ``mask``: the call's :class:`~clusterformer.masks.AttentionMask` -- causal order (the window (t - window, t] and
    the members at positions <= t - window) and padding (B, N) or None (never read; the caller gives padding the id
    num_clusters, in no cluster).
    Returns (B, H, N, D); a query without any key gets 0."""
    B, H, N, D = q.shape
    causal = check_mask(mask, B, N).causal
    if layout is None:
        layout = cluster_layout(key_ids, num_clusters=num_clusters, window=window, causal=causal)
    scale = D ** -0.5
    kernel = resolve_kernel(kernel, N, q=q, dropout_p=dropout_p)
    if members is not None:
        if summaries:
            raise ValueError("members lists the keys read alone, but the summaries leave out each cluster's members "
                             "nearest to the window: pass summaries=False with members")
        if members.shape[:3] != (B, H, N) or members.dtype != torch.long:
            raise ValueError(f"members must be an int64 tensor (B, H, N, M) with (B, H, N) = {(B, H, N)}; got "
                             f"{members.dtype} {tuple(members.shape)}")
        if kernel == "fused":
            return listed_attention(q, k, v, members, scale, window=window,
                                    window_offset=window - 1 if causal else window // 2, mask=mask)[0]
        positions, allowed = with_window(members.clamp(min=0), members >= 0, window=window, mask=mask)
        return _attend_positions(q, k, v, key_ids, selected, positions, allowed, layout, kernel=kernel,
                                 window=window, cluster_keys=cluster_keys, mask=mask, dropout_p=dropout_p, band=band,
                                 slots=None)
    if kernel == "fused":  # the selected clusters' keys as runs of sorted slots, the window read in place: one C++ pass
        runs = cluster_runs(layout, selected, cluster_keys=cluster_keys, causal=causal)
        ranges = None
        if summaries:  # each cluster's rows in sorted order outside the window, less those read alone
            lower_end, upper_start = summary_ranges(layout, selected, cluster_keys=cluster_keys, causal=causal)
            ranges = RangeSummaries(layout.cluster_prefix(k), layout.cluster_prefix(v), layout.prefix_start,
                                    layout.total, lower_end, upper_start)
        return listed_attention(q, k, v, q.new_empty(B, H, N, 0, dtype=torch.long), scale, window=window,
                                window_offset=window - 1 if causal else window // 2,
                                mask=mask, summaries=ranges, runs=runs)[0]
    positions, allowed, slots = listed_positions(layout, selected, cluster_keys=cluster_keys, window=window,
                                                    mask=mask)
    return _attend_positions(q, k, v, key_ids, selected, positions, allowed, layout, kernel=kernel, window=window,
                             cluster_keys=cluster_keys, mask=mask,
                             dropout_p=dropout_p, band=band, slots=slots, summaries=summaries)


def _attend_positions(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_ids: torch.Tensor,
                      selected: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor, layout: ClusterLayout,
                      *, kernel: str, window: int, cluster_keys: int, mask: AttentionMask, dropout_p: float,
                      band: ChunkBand | None, slots: torch.Tensor | None, summaries: bool = False) -> torch.Tensor:
    """The unfused kernels ("banded", "dense-mask", "gather") over the keys each query reads alone, (B, H, N, M)
    ``positions`` and ``allowed`` with its window last (:func:`with_window`), and with ``summaries`` the summaries
    of the rest (``slots``: the :func:`cluster_slots` of the cluster part, when it is the nearest members)."""
    B, H, N, D = q.shape
    scale = D ** -0.5
    causal = mask.causal
    M = positions.shape[-1]
    if kernel == "banded":  # the cluster part only: the band holds the window
        alone = M - window
        return _banded_attention(q * scale, k, v, key_ids, selected, positions[..., :alone], allowed[..., :alone],
                                 layout, window=window, cluster_keys=cluster_keys, mask=mask, summaries=summaries,
                                 dropout_p=dropout_p, band=band, slots=slots)
    if kernel == "dense-mask":
        # scatter True at every allowed position; the entries that are not allowed go to an extra column, dropped
        index = torch.where(allowed, positions, N)
        read = torch.zeros(B, H, N, N + 1, dtype=torch.bool, device=q.device).scatter_(-1, index, True)[..., :N]
        if summaries:
            n = summary_counts(layout, selected, cluster_keys=cluster_keys, causal=causal).to(q.dtype)
            return _dense_with_summaries(q * scale, k, v, key_ids, read, n, window, causal, dropout_p)
        return masked_sdpa(q, k, v, read, dropout_p=dropout_p)
    lists = key_lists(positions)  # the keys each query reads, as sparse key lists (ops/key_lists.py)
    scores = listed_scores(q * scale, k, lists).masked_fill(~allowed, float("-inf"))
    if not summaries:
        return listed_sum(_weights(scores, dropout_p), v, lists)
    summary_keys, summary_values, log_n = cluster_summaries(k, v, layout, selected, cluster_keys=cluster_keys,
                                                            causal=causal)
    summary_scores = torch.einsum("bhnd,bhncd->bhnc", q * scale, summary_keys) + log_n
    weights = _weights(torch.cat([scores, summary_scores], dim=-1), dropout_p)
    return listed_sum(weights[..., :M], v, lists) + torch.einsum("bhnc,bhncd->bhnd", weights[..., M:], summary_values)


def _banded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_ids: torch.Tensor,
                      selected: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor, layout: ClusterLayout, *,
                      window: int, cluster_keys: int, mask: AttentionMask, summaries: bool, dropout_p: float,
                      band: ChunkBand | None,
                      slots: torch.Tensor | None = None) -> torch.Tensor:
    """The ``"banded"`` kernel (:mod:`clusterformer.ops.selected_band`): the window from the chunk bands, the
    selected clusters' keys as sparse key lists ((B, H, N, M) ``positions`` / ``allowed`` of the keys read alone,
    from :func:`listed_positions` without its window columns), the summaries from the band's ``summary_dots`` less
    the keys read alone -- one softmax over the three, normalised by the row's largest logit without concatenating
    them. q is already scaled; a row without keys gets 0. ``slots``: the :func:`cluster_slots` of ``positions``, if
    the caller has
    them: the keys are then listed as runs of the cluster-sorted keys (:func:`_read_alone`)."""
    B, H, N, _ = q.shape
    C = layout.total.shape[-1]
    causal = mask.causal
    if band is None:
        band = chunk_band(q, k, v, key_ids, mask, num_clusters=C, window=window, summaries=summaries)
    L = band.scores.shape[3]
    # the keys read alone as sparse key lists (ops/key_lists.py): no (B, H, N, M, D) gather
    lists = _read_alone(positions, slots, layout, cluster_keys=cluster_keys, causal=causal)
    alone_raw = listed_scores(q, k, lists)  # (B, H, N, M)
    alone_scores = alone_raw.masked_fill(~allowed, float("-inf"))

    window_scores = from_chunks(band.scores.masked_fill(~band.window, float("-inf")), N)
    m = torch.maximum(window_scores.amax(-1, keepdim=True), alone_scores.amax(-1, keepdim=True))
    if summaries:  # q . (sum of the members outside the window, less those read alone) / n + log n
        n = summary_counts(layout, selected, cluster_keys=cluster_keys, causal=causal).to(q.dtype)
        read_alone = alone_raw.masked_fill(~allowed, 0.0).view(B, H, N, -1, cluster_keys).sum(-1)  # (B, H, N, S)
        dots = band.summary_dots.scatter_add(-1, selected, -read_alone)
        summary_scores = dots / n.clamp(min=1) + log_count(n)
        m = torch.maximum(m, summary_scores.amax(-1, keepdim=True))
    # the shift cancels in the ratio, so it needs no gradient; -inf (a row without keys) becomes 0 to keep exp finite
    m = m.detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    in_window, alone = torch.exp(window_scores - m), torch.exp(alone_scores - m)
    total = in_window.sum(-1, keepdim=True) + alone.sum(-1, keepdim=True)
    if summaries:
        summary = torch.exp(summary_scores - m)
        total = total + summary.sum(-1, keepdim=True)
    total = torch.where(total > 0, total, torch.ones_like(total))  # a row without keys: 0 / 1
    in_window, alone = F.dropout(in_window / total, dropout_p), F.dropout(alone / total, dropout_p)

    band_weights = to_chunks(in_window, L)
    # the products' backward needs the band's copy of the values (width x V): the recipe shifts v into it again
    keep_values = (nullcontext() if band.values_recipe is None
                   else recompute_saved(band.values, band.values_recipe))
    if not summaries:
        with keep_values:
            banded = band_weights @ band.values
        return from_chunks(banded, N) + listed_sum(alone, v, lists)
    # a summary's weight spreads over its members as w / n: those in whole chunks beyond the band through the
    # chunk sums, those in the band through the band weights, less the members read alone
    share = F.dropout(summary / total, dropout_p) / n.clamp(min=1)  # (B, H, N, C)
    share_chunks = to_chunks(share, L)
    with keep_values:  # matrix products only: none keeps its own output (ops/recompute.py)
        out = band_weights @ band.values + share_chunks @ band.beyond_values
        for lo, hi in band.spans:  # the band's members outside the window: only these columns hold any
            members, values = band.members[..., lo:hi, :], band.values[..., lo:hi, :]
            out = out + ((share_chunks @ members.transpose(-1, -2)) * band.outside[:, lo:hi]) @ values
    taken = share.gather(-1, selected).repeat_interleave(cluster_keys, dim=-1) * allowed  # (B, H, N, M)
    return from_chunks(out, N) + listed_sum(alone - taken, v, lists)


def _read_alone(positions: torch.Tensor, slots: torch.Tensor | None, layout: ClusterLayout, *, cluster_keys: int,
                causal: bool) -> KeyLists:
    """The keys each query reads alone (``positions``) as sparse key lists.

    A selected cluster's members read alone are one run of consecutive slots in cluster-sorted order (two runs of
    ``cluster_keys / 2`` without ``causal``: :func:`cluster_slots`), so the lists' transpose is built from the runs
    with no sort of the entries (:func:`run_key_lists`), over the slots padded by ``cluster_keys`` at both ends so
    that no run is clamped. The entries outside [0, N) or in a neighbouring cluster are masked, as the transpose
    asks. Without ``slots``, or with an odd ``cluster_keys`` and no ``causal`` (runs of two lengths), plain
    :func:`key_lists`."""
    runs = None if slots is None else (1 if causal else 2 if cluster_keys % 2 == 0 else 0)
    if not runs:
        return key_lists(positions)
    B, H, N = layout.order.shape
    length, pad = cluster_keys // runs, cluster_keys
    first = slots[..., ::length].reshape(B, H, N, -1) + pad  # (B, H, N, S runs) first slot of each run
    key_slot = torch.empty_like(layout.order).scatter_(-1, layout.order, torch.arange(N, device=positions.device)
                                                       .expand(B, H, N)) + pad
    return run_key_lists(positions, first, length, key_slot, N + 2 * pad)


def _dense_with_summaries(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_ids: torch.Tensor, mask: torch.Tensor,
                          n: torch.Tensor, window: int, causal: bool, dropout_p: float) -> torch.Tensor:
    """The dense-mask kernel with cluster summaries, by matmuls: ``rest`` (B, H, N, N) marks the keys each summary
    holds (outside the window, real, not read alone); with the one-hot clusters O (B, H, N, C), n = rest O
    (given, (B, H, N, C): :func:`summary_counts`) and q . sum = (scores * rest) O. A summary's weight w spreads
    over its members as w / n, so the output is one (N, N) x (N, D) product. One softmax over the keys read alone
    and the summaries, without concatenating them: with m the row's largest logit, weights e^(s - m) / Z. A row
    without keys or summaries gets 0. q is already scaled. (Below N = C * D the (N, N) passes cost less than
    (N, C, D) summaries per query.)"""
    N, C = q.shape[2], n.shape[-1]
    members = F.one_hot(key_ids, C + 1)[..., :C].to(q.dtype)  # padding: in no cluster
    rest = (outside_window(N, window, causal, q.device) & (key_ids < C).unsqueeze(2) & ~mask).to(q.dtype)
    scores = q @ k.transpose(-1, -2)
    summary_scores = (scores * rest) @ members / n.clamp(min=1) + log_count(n)
    alone_scores = scores.masked_fill(~mask, float("-inf"))
    # the shift cancels in the ratio, so it needs no gradient; -inf (a row without keys) becomes 0 to keep exp finite
    m = torch.maximum(alone_scores.amax(-1, keepdim=True), summary_scores.amax(-1, keepdim=True)).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    alone, summary = torch.exp(alone_scores - m), torch.exp(summary_scores - m)
    total = alone.sum(-1, keepdim=True) + summary.sum(-1, keepdim=True)
    total = torch.where(total > 0, total, torch.ones_like(total))  # a row without keys: 0 / 1
    if dropout_p:
        alone, summary = F.dropout(alone / total, dropout_p), F.dropout(summary / total, dropout_p)
        total = torch.ones_like(total)
    spread = (summary / n.clamp(min=1)) @ members.transpose(-1, -2) * rest  # each member's share of its summary
    return (alone + spread) @ v / total
