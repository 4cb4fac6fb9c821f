"""Shared-QK bucket attention: the Reformer family's primitive (``"lsh"``, ``"kmeans"``, ``"routing"``).

Every token has one bucket id per round. Per round, a sequence's real tokens are sorted by bucket (stable,
ties in position order) and cut into chunks of ``chunk_size``; each chunk attends to itself and ``look_back``
previous chunks, the first looking back to the sequence's own last chunk (:func:`clusterformer.ops.sorted_layout`).
Padding is in no chunk, so it cannot change a real token's output. Queries are the shared QK vectors, keys
their unit-length copies (Reformer section 2: ``k_j = q_j / ||q_j||``); a token attends to itself only when it
has no other allowed key. Rounds are merged with their log-sum-exp weights,
``o_i = sum_r exp(lse_r(i) - logsumexp_r lse_r(i)) o_r(i)`` -- a key reached in several rounds counts once per
round (no duplicate correction).

Causal. Under a causal mask each bucket is chunked on its own by the token's rank among earlier tokens of
that bucket (:func:`clusterformer.ops.cluster_causal_layout`) and later keys are masked: when the bucket ids
depend on the token alone, output t depends on tokens 0..t only.

One block per (batch, head, round); one batched attention call for all of them; no loop over buckets,
chunks or tokens.

Cached decoding (:func:`bucketed_cache`, :func:`bucketed_step`): under a causal mask a token's keys are
members of its bucket of rank within ``(look_back + 1) * chunk_size`` of its own, so a ring per bucket
(:class:`clusterformer.ops.decode.GroupRingCache`, one stream per head and round) continues a prefix token by
token at O(rounds (look_back + 1) chunk_size D) per head, whatever the context length.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..masks import NO_MASK, AttentionMask, self_only_when_alone
from .decode import GroupRingCache, attend_allowed
from .layouts import cluster_causal_layout, sorted_layout
from .recompute import attach_recipe, recipe_of, recompute_saved_all
from .windows import windowed_attention_lse

__all__ = ["bucketed_attention", "bucketed_cache", "bucketed_step", "merge_rounds"]


def merge_rounds(out: torch.Tensor, lse: torch.Tensor,
                 out_recipe: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
    """out (..., R, N, D), lse (..., R, N) -> (..., N, D) weighted by softmax over rounds of lse.
    A query with no key in any round (all lse = -inf) gets zeros. ``out_recipe``: rebuilds ``out``'s memory (any
    view of it), so the product's backward recomputes it instead of keeping it."""
    top = lse.amax(dim=-2, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(lse - top)  # exp(-inf) = 0 for rounds without keys
    total = weights.sum(dim=-2, keepdim=True)
    weights = weights / torch.where(total > 0, total, torch.ones_like(total))
    with recompute_saved_all([(out, out_recipe)]):  # the product alone: it does not save its own output
        weighted = weights.unsqueeze(-1) * out
    return weighted.sum(dim=-3)


def bucketed_attention(
    qk: torch.Tensor,
    v: torch.Tensor,
    buckets: torch.Tensor,
    chunk_size: int,
    *,
    num_buckets: int,
    look_back: int = 1,
    mask: AttentionMask | None = None,
    dropout_p: float = 0.0,
    kernel: str = "auto",
) -> torch.Tensor:
    """Shared-QK attention within sorted bucket chunks, merged over rounds.

    Args:
        qk: (B, H, N, D) shared query/key vectors.
        v: (B, H, N, D) values.
        buckets: (B, H, R, N) long bucket ids in [0, num_buckets), R rounds.
        chunk_size: tokens per chunk (>= 1).
        num_buckets: upper bound on the ids (sizes the causal layout).
        look_back: previous chunks each chunk attends to.
        mask: the call's :class:`~clusterformer.masks.AttentionMask` (None: none): its padding (B, N), True =
            padding, never attended to; causal: strictly causal per-bucket chunking plus masking of later keys.
        dropout_p: attention-weight dropout.
        kernel: ``"auto"``, ``"fused"`` or ``"sdpa"``; see :func:`clusterformer.ops.windowed_attention`.

    Returns:
        (B, H, N, D).
    """
    B, H, N, D = qk.shape
    R = buckets.shape[2]
    blocks = B * H * R
    mask = NO_MASK if mask is None else mask
    if mask.padding is not None:  # padding goes to an extra last bucket, out of every real chunk's way
        buckets = buckets.masked_fill(mask.padding[:, None, None, :], num_buckets)
        num_buckets += 1
    ids = buckets.reshape(blocks, N)  # one block per (batch, head, round): H * R blocks per sequence
    if mask.causal:
        layout = cluster_causal_layout(ids, chunk_size, num_buckets, look_back)
    else:  # chunks and their wrap-around are those of each sequence's real tokens
        layout = sorted_layout(ids, chunk_size, look_back, mask=mask)

    # Buffer rows index (batch, head, round, position) blocks; the token's vector is the same in every
    # round, so gather straight from the (batch, head, position) rows.
    source = torch.div(layout.rows, R * N, rounding_mode="floor") * N + layout.rows % N

    def rows_of(t: torch.Tensor) -> torch.Tensor:  # (B, H, N, D) -> (rows, 1, D)
        return t.reshape(B * H * N, 1, D).index_select(0, source)

    def gathered(t: torch.Tensor, recipe: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        # The rows hold every token once per round (R copies of t). The attention's backward gathers them again
        # instead of keeping them from the forward (docs/speed-and-memory.md#memory); by default from t, which then
        # stays alive.
        return attach_recipe(rows_of(t), recipe or (lambda: rows_of(t)))

    scale = 1.0 / math.sqrt(D)
    W, w = layout.num_windows, layout.chunk_size

    def query_windows(rows: torch.Tensor) -> torch.Tensor:
        return layout.query_rows(rows).view(W, w, 1, D).transpose(1, 2)

    # the softmax scale folded into q once per token, not once per round; rebuilt as (gathered qk) * scale, the
    # same products (an elementwise product does not depend on the layout), from qk, which the norm keeps anyway
    q_win = attach_recipe(query_windows(rows_of(qk * scale)),
                          lambda: query_windows(rows_of(qk).mul_(scale)))  # in place: the gather is a fresh tensor
    # normalise once per token, not once per round: F.normalize's own steps, written out so that the rows can be
    # rebuilt as (gathered qk) / (gathered norm) -- the same quotients -- keeping a norm per token, not the keys
    norm = qk.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    k_rows = gathered(qk / norm, lambda: rows_of(qk).div_(norm.reshape(B * H * N, 1, 1).index_select(0, source)))
    out, lse = windowed_attention_lse(
        q_win, k_rows, gathered(v), layout, mask=mask, exclude_self=True,
        dropout_p=dropout_p, scale=scale, kernel=kernel,
    )
    # On the fused kernel ``out`` is a reorder of the kernel's saved output (it carries the recipe): the merge's
    # product rebuilds it rather than keep a second copy of every round's output.
    return merge_rounds(out.view(B, H, R, N, D), lse.view(B, H, R, N), recipe_of(out))


def bucketed_cache(
    qk: torch.Tensor, v: torch.Tensor, buckets: torch.Tensor, chunk_size: int, *, num_buckets: int,
    look_back: int = 1, mask: AttentionMask | None = None,
) -> GroupRingCache:
    """The cache after a right-padded prompt: qk, v (B, H, N, D), buckets (B, H, R, N) as for
    :func:`bucketed_attention` under a causal mask (``mask``: the prompt's, None: no padding)."""
    B, H, R, N = buckets.shape
    D = qk.shape[-1]
    keys = F.normalize(qk, dim=-1).unsqueeze(2).expand(B, H, R, N, D).reshape(B, H * R, N, D)
    values = v.unsqueeze(2).expand(B, H, R, N, D).reshape(B, H * R, N, D)
    return GroupRingCache.from_prompt(buckets.reshape(B, H * R, N), keys, values, mask, num_buckets,
                                      chunk_size, look_back)


def bucketed_step(qk_t: torch.Tensor, v_t: torch.Tensor, buckets: torch.Tensor, cache: GroupRingCache
                  ) -> torch.Tensor:
    """One new token per sequence: qk_t, v_t (B, H, D), buckets (B, H, R) -> (B, H, D), equal to
    :func:`bucketed_attention` under a causal mask at that position; ``cache`` is updated in place."""
    B, H, R = buckets.shape
    D = qk_t.shape[-1]
    scale = 1.0 / math.sqrt(D)
    key = F.normalize(qk_t, dim=-1).unsqueeze(2).expand(B, H, R, D).reshape(B, H * R, D)
    value = v_t.unsqueeze(2).expand(B, H, R, D).reshape(B, H * R, D)
    keys, values, allowed, own = cache.append(buckets.reshape(B, H * R), key, value)
    # the shared-QK rule: a token attends to itself only when it has no other key
    allowed = self_only_when_alone(allowed, torch.arange(cache.slots, device=own.device) == own.unsqueeze(-1))
    query = (qk_t * scale).unsqueeze(2).expand(B, H, R, D).reshape(B, H * R, D)
    out, lse = attend_allowed(query, keys, values, allowed, 1.0)
    return merge_rounds(out.view(B, H, R, 1, D), lse.view(B, H, R, 1)).squeeze(-2)
