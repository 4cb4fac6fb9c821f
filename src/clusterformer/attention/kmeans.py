"""``"kmeans"``: learned k-means attention (Reformer variant, ``reformer-kmeans-attention-tied-reversible.md``
section 3.2).

For x (B, N, dim):

1. Shared QK and values as in ``"lsh"``; unit vectors u = qk / ||qk|| ("L2-normalised query/key vectors").
2. ``num_rounds`` (the paper's m) independently, randomly initialised sets of ``num_clusters`` centroids per
   head (a buffer). In each round every token takes its nearest centroid, argmax_c u . mu_c.
3. Final bucket = the mode of the rounds' predictions. Cluster labels of different rounds are arbitrary, so
   before voting each round's labels are mapped to round 0's: centroid c of round r votes for the round-0
   centroid most similar to it (cosine). Ties in the vote go to the lowest label. (The paper states the
   mode without saying how labels are matched; this is our reading.)
4. Bucket attention as in ``"lsh"`` with the final buckets as a single round: sort, chunks of
   ``chunk_size`` attending to themselves and ``look_back`` previous chunks, self only when nothing else
   (:func:`clusterformer.ops.bucketed_attention`).
5. Learning: "at each training iteration, we compute clusters for each vector and reassign means according
   to the canonical k-means approach" -- each round's centroids move to the mean of their members, smoothed
   by an EMA with ``decay`` (``decay=0`` is the plain k-means reassignment). No gradient reaches the
   centroids; the update from one training forward is applied at the start of the next (or by
   :func:`clusterformer.attention.apply_pending_updates`) and is saved in ``state_dict`` while pending. In a
   distributed run the statistics are summed over ranks, so every rank applies the global batch's update.

The layer's output projection follows. Groups published: the final buckets, (B, H, N).

Cost: O(num_rounds N k D) for the assignments + O(N (look_back + 1) chunk_size D) attention.
Masks: key padding; ``causal=True`` strict (the bucket depends on the token alone; per-bucket chunking in
chunks of ``causal_chunk_size``). Cached decoding (``layer.prefill`` / ``layer.step``): a ring of each bucket's
last ``(look_back + 1) * causal_chunk_size`` keys.
Randomness: centroid initialisation from the layer's generator (``seed``); forward is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .._checks import check_float, check_int
from ..clustering.kmeans import ema_centroid_update
from ..distributed import all_reduce_sum
from ..masks import NO_MASK, AttentionMask
from ..ops.bucketed import bucketed_attention, bucketed_cache, bucketed_step
from ..ops.decode import GroupRingCache
from .aux import publish_groups
from .base import BucketOptions, InnerAttention
from .registry import register


@dataclass(frozen=True)
class KMeansOptions(BucketOptions):
    """Options of ``"kmeans"`` (besides ``dropout``, ``bias``, ``seed`` -- which seeds the centroids --,
    ``chunk_size`` -- the bucket size, alias ``bucket_size`` -- and ``look_back``:
    :class:`~clusterformer.attention.BucketOptions`).

    Attributes:
        num_clusters: centroids per round and head (the paper's n buckets).
        num_rounds: independently initialised centroid sets voted over (the paper's m; alias ``n_rounds``).
        decay: EMA smoothing of the k-means mean update (0 = replace by the batch means).
    """

    ALIASES: ClassVar[dict[str, str]] = {"n_rounds": "num_rounds", "bucket_size": "chunk_size"}

    num_clusters: int = 32
    num_rounds: int = 3
    decay: float = 0.99

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("num_clusters", self.num_clusters, minimum=1)
        check_int("num_rounds", self.num_rounds, minimum=1)
        check_float("decay", self.decay, minimum=0.0, maximum=1.0, exclusive_maximum=True)


def vote_buckets(round_ids: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """The mode across rounds, in round 0's labels.

    round_ids: (m, B, H, N) each round's nearest centroid; centroids: (m, H, k, D) unit vectors.
    Returns (B, H, N) long."""
    m, B, H, _N = round_ids.shape
    k = centroids.shape[-2]
    to_round0 = torch.einsum("rhkd,hjd->rhkj", centroids, centroids[0]).argmax(-1)  # (m, H, k)
    votes = torch.gather(to_round0.unsqueeze(1).expand(m, B, H, k), 3, round_ids)  # (m, B, H, N)
    counts = F.one_hot(votes, k).sum(0)  # (B, H, N, k)
    return counts.argmax(-1)  # first maximum: ties to the lowest label


@register("kmeans", KMeansOptions, "learned k-means buckets of shared QK, mode over m rounds; O(m N k + N w)")
class KMeansAttention(InnerAttention):
    shared_qk = True
    decodes = True

    def __init__(self, dim: int, heads: int, options: KMeansOptions) -> None:
        super().__init__(dim, heads, options)
        init = torch.randn(options.num_rounds, heads, options.num_clusters, self.head_dim, generator=self.generator)
        self.register_buffer("centroids", F.normalize(init, dim=-1))  # (m, H, k, D)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask = NO_MASK
                ) -> torch.Tensor:
        if self.updates_state():
            self.apply_pending_updates()
        B, H, N, D = q.shape  # q is k (shared QK)
        m, n_clusters = self.options.num_rounds, self.options.num_clusters
        unit = F.normalize(q.detach(), dim=-1)
        round_ids, buckets = self._buckets(unit)
        publish_groups(self, buckets)
        if self.updates_state():
            valid = None
            if mask.padding is not None:
                real = mask.real(B, N, unit.device)
                valid = real[None, :, None, :].expand(m, B, H, N).transpose(1, 2).reshape(m * H, B * N)
            points = unit.transpose(0, 1).reshape(1, H, B * N, D).expand(m, H, B * N, D).reshape(m * H, B * N, D)
            updated = ema_centroid_update(
                self.centroids.reshape(m * H, n_clusters, D), points, round_ids.transpose(1, 2).reshape(m * H, B * N),
                decay=self.options.decay, valid=valid, reduce=all_reduce_sum,
            )
            self.pending["centroids"] = updated.view(m, H, n_clusters, D)
        return bucketed_attention(
            q, v, buckets.unsqueeze(2), min(self.options.chunk_for(mask.causal), max(N, 1)), num_buckets=n_clusters,
            look_back=self.options.look_back, mask=mask, dropout_p=self.dropout_p,
        )

    def _buckets(self, unit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Unit vectors (B, H, N, D) -> each round's nearest centroid (m, B, H, N) and the voted bucket (B, H, N)."""
        mu = self.centroids.to(unit.dtype)
        round_ids = torch.einsum("bhnd,rhkd->rbhnk", unit, mu).argmax(-1)
        return round_ids, vote_buckets(round_ids, mu)

    # cached decoding: a ring per bucket and head (clusterformer.ops.bucketed.bucketed_cache)
    def cache_from(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> GroupRingCache:
        _, buckets = self._buckets(F.normalize(q.detach(), dim=-1))
        return bucketed_cache(q, v, buckets.unsqueeze(2), self.options.causal_chunk_size,
                              num_buckets=self.options.num_clusters, look_back=self.options.look_back, mask=mask)

    def step(self, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, cache: GroupRingCache
             ) -> tuple[torch.Tensor, GroupRingCache]:
        _, buckets = self._buckets(F.normalize(q_t.detach(), dim=-1).unsqueeze(2))  # (B, H, 1)
        return bucketed_step(q_t, v_t, buckets, cache), cache
