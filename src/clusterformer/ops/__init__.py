"""Functional core: the batched primitives every clustering mechanism is built from."""

from .bucketed import bucketed_attention, merge_rounds
from .chunked import cluster_causal_attention, sorted_chunk_attention
from .clustered import clustered_attention
from .heads import split_heads
from .layouts import ChunkLayout, cluster_causal_layout, sorted_layout
from .selected import selected_cluster_attention
from .sliding import sliding_window_attention, window_count
from .spherical import spherical_assignment
from .windows import use_fused_kernel, windowed_attention, windowed_attention_lse

__all__ = [
    "ChunkLayout",
    "bucketed_attention",
    "cluster_causal_attention",
    "cluster_causal_layout",
    "clustered_attention",
    "merge_rounds",
    "selected_cluster_attention",
    "sliding_window_attention",
    "sorted_chunk_attention",
    "sorted_layout",
    "spherical_assignment",
    "split_heads",
    "use_fused_kernel",
    "window_count",
    "windowed_attention",
    "windowed_attention_lse",
]
