"""Clustering methods shared by the attention mechanisms and usable on their own."""

from .hashing import angular_lsh_buckets, sign_codes
from .kmeans import ema_centroid_update, euclidean_kmeans, greedy_nearest_order, hamming_kmeans, spherical_kmeans
from .neural import NeuralClusteringOutput, neural_clustering

__all__ = [
    "NeuralClusteringOutput",
    "angular_lsh_buckets",
    "ema_centroid_update",
    "euclidean_kmeans",
    "greedy_nearest_order",
    "hamming_kmeans",
    "neural_clustering",
    "sign_codes",
    "spherical_kmeans",
]
