"""Attention mechanisms behind one registry and one calling convention.

    layer = clusterformer.attention.build("neural-clustering", dim=256, heads=4, num_clusters="sqrt")
    y = layer(x, key_padding_mask=None, causal=False)      # x, y: (B, N, 256)

One file per mechanism; importing this package registers them all.
"""

from . import full, neural_clustering  # noqa: F401  (registration side effect)
from .aux import collect_aux_losses, total_loss
from .base import AttentionLayer
from .full import FullAttention, FullOptions
from .neural_clustering import NeuralClusteringAttention, NeuralClusteringOptions
from .registry import build, describe, names

__all__ = [
    "AttentionLayer",
    "FullAttention",
    "FullOptions",
    "NeuralClusteringAttention",
    "NeuralClusteringOptions",
    "build",
    "collect_aux_losses",
    "describe",
    "names",
    "total_loss",
]
