"""Attention mechanisms behind one registry and one calling convention.

    layer = clusterformer.attention.build("neural-clustering", dim=256, heads=4, num_clusters="sqrt")
    y = layer(x, key_padding_mask=None, causal=False)      # x, y: (B, N, 256)

One file per mechanism; importing this package registers them all.
"""

from . import (  # noqa: F401  (registration side effect)
    cluster_former,
    clustered,
    full,
    kmeans,
    lsh,
    neural_clustering,
    routing,
)
from .aux import collect_aux_losses, total_loss
from .base import AttentionLayer, apply_pending_updates, is_replaying, replaying
from .cluster_former import ClusterFormerAttention, ClusterFormerOptions, SlidingWindowAttention, SlidingWindowOptions
from .clustered import ClusteredAttention, ClusteredOptions, ImprovedClusteredAttention, ImprovedClusteredOptions
from .full import FullAttention, FullOptions
from .kmeans import KMeansAttention, KMeansOptions
from .lsh import LSHAttention, LSHOptions
from .neural_clustering import NeuralClusteringAttention, NeuralClusteringOptions
from .registry import build, describe, names
from .routing import RoutingAttention, RoutingOptions

__all__ = [
    "AttentionLayer",
    "ClusterFormerAttention",
    "ClusterFormerOptions",
    "ClusteredAttention",
    "ClusteredOptions",
    "FullAttention",
    "FullOptions",
    "ImprovedClusteredAttention",
    "ImprovedClusteredOptions",
    "KMeansAttention",
    "KMeansOptions",
    "LSHAttention",
    "LSHOptions",
    "NeuralClusteringAttention",
    "NeuralClusteringOptions",
    "RoutingAttention",
    "RoutingOptions",
    "SlidingWindowAttention",
    "SlidingWindowOptions",
    "apply_pending_updates",
    "build",
    "collect_aux_losses",
    "describe",
    "is_replaying",
    "names",
    "replaying",
    "total_loss",
]
