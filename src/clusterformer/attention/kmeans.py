"""``"kmeans"``: learned k-means attention (Reformer variant, ``reformer-kmeans-attention-tied-reversible.md``
section 3.2).

For x (B, N, dim):

1. Shared QK and values as in ``"lsh"``; unit vectors u = qk / ||qk|| ("L2-normalised query/key vectors").
2. ``n_rounds`` (the paper's m) independently, randomly initialised sets of ``num_clusters`` centroids per
   head (a buffer). In each round every token takes its nearest centroid, argmax_c u . mu_c.
3. Final bucket = the mode of the rounds' predictions. Cluster labels of different rounds are arbitrary, so
   before voting each round's labels are mapped to round 0's: centroid c of round r votes for the round-0
   centroid most similar to it (cosine). Ties in the vote go to the lowest label. (The paper states the
   mode without saying how labels are matched; this is our reading.)
4. Bucket attention as in ``"lsh"`` with the final buckets as a single round: sort, chunks of
   ``bucket_size`` attending to themselves and ``look_back`` previous chunks, self only when nothing else
   (:func:`clusterformer.ops.bucketed_attention`).
5. Learning: "at each training iteration, we compute clusters for each vector and reassign means according
   to the canonical k-means approach" -- each round's centroids move to the mean of their members, smoothed
   by an EMA with ``decay`` (``decay=0`` is the plain k-means reassignment). No gradient reaches the
   centroids; the update from one training forward is applied at the start of the next (or by
   :func:`clusterformer.attention.apply_pending_updates`) and is saved in ``state_dict`` while pending. In a
   distributed run the statistics are summed over ranks, so every rank applies the global batch's update.

Cost: O(n_rounds N k D) for the assignments + O(N (look_back + 1) bucket_size D) attention.
Masks: key padding; ``causal=True`` strict (the bucket depends on the token alone; per-bucket chunking).
Randomness: centroid initialisation from the layer's generator (``seed``); forward is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .._checks import check_bool, check_float, check_int
from ..clustering.kmeans import ema_centroid_update
from ..distributed import all_reduce_sum
from ..ops.bucketed import bucketed_attention
from .base import AttentionLayer
from .registry import register


@dataclass(frozen=True)
class KMeansOptions:
    """Options of ``"kmeans"``.

    Attributes:
        num_clusters: centroids per round and head (the paper's n buckets).
        n_rounds: independently initialised centroid sets voted over (the paper's m).
        bucket_size: tokens per chunk after sorting by bucket.
        look_back: previous chunks each chunk attends to.
        decay: EMA smoothing of the k-means mean update (0 = replace by the batch means).
        seed: seeds the centroid initialisation.
        dropout: attention-weight dropout probability during training.
        bias: bias in the projections.
    """

    num_clusters: int = 32
    n_rounds: int = 3
    bucket_size: int = 64
    look_back: int = 1
    decay: float = 0.99
    seed: int = 0
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        check_int("num_clusters", self.num_clusters, minimum=1)
        check_int("n_rounds", self.n_rounds, minimum=1)
        check_int("bucket_size", self.bucket_size, minimum=1)
        check_int("look_back", self.look_back, minimum=0)
        check_float("decay", self.decay, minimum=0.0, maximum=1.0, exclusive_maximum=True)
        check_int("seed", self.seed, minimum=0)
        check_float("dropout", self.dropout, minimum=0.0, maximum=1.0, exclusive_maximum=True)
        check_bool("bias", self.bias)


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
class KMeansAttention(AttentionLayer):
    def __init__(self, dim: int, heads: int, options: KMeansOptions | None = None) -> None:
        options = options or KMeansOptions()
        super().__init__(dim, heads, bias=options.bias, shared_qk=True, seed=options.seed)
        self.options = options
        init = torch.randn(options.n_rounds, heads, options.num_clusters, self.head_dim, generator=self.generator)
        self.register_buffer("centroids", F.normalize(init, dim=-1))  # (m, H, k, D)
        self.last_buckets: torch.Tensor | None = None  # (B, H, N)

    def _attend(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        if self.updates_state():
            self.apply_pending_updates()
        qk, _, v = self.project_qkv(x)
        B, H, N, D = qk.shape
        m, k = self.options.n_rounds, self.options.num_clusters
        unit = F.normalize(qk.detach(), dim=-1)
        mu = self.centroids.to(qk.dtype)
        round_ids = torch.einsum("bhnd,rhkd->rbhnk", unit, mu).argmax(-1)  # (m, B, H, N)
        buckets = vote_buckets(round_ids, mu)
        self.last_buckets = buckets
        if self.updates_state():
            valid = None
            if key_padding_mask is not None:
                valid = (~key_padding_mask)[None, :, None, :].expand(m, B, H, N).transpose(1, 2).reshape(m * H, B * N)
            points = unit.transpose(0, 1).reshape(1, H, B * N, D).expand(m, H, B * N, D).reshape(m * H, B * N, D)
            updated = ema_centroid_update(
                self.centroids.reshape(m * H, k, D), points, round_ids.transpose(1, 2).reshape(m * H, B * N),
                decay=self.options.decay, valid=valid, reduce=all_reduce_sum,
            )
            self._pending["centroids"] = updated.view(m, H, k, D)
        out = bucketed_attention(
            qk, v, buckets.unsqueeze(2), min(self.options.bucket_size, max(N, 1)), num_buckets=k,
            look_back=self.options.look_back, causal=causal, key_padding_mask=key_padding_mask,
            dropout_p=self.options.dropout if self.training else 0.0,
        )
        return self.project_out(out)
