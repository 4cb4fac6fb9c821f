"""``"routing"``: Routing Transformer attention (Roy et al. 2021), the papers' k-means baseline.

For x (B, N, dim):

1. Shared QK and values (the Routing Transformer shares queries and keys so that routing is symmetric):
   qk = x W^QK, v = x W^V, (B, H, N, D); unit vectors u = qk / ||qk||.
2. Per head, k centroids mu (unit vectors, a buffer, not a parameter). Each token goes to its nearest
   centroid, id = argmax_c u . mu_c (**argmax-and-sort**, not the balanced top-w variant: every token is in
   exactly one cluster, and the cluster ids of a token depend on that token alone, which keeps ``causal``
   strict).
3. Attention as in ``"lsh"`` with these ids as the single round (:func:`clusterformer.ops.bucketed_attention`):
   sort by cluster, chunks of ``chunk_size`` attending to themselves and ``look_back`` previous chunks,
   self only when nothing else; output projection.
4. Centroids follow the tokens by an exponential moving average of their members (mini-batch spherical
   k-means, :func:`clusterformer.clustering.ema_from_sums`) -- never by gradient. The ids, the commitment
   distances of step 5 and the members' sums come from one pass over the tokens
   (:func:`clusterformer.ops.spherical.spherical_assignment`, a C++ kernel on the CPU). The update from one
   training forward is applied at the start of the next (so a reversible recompute sees the same centroids),
   or earlier by :func:`clusterformer.attention.apply_pending_updates` (the training loop calls it after each
   optimiser step); a pending update is part of ``state_dict`` (extra state). In a distributed run the
   per-centroid sums and counts are summed over ranks first, so every rank applies the global batch's update.
5. Commitment loss, published as ``"commitment"`` (:mod:`clusterformer.attention.aux`): the mean over real
   tokens and heads of ||u - mu_id||^2; its gradient pulls the projections towards their centroids. Weight it in
   :func:`clusterformer.attention.total_loss` (the Routing Transformer uses a small weight, e.g. 1e-4).

The layer's output projection follows. Groups published: the cluster ids, (B, H, N).

Cost: O(N k D) routing + O(N (look_back + 1) chunk_size D) attention.
Masks: key padding; ``causal=True`` strict (per-cluster chunking by rank among earlier tokens, chunks of
``causal_chunk_size``). Cached decoding (``layer.prefill`` / ``layer.step``): a ring of each cluster's last
``(look_back + 1) * causal_chunk_size`` keys per head.
Randomness: centroids initialised from the layer's generator (``seed``); forward is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .._checks import check_float, check_int
from ..clustering.kmeans import ema_from_sums
from ..distributed import all_reduce_sum
from ..masks import NO_MASK, AttentionMask
from ..ops.bucketed import bucketed_attention, bucketed_cache, bucketed_step
from ..ops.decode import GroupRingCache
from ..ops.spherical import SphericalAssignment, spherical_assignment
from .aux import publish_groups, publish_losses
from .base import BucketOptions, InnerAttention
from .registry import register


@dataclass(frozen=True)
class RoutingOptions(BucketOptions):
    """Options of ``"routing"`` (besides ``dropout``, ``bias``, ``seed`` -- which seeds the centroids --,
    ``chunk_size`` -- the Routing Transformer's window, alias ``window_size`` -- and ``look_back``:
    :class:`~clusterformer.attention.BucketOptions`).

    Attributes:
        num_clusters: centroids per head.
        decay: EMA decay of the centroids (0 = replace by the batch means; closer to 1 = slower).
    """

    ALIASES: ClassVar[dict[str, str]] = {"window_size": "chunk_size"}

    num_clusters: int = 32
    decay: float = 0.999

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("num_clusters", self.num_clusters, minimum=1)
        check_float("decay", self.decay, minimum=0.0, maximum=1.0, exclusive_maximum=True)


def follow_tokens(module: InnerAttention, assignment: SphericalAssignment, real: torch.Tensor, decay: float
                  ) -> torch.Tensor | None:
    """Steps 4-5 of the module docstring, shared with ``"cluster-select"``, from the keys' assignment
    (:func:`clusterformer.ops.spherical.spherical_assignment`): publish the commitment loss (the mean over real
    tokens and heads of ||u - mu_id||^2) and, in a training forward, keep the EMA update of ``module.centroids``
    (H, k, D) pending, its sums and counts summed over DDP ranks. real (B, N) bool, the tokens the assignment
    counted. Returns those counts (H, k) when the update is kept, else None."""
    weight = real[:, None, :].to(assignment.gap.dtype)  # (B, 1, N): every head's tokens
    heads = assignment.gap.shape[1]
    publish_losses({"commitment": (assignment.gap * weight).sum() / (weight.sum() * heads).clamp(min=1)})
    if not module.updates_state():
        return None
    sums, counts = all_reduce_sum(assignment.sums), all_reduce_sum(assignment.counts)
    module.pending["centroids"] = ema_from_sums(module.centroids, sums, counts, decay=decay)
    return counts


@register("routing", RoutingOptions, "Routing Transformer: EMA k-means on shared QK, sorted chunks; O(N k + N w)")
class RoutingAttention(InnerAttention):
    shared_qk = True
    decodes = True
    aux_losses = ("commitment",)

    def __init__(self, dim: int, heads: int, options: RoutingOptions) -> None:
        super().__init__(dim, heads, options)
        init = torch.randn(heads, options.num_clusters, self.head_dim, generator=self.generator)
        self.register_buffer("centroids", F.normalize(init, dim=-1))  # (H, k, D) unit vectors

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask = NO_MASK
                ) -> torch.Tensor:
        if self.updates_state():
            self.apply_pending_updates()
        B, _, N, _ = q.shape  # q is k (shared QK)
        real = mask.real(B, N, q.device)
        assignment = spherical_assignment(q, self.centroids, real=real)
        ids = assignment.ids  # (B, H, N)
        publish_groups(self, ids)
        follow_tokens(self, assignment, real, self.options.decay)
        return bucketed_attention(
            q, v, ids.unsqueeze(2), min(self.options.chunk_for(mask.causal), max(N, 1)),
            num_buckets=self.options.num_clusters, look_back=self.options.look_back, mask=mask,
            dropout_p=self.dropout_p,
        )

    def _route(self, qk: torch.Tensor) -> torch.Tensor:
        """Shared queries/keys (B, H, N, D) -> nearest centroid (B, H, N), as the training forward finds it."""
        with torch.no_grad():
            return spherical_assignment(qk, self.centroids).ids

    # cached decoding: a ring per cluster and head (clusterformer.ops.bucketed.bucketed_cache)
    def cache_from(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> GroupRingCache:
        ids = self._route(q).unsqueeze(2)
        return bucketed_cache(q, v, ids, self.options.causal_chunk_size, num_buckets=self.options.num_clusters,
                              look_back=self.options.look_back, mask=mask)

    def step(self, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, cache: GroupRingCache
             ) -> tuple[torch.Tensor, GroupRingCache]:
        ids = self._route(q_t.unsqueeze(2))  # (B, H, 1): one round
        return bucketed_step(q_t, v_t, ids, cache), cache
