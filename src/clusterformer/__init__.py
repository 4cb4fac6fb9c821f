"""clusterformer: clustering-based sparse attention for Transformers in PyTorch."""

__version__ = "0.1.0"
