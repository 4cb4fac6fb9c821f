"""How a ``"cluster-select"`` query ranks groups and members: the summaries' logits
(:func:`summary_selection`), Quest's upper bound on groups (:func:`bound_selection`), the own group first
(:func:`with_own_group`), and a selected group's best-scoring members (:func:`scored_members`). Each an argmax,
without gradient. Ties between groups go to the lower id (:func:`top_groups`), in every kernel and in the cached
decoder (:mod:`clusterformer.ops.decode`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..masks import AttentionMask
from .listed_attention import RangeSummaries, bound_groups, extension_available, summary_logits, top_members
from .selected_band import ChunkBand, chunk_band
from .selected_layout import ClusterLayout, cluster_runs, cluster_summaries, log_count, outside_window, summary_counts

__all__ = ["bound_logits", "bound_selection", "group_extremes", "scored_members", "summary_selection", "top_groups",
           "upper_bounds", "with_own_group"]


def scored_members(q: torch.Tensor, k: torch.Tensor, layout: ClusterLayout, selected: torch.Tensor, *,
                   cluster_keys: int, causal: bool) -> torch.Tensor:
    """``members="score"``: the keys each query reads alone from each selected cluster -- its ``cluster_keys``
    members outside the query's window of largest q . k (causal: at positions <= t - window), in place of the most
    recent ones. (B, H, N, S * cluster_keys) int64 positions, per cluster in position order, -1 after them where
    the cluster has fewer such members (equal scores at the cut: the later position is kept). No gradient (an
    argmax, as the selection is).

    The fused C++ pass where it runs (:func:`clusterformer.ops.listed_attention.top_members`: O(N S n D) for
    clusters of n members), else tensor operations over the candidates padded to the largest run, (B, H, N, S, 2 n)
    scores -- the definition, and the path on CUDA."""
    with torch.no_grad():
        runs, per_group = cluster_runs(layout, selected, cluster_keys=None, causal=causal), 1 if causal else 2
        if q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64) and extension_available():
            return top_members(q, k, runs, per_group=per_group, keep=cluster_keys)
        B, H, N, S = selected.shape
        candidates = runs.as_index().view(B, H, N, S, -1)  # (B, H, N, S, per_group * capacity), -1: none
        n = candidates.shape[-1]
        flat = candidates.clamp(min=0).view(B, H, N * S * n, 1).expand(-1, -1, -1, k.shape[-1])
        keys = k.detach().to(q.dtype).gather(2, flat).view(B, H, N, S, n, k.shape[-1])
        scores = torch.einsum("bhnd,bhnsmd->bhnsm", q.detach(), keys).masked_fill(candidates < 0, float("-inf"))
        # best first, equal scores the later position first: a stable sort by position, then by score
        by_position = candidates.sort(dim=-1, descending=True, stable=True).indices
        ranked = by_position.gather(-1, scores.gather(-1, by_position).sort(dim=-1, descending=True, stable=True)
                                    .indices)
        best = candidates.gather(-1, ranked)[..., :cluster_keys]
        if best.shape[-1] < cluster_keys:
            best = F.pad(best, (0, cluster_keys - best.shape[-1]), value=-1)
        # in position order, none (-1) last
        best = torch.where(best < 0, N, best).sort(dim=-1).values
        return torch.where(best == N, -1, best).reshape(B, H, N, S * cluster_keys)


def top_groups(logits: torch.Tensor, select: int, by_cluster: int = 0) -> torch.Tensor:
    """The ``select`` groups (..., S) of largest summary logits (..., G). With ``by_cluster`` = R > 0 (groups
    c R + r: cluster c cut into R spans, the option ``position_splits``), ``select`` clusters by the log-sum-exp
    of their groups' logits (log of the weight the whole cluster's summaries would draw), then each selected
    cluster's one group of largest logit: distinct groups of distinct clusters. Best first; equal logits go to the
    lower id (a stable sort: ``topk`` leaves the order of ties unspecified, and groups without members tie at -inf,
    so the rule is part of the definition -- the fused :func:`clusterformer.ops.listed_attention.bound_groups` and
    the cached decoder keep it too)."""
    if not by_cluster:
        return _largest(logits, select)
    spans = logits.unflatten(-1, (-1, by_cluster))  # (..., C, R)
    clusters = _largest(spans.logsumexp(-1), select)  # (..., S)
    best = spans.argmax(-1).gather(-1, clusters)  # each selected cluster's best span (the first of equal ones)
    return clusters * by_cluster + best


def _largest(x: torch.Tensor, select: int) -> torch.Tensor:
    """The indices of the ``select`` largest entries along the last axis, largest first, equal ones in index order."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :select]


def with_own_group(selected: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """The selection ``selected`` (..., S), best first, with each query's own group ``own`` (...) read first:
    own, then the S - 1 best others (own moves to the front where it was selected; otherwise the last is dropped).
    Distinct groups stay distinct."""
    S = selected.shape[-1]
    candidates = torch.cat([own.unsqueeze(-1), selected], -1)  # (..., S + 1)
    repeat = F.pad(selected == own.unsqueeze(-1), (1, 0))  # own's second place, if selected
    order = torch.sort(repeat.to(torch.int32), dim=-1, stable=True).indices
    return candidates.gather(-1, order[..., :S])


def summary_selection(q: torch.Tensor, k: torch.Tensor, key_ids: torch.Tensor, layout: ClusterLayout, *,
                      select: int, window: int, mask: AttentionMask, kernel: str, band: ChunkBand | None = None,
                      by_cluster: int = 0, groups: int | None = None) -> torch.Tensor:
    """The ``select`` clusters (B, H, N, S), among the first ``groups`` (None: all), whose summary of every member
    outside the window scores highest for each query: q . mean / sqrt(D) + log n, the logit the summary would have
    in the softmax (``by_cluster``: the groups' clusters first, :func:`top_groups`). No gradient (an argmax);
    clusters without such members rank last. ``kernel`` (one of :func:`resolve_kernel`'s answers):
    "dense-mask" from the (N, N) scores by two matmuls, "banded" from chunk bands and per-chunk prefix sums (``band``:
    the layer's :func:`chunk_band` of the same q / sqrt(D) and k, built with summaries, whose dots the attention
    reads too; otherwise one is built here), "fused" from one prefix sum of the keys in sorted order and a C++ pass
    (:func:`clusterformer.ops.listed_attention.summary_logits`), "gather" from :func:`cluster_summaries`.
    ``mask``: the call's mask, its causal order (the window (t - window, t]) and padding (B, N) or None."""
    causal = mask.causal
    with torch.no_grad():
        q, k = q.detach() * q.shape[-1] ** -0.5, k.detach()
        if kernel in ("dense-mask", "banded"):  # every member outside the window
            n = summary_counts(layout, None, cluster_keys=0, causal=causal).to(q.dtype)
        if kernel == "dense-mask":
            C = layout.total.shape[-1]
            members = F.one_hot(key_ids, C + 1)[..., :C].to(q.dtype)  # (B, H, N, C); padding in none
            outside = outside_window(key_ids.shape[-1], window, causal, q.device).to(q.dtype)
            logits = ((q @ k.transpose(-1, -2)) * outside) @ members / n.clamp(min=1) + log_count(n)
        elif kernel == "banded":
            if band is None or band.summary_dots is None:
                band = chunk_band(q, k, None, key_ids, mask, num_clusters=layout.total.shape[-1], window=window,
                                  summaries=True)
            logits = band.summary_dots / n.clamp(min=1) + log_count(n)
        elif kernel == "fused":  # the fused kernel's summaries of every member outside the window, logits alone
            prefix = layout.cluster_prefix(k)
            logits = summary_logits(q, RangeSummaries(prefix, prefix, layout.prefix_start, layout.total,
                                                      layout.below, layout.beyond), scale=1.0)
        else:
            keys, _, log_n = cluster_summaries(k, k, layout, None, cluster_keys=0, causal=causal)
            logits = torch.einsum("bhnd,bhncd->bhnc", q, keys) + log_n
    return top_groups(logits[..., :groups], select, by_cluster)


def group_extremes(k: torch.Tensor, groups: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel-wise max and min of the keys k (B, H, N, D) per group, (B, H, G, D) each, -inf and +inf where a
    group has no member; ``groups`` (B, H, N) in [0, num_groups] (num_groups: in none)."""
    D = k.shape[-1]
    signed = _signed_extremes(k, groups, num_groups)
    return signed[..., :D], -signed[..., D:]


def _signed_extremes(k: torch.Tensor, slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Per slot, the channel-wise max of k (B, H, N, D) and of -k (= -min k), (B, H, num_slots, 2 D), by one
    in-place scatter of [k, -k]; -inf where a slot has no member. ``slots`` (B, H, N) in [0, num_slots]
    (num_slots: in none)."""
    return _scattered_extremes(k, slots, num_slots + 1)[:, :, :num_slots]


def _scattered_extremes(k: torch.Tensor, slots: torch.Tensor, size: int) -> torch.Tensor:
    """The max of [k, -k] per slot, slots (B, H, N) in [0, size): one fill and one in-place scatter into a
    contiguous (B, H, size, 2 D) buffer, -inf in a slot without members."""
    B, H, N, D = k.shape
    signed = torch.cat([k, -k], dim=-1)
    index = slots.unsqueeze(-1).expand(B, H, N, 2 * D)
    return signed.new_full((B, H, size, 2 * D), float("-inf")).scatter_reduce_(2, index, signed, "amax")


def _bounds_by_state(q: torch.Tensor, states: torch.Tensor, *, pad: int, block: int) -> torch.Tensor:
    """Query t (of q (B, H, N, D)) against the signed extremes (max k, max -k: :func:`_run_extremes`) of its
    run's state: ``states`` (B, H, runs, G, 2 D), one per run of ``block`` queries, where query t sits at t + ``pad``
    in run floor((t + pad) / block) (:func:`_state_runs`); consumed (masked in place). q+ . hi + q- . lo =
    [q+, -q-] . [hi, -lo], (B, H, N, G), -inf where the state holds no member: one (block, 2 D) x (2 D, G) product
    per run."""
    B, H, N, D = q.shape
    runs = states.shape[2]
    signed_q = torch.cat([q.clamp(min=0), (-q).clamp(min=0)], dim=-1)
    padded = F.pad(signed_q, (0, 0, pad, runs * block - N - pad)).view(B, H, runs, block, 2 * D)
    empty = states[..., :1] == float("-inf")  # (B, H, runs, G, 1): any key makes every channel finite
    bound = padded @ states.masked_fill_(empty, 0).transpose(-1, -2)  # (B, H, runs, block, G)
    return bound.masked_fill_(empty.transpose(-1, -2), float("-inf")).flatten(2, 3)[:, :, pad:pad + N]


def _state_runs(N: int, shift: int, block: int) -> tuple[int, int, int]:
    """Queries t = 0 .. N - 1 read the state of block floor((t + shift) / block): padded by ``pad`` = shift mod
    block they form ``runs`` runs of ``block`` queries, run r reading the state of block r + ``first``. Returns
    (pad, first, runs)."""
    pad = shift % block
    return pad, (shift - pad) // block, -(-(N + pad) // block)


def upper_bounds(q: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """Queries q (..., M, D) against groups of channel-wise max hi and min lo (..., G, D): the upper bound
    sum_d max(q_d hi_d, q_d lo_d) = q+ . hi + q- . lo of q . k over each group's keys, (..., M, G); -inf for a group
    without keys (hi = -inf: any key makes every channel finite)."""
    empty = (hi[..., 0] == float("-inf")).unsqueeze(-1)  # (..., G, 1)
    hi, lo = hi.masked_fill(empty, 0), lo.masked_fill(empty, 0)  # an empty group's +-inf, masked below
    bound = q.clamp(min=0) @ hi.transpose(-1, -2) + q.clamp(max=0) @ lo.transpose(-1, -2)
    return bound.masked_fill(empty.transpose(-1, -2), float("-inf"))


def _running_max_(x: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """The running max along dim 2 of x (B, H, S, G, D), in place (``reverse``: from the end, a suffix max): a scan
    of ceil(log2 S) element-wise passes between x and one spare buffer (Hillis and Steele 1986), not a loop over the
    S blocks. On a CPU, one thread, 48 ms at S = 16, G = 128, D = 64, B H = 32, against 183 ms for cummax along a
    contiguous last dim (which also computes indices, and needs the tensor moved there) and 80 ms for the same scan
    by concatenations. Returns the buffer that holds the result (x or the spare)."""
    current, spare = x, torch.empty_like(x)
    shift = 1
    # after the pass with a given shift, entry s holds the max of s - 2 shift + 1 .. s (reverse: s .. s + 2 shift - 1)
    while shift < x.shape[2]:
        if reverse:
            spare[:, :, -shift:] = current[:, :, -shift:]
            torch.maximum(current[:, :, :-shift], current[:, :, shift:], out=spare[:, :, :-shift])
        else:
            spare[:, :, :shift] = current[:, :, :shift]
            torch.maximum(current[:, :, shift:], current[:, :, :-shift], out=spare[:, :, shift:])
        current, spare = spare, current
        shift *= 2
    return current


def _run_extremes(k: torch.Tensor, key_ids: torch.Tensor, *, num_groups: int, block: int, offset: int,
                  length: int) -> torch.Tensor:
    """The signed extremes (max k, max -k) of every block and group, block j at entry j + ``offset`` of a
    (B, H, length, G + 1, 2 D) tensor (group G: padding), -inf where an entry holds no member; the blocks that land
    outside [0, length) go to the padding group of the last entry, which nobody reads. One scatter into the
    layout the queries' runs read, so no shift or gather of the states follows."""
    B, H, N, D = k.shape
    G1 = num_groups + 1
    entry = torch.div(torch.arange(N, device=k.device), block, rounding_mode="floor") + offset
    inside = (entry >= 0) & (entry < length)
    slot = torch.where(inside, entry * G1, (length - 1) * G1)[None, None, :] + torch.where(inside, key_ids, num_groups)
    return _scattered_extremes(k, slot, length * G1).view(B, H, length, G1, 2 * D)


def _prefix_states(k: torch.Tensor, key_ids: torch.Tensor, *, num_groups: int, block: int, first: int, runs: int
                   ) -> torch.Tensor:
    """Run r's state of the prefix, the extremes over blocks < r + ``first`` (``first`` <= 0: a window or its past
    half lies before the query's own block), (B, H, runs, G, 2 D), -inf where there is none: block j scattered at
    entry j + 1 - first, then one running max, so that entry r holds blocks 0 .. r + first - 1."""
    states = _running_max_(_run_extremes(k, key_ids, num_groups=num_groups, block=block, offset=1 - first,
                                         length=runs))
    return states[..., :num_groups, :]


def _suffix_states(k: torch.Tensor, key_ids: torch.Tensor, *, num_groups: int, block: int, first: int, runs: int
                   ) -> torch.Tensor:
    """Run r's state of the suffix, the extremes over blocks >= r + ``first`` (``first`` >= 1: the window's far side
    lies after the query's own block), (B, H, runs, G, 2 D), -inf where there is none: block j scattered at entry
    j - first, then one running max from the end."""
    length = max(runs, -(-k.shape[2] // block) - first)
    states = _running_max_(_run_extremes(k, key_ids, num_groups=num_groups, block=block, offset=-first,
                                         length=length), reverse=True)
    return states[:, :, :runs, :num_groups]


def bound_logits(q: torch.Tensor, k: torch.Tensor, key_ids: torch.Tensor, *, num_groups: int, window: int,
                 causal: bool, block: int) -> torch.Tensor:
    """Per query and group, (B, H, N, G): the upper bound sum_d max(q_d hi_d, q_d lo_d) of q . k over the group's
    members in the whole blocks of ``block`` positions outside the query's window -- causal: positions
    < block floor((t - window + 1) / block), every block at or before t - window; otherwise the larger of the
    bound over the blocks wholly before the window [t - window / 2, t + window / 2) and the bound over those wholly
    after it. -inf where there is no such member. q as given (the caller scales it); ``key_ids`` (B, H, N) in
    [0, num_groups] (``num_groups``: padding, in no group). Members in a block the window cuts are left out: they
    lie within window + block positions of the query. hi and -lo travel as one tensor [hi, -lo], whose running
    extremes are one running max, scattered directly in the order the queries' runs read them (no shift or gather
    of states)."""
    N = q.shape[2]
    extremes = {"num_groups": num_groups, "block": block}
    if causal:  # query t reads the blocks before block floor((t + 1 - window) / block)
        pad, first, runs = _state_runs(N, 1 - window, block)
        return _bounds_by_state(q, _prefix_states(k, key_ids, first=first, runs=runs, **extremes), pad=pad,
                                block=block)
    half = window // 2
    pad, first, runs = _state_runs(N, -half, block)  # the blocks before block floor((t - half) / block)
    before = _bounds_by_state(q, _prefix_states(k, key_ids, first=first, runs=runs, **extremes), pad=pad,
                              block=block)
    # the blocks from block ceil((t + window - half) / block) on
    pad, first, runs = _state_runs(N, window - half + block - 1, block)
    return torch.maximum(before, _bounds_by_state(q, _suffix_states(k, key_ids, first=first, runs=runs, **extremes),
                                                  pad=pad, block=block))


def bound_selection(q: torch.Tensor, k: torch.Tensor, key_ids: torch.Tensor, *, num_groups: int, select: int,
                    window: int, causal: bool, block: int, by_cluster: int = 0, kernel: str = "auto") -> torch.Tensor:
    """The ``select`` groups (B, H, N, S) of largest :func:`bound_logits` for q / sqrt(D) (``by_cluster``:
    :func:`top_groups`'s). No gradient (an argmax); groups without members there rank last. ``kernel="fused"``: the
    bounds and the choice in one C++ pass (:func:`clusterformer.ops.listed_attention.bound_groups`; the bounds alone
    with ``by_cluster``), the same groups up to the rounding of near ties."""
    scale = q.shape[-1] ** -0.5
    if kernel == "fused":  # q scaled inside the kernel (no scaled copy)
        extremes = {"num_groups": num_groups, "window": window, "causal": causal, "block": block, "scale": scale}
        if not by_cluster:
            return bound_groups(q.detach(), k.detach(), key_ids, select=select, **extremes)
        return top_groups(bound_groups(q.detach(), k.detach(), key_ids, **extremes), select, by_cluster)
    scaled = q.detach() * scale
    with torch.no_grad():
        logits = bound_logits(scaled, k.detach(), key_ids, num_groups=num_groups, window=window, causal=causal,
                              block=block)
    return top_groups(logits, select, by_cluster)
