"""Functional core: the batched primitives every clustering mechanism is built from."""

from .chunked import cluster_causal_attention, sorted_chunk_attention, sorted_chunk_attention_unchecked

__all__ = ["cluster_causal_attention", "sorted_chunk_attention", "sorted_chunk_attention_unchecked"]
