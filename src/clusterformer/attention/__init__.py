"""Attention mechanisms behind one registry and one calling convention.

    layer = clusterformer.attention.build("neural-clustering", dim=256, heads=4, num_clusters="sqrt")
    y = layer(x, key_padding_mask=None, causal=False)      # x, y: (B, N, 256)

    with clusterformer.attention.collect_aux_losses() as aux:   # auxiliary losses of every layer
        y = layer(x)

A layer (:class:`AttentionLayer`) owns the projections and composes an inner attention, the mechanism
(:class:`InnerAttention`), chosen by name. One file per mechanism; importing this package registers them all.
"""

from . import (  # noqa: F401  (registration side effect)
    cluster_former,
    cluster_select,
    clustered,
    full,
    kmeans,
    lsh,
    neural_clustering,
    retrieval,
    routing,
)
from .aux import AuxLosses, collect_aux_losses, record_groups, total_loss
from .base import (
    AttentionLayer,
    AttentionOptions,
    BucketOptions,
    InnerAttention,
    QKVProjection,
    SeededOptions,
    apply_pending_updates,
    is_replaying,
    replaying,
    restage_draws,
    stage_draws,
)
from .cluster_former import ClusterFormerAttention, ClusterFormerOptions, SlidingWindowAttention, SlidingWindowOptions
from .cluster_select import ClusterSelectAttention, ClusterSelectOptions
from .clustered import ClusteredAttention, ClusteredOptions, ImprovedClusteredAttention, ImprovedClusteredOptions
from .full import FullAttention, FullOptions
from .kmeans import KMeansAttention, KMeansOptions
from .lsh import LSHAttention, LSHOptions
from .neural_clustering import NeuralClusteringAttention, NeuralClusteringOptions, fitting_centroids
from .registry import build, build_inner, can_decode, describe, names, register
from .retrieval import (
    CacheBudgetOptions,
    ClusterRetrievalAttention,
    ClusterRetrievalOptions,
    OracleAttention,
    QuestAttention,
    QuestOptions,
    SinkWindowAttention,
    SinkWindowOptions,
)
from .routing import RoutingAttention, RoutingOptions

__all__ = [
    "AttentionLayer",
    "AttentionOptions",
    "AuxLosses",
    "BucketOptions",
    "CacheBudgetOptions",
    "ClusterFormerAttention",
    "ClusterFormerOptions",
    "ClusterRetrievalAttention",
    "ClusterRetrievalOptions",
    "ClusterSelectAttention",
    "ClusterSelectOptions",
    "ClusteredAttention",
    "ClusteredOptions",
    "FullAttention",
    "FullOptions",
    "ImprovedClusteredAttention",
    "ImprovedClusteredOptions",
    "InnerAttention",
    "KMeansAttention",
    "KMeansOptions",
    "LSHAttention",
    "LSHOptions",
    "NeuralClusteringAttention",
    "NeuralClusteringOptions",
    "OracleAttention",
    "QKVProjection",
    "QuestAttention",
    "QuestOptions",
    "RoutingAttention",
    "RoutingOptions",
    "SeededOptions",
    "SinkWindowAttention",
    "SinkWindowOptions",
    "SlidingWindowAttention",
    "SlidingWindowOptions",
    "apply_pending_updates",
    "build",
    "build_inner",
    "can_decode",
    "collect_aux_losses",
    "describe",
    "fitting_centroids",
    "is_replaying",
    "names",
    "record_groups",
    "register",
    "replaying",
    "restage_draws",
    "stage_draws",
    "total_loss",
]
