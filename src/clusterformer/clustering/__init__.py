"""Clustering methods shared by the attention mechanisms and usable on their own."""

from .neural import NeuralClusteringOutput, neural_clustering

__all__ = ["NeuralClusteringOutput", "neural_clustering"]
