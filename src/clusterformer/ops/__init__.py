"""Functional core: the batched primitives every clustering mechanism is built from."""

from .chunked import (
    ChunkLayout,
    cluster_causal_attention,
    cluster_causal_layout,
    sorted_chunk_attention,
    sorted_layout,
    windowed_attention,
)

__all__ = [
    "ChunkLayout",
    "cluster_causal_attention",
    "cluster_causal_layout",
    "sorted_chunk_attention",
    "sorted_layout",
    "windowed_attention",
]
