"""``"clustered"`` and ``"improved-clustered"``: clustered attention (fast-transformers paper, sections 3.2-3.3).

Two registered names, one file: improved clustered is clustered attention plus an exact top-k correction.

For x (B, N, dim), per batch element and head:

1. Q, K, V projections (B, H, N, D).
2. Query clustering (section 3.2.2): each query hashed to ``bits`` signs of random projections (planes drawn
   from the layer's generator), then K-means with Hamming distance, ``iterations`` Lloyd steps, ``num_clusters``
   centroids (clamped to N) -- :func:`clusterformer.clustering.hamming_kmeans`. Padded queries do not move
   the centroids. ``query_clustering="euclidean"`` instead runs the same Lloyd steps on the queries themselves
   (:func:`clusterformer.clustering.euclidean_kmeans`): the K-means the paper's analysis asks for, which it
   hashes only to save distance computations -- no saving when the head dimension D <= bits.
3. ``"clustered"``: attention of each cluster's mean query to all keys, broadcast to its members (eqs. 3-6).
   ``"improved-clustered"``: plus, per cluster, its ``topk`` keys of highest centroid attention recomputed
   exactly for every member and rescaled by the cluster's mass on them (eqs. 9-11); with ``topk >= N`` it is
   exactly full attention. See :func:`clusterformer.ops.clustered_attention`.
4. The layer's output projection. Groups published: the query clusters, (B, H, N).

Cost: O(N D bits + iterations N C bits) clustering (euclidean: O(iterations N C D)) + O(C N D)
centroid attention (+ O(N topk D) improved). Linear in N for fixed clusters.

Masks: key padding. ``causal=True`` is refused with a ``ValueError``: a cluster's centroid query mixes queries
from all positions, so clustered attention cannot be made causal without changing the method (the paper
evaluates it only without a causal mask).

Randomness: in training each forward draws new hash planes from the layer's generator (seeded by ``seed``);
in evaluation the planes are re-drawn from ``seed`` each call, so the same input gives the same output.
With staged draws (:func:`clusterformer.attention.stage_draws`) the planes come from a device buffer filled
before the step, so the training step (without a padding mask) can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .._checks import check_choice, check_int
from ..clustering.hashing import sign_codes
from ..clustering.kmeans import euclidean_kmeans, hamming_kmeans
from ..masks import NO_MASK, AttentionMask
from ..ops.clustered import clustered_attention
from .aux import publish_groups
from .base import InnerAttention, SeededOptions
from .registry import register

QUERY_CLUSTERINGS = ("hamming", "euclidean")


@dataclass(frozen=True)
class ClusteredOptions(SeededOptions):
    """Options of ``"clustered"`` (besides ``bias`` and ``seed``, which seeds the hash planes; the mechanism has
    no attention dropout, so ``dropout`` must be 0).

    Attributes:
        num_clusters: query clusters C per sequence and head (the paper's clustered-C; alias ``clusters``);
            clamped to N.
        bits: bits B of the sign-of-random-projection hash.
        iterations: Lloyd iterations L of the K-means.
        query_clustering: ``"hamming"`` (the paper: hash, then K-means in Hamming space) or ``"euclidean"``
            (K-means on the real-valued queries; ``bits`` and ``seed`` are then unused).
    """

    ALIASES: ClassVar[dict[str, str]] = {"clusters": "num_clusters"}
    ATTENTION_DROPOUT: ClassVar[bool] = False

    num_clusters: int = 100
    bits: int = 32
    iterations: int = 10
    query_clustering: str = "hamming"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("num_clusters", self.num_clusters, minimum=1)
        check_int("bits", self.bits, minimum=1)
        check_int("iterations", self.iterations, minimum=0)
        check_choice("query_clustering", self.query_clustering, QUERY_CLUSTERINGS)

    def causal_semantics(self) -> str:
        return "refused"  # a centroid query mixes every position


@dataclass(frozen=True)
class ImprovedClusteredOptions(ClusteredOptions):
    """Options of ``"improved-clustered"``: those of ``"clustered"`` plus

    Attributes:
        topk: keys per cluster recomputed exactly (the paper uses 32); clamped to N.
    """

    topk: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("topk", self.topk, minimum=1)


@register("clustered", ClusteredOptions, "clustered attention: LSH + Hamming k-means on queries; O(N C)")
class ClusteredAttention(InnerAttention):
    interface_mode = "sequence"

    def cluster_queries(self, q: torch.Tensor, mask: AttentionMask = NO_MASK) -> tuple[torch.Tensor, int]:
        """Step 2: q (B, H, N, D) -> (query clusters (B, H, N), number of clusters C = min(num_clusters, N)).

        Hash planes (H, D, bits) are drawn from the layer's generator (Hamming clustering only); padded queries
        do not move the centroids."""
        options = self.options
        B, H, N, D = q.shape
        valid = None
        if mask.padding is not None:
            valid = mask.real(B, N, q.device).unsqueeze(1).expand(B, H, N).reshape(B * H, N)
        if options.query_clustering == "euclidean":
            groups = euclidean_kmeans(q.detach().reshape(B * H, N, D), options.num_clusters,
                                      iterations=options.iterations, valid=valid)
        else:
            planes = self.draw(f"planes {H}x{D}x{options.bits}",
                               lambda generator: torch.randn(H, D, options.bits, generator=generator), q.device)
            codes = sign_codes(q.detach(), planes).reshape(B * H, N, options.bits)
            groups = hamming_kmeans(codes, options.num_clusters, iterations=options.iterations, valid=valid)
        return groups.view(B, H, N), max(1, min(options.num_clusters, N))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask = NO_MASK
                ) -> torch.Tensor:
        self.refuse_causal(mask.causal, "a cluster's centroid query mixes all positions")
        if q.shape[2] == 0:
            return q * 0
        groups, n_clusters = self.cluster_queries(q, mask)
        publish_groups(self, groups)
        topk = getattr(self.options, "topk", None)
        return clustered_attention(q, k, v, groups, n_clusters, topk=topk, mask=mask)


@register(
    "improved-clustered", ImprovedClusteredOptions,
    "improved clustered attention: clustered + exact top-k keys per cluster; O(N C + N k)",
)
class ImprovedClusteredAttention(ClusteredAttention):
    """Clustered attention plus the exact top-k correction (the options' ``topk``)."""
