"""The strictly causal mechanisms and options the decoding tests run, in one place.

Small chunks, so that a few dozen tokens cross many chunk boundaries; shared by the CPU cache tests
(tests/models/test_decoding.py: every entry) and the CUDA cache test (tests/attention/test_cuda.py: the first
entry of each mechanism, to keep the GPU run short).
"""

from __future__ import annotations

STRICT_CAUSAL: list[tuple[str, dict]] = [
    ("full", {}),
    ("neural-clustering", {"causal_chunk_size": 4, "causal_clusters": 3}),
    ("neural-clustering", {"causal_chunk_size": 3, "causal_clusters": 5, "look_back": 2}),
    ("neural-clustering", {"causal_chunk_size": 5, "grouping": "contiguous"}),
    ("neural-clustering", {"causal_chunk_size": 3, "causal_clusters": 4, "grouping": "random"}),
    ("neural-clustering", {"causal_chunk_size": 3, "causal_clusters": 3, "local_window": 6}),
    ("neural-clustering", {"causal_chunk_size": 3, "causal_clusters": 3, "cluster_on": "shared-qk"}),
    ("neural-clustering", {"causal_chunk_size": 3, "causal_clusters": 3, "cluster_on": "shared-qk", "local_window": 2}),
    ("neural-clustering", {"causal_chunk_size": 3, "causal_clusters": 4, "causal_assign": "prefix"}),
    ("neural-clustering", {"causal_chunk_size": 3, "causal_clusters": 3, "causal_assign": "prefix",
                           "cluster_on": "shared-qk", "local_window": 4}),
    ("lsh", {"causal_chunk_size": 4, "chunk_size": 7, "num_rounds": 2, "causal_clusters": 4}),
    ("lsh", {"causal_chunk_size": 3, "num_rounds": 3, "num_clusters": 6, "look_back": 2}),
    ("routing", {"causal_chunk_size": 4, "chunk_size": 9, "num_clusters": 3}),
    ("kmeans", {"causal_chunk_size": 5, "chunk_size": 2, "num_clusters": 4, "num_rounds": 2}),
    ("cluster-select", {"num_clusters": 3, "select": 2, "cluster_keys": 3, "window": 4, "summaries": False}),
    ("cluster-select", {"num_clusters": 4, "select": 1, "cluster_keys": 2, "window": 6, "summaries": False}),
    ("cluster-select", {"num_clusters": 4, "select": 2, "cluster_keys": 2, "window": 4, "summaries": True}),
    ("cluster-select", {"num_clusters": 3, "select": 1, "cluster_keys": 3, "window": 2, "summaries": True,
                        "selection": "summaries"}),
    ("cluster-select", {"num_clusters": 3, "select": 2, "cluster_keys": 2, "window": 4, "summaries": True,
                        "selection": "summaries", "grouping": "position"}),
    ("cluster-select", {"num_clusters": 3, "select": 2, "cluster_keys": 2, "window": 4, "summaries": True,
                        "selection": "summaries", "kernel": "banded"}),
    ("cluster-select", {"num_clusters": 4, "select": 1, "cluster_keys": 3, "window": 6, "kernel": "banded",
                        "summaries": False}),
    ("cluster-select", {"num_clusters": 3, "select": 1, "cluster_keys": 2, "window": 2, "summaries": True,
                        "selection": "summaries", "grouping": "position", "page_size": 3}),
    ("cluster-select", {"num_clusters": 3, "select": 2, "cluster_keys": 2, "window": 4, "summaries": True,
                        "selection": "summaries", "grouping": "random"}),
    ("cluster-select", {"num_clusters": 2, "select": 2, "cluster_keys": 2, "window": 4, "position_splits": 3,
                        "split_size": 5}),
    ("cluster-select", {"num_clusters": 3, "select": 2, "cluster_keys": 2, "window": 4, "position_splits": 2,
                        "split_size": 5, "split_selection": "clusters"}),
    ("cluster-select", {"num_clusters": 2, "select": 1, "cluster_keys": 3, "window": 6, "position_splits": 2,
                        "split_size": 7, "kernel": "banded"}),
    ("cluster-select", {"num_clusters": 2, "select": 2, "cluster_keys": 2, "window": 4, "position_splits": 2,
                        "split_size": 6, "grouping": "random"}),
    ("cluster-select", {"num_clusters": 3, "select": 2, "cluster_keys": 2, "window": 4, "selection": "bound",
                        "bound_block": 3}),
    ("cluster-select", {"num_clusters": 2, "select": 2, "cluster_keys": 2, "window": 6, "selection": "bound",
                        "bound_block": 4, "position_splits": 2, "split_size": 5, "kernel": "banded"}),
    ("cluster-select", {"num_clusters": 4, "select": 1, "cluster_keys": 3, "window": 2, "selection": "bound",
                        "bound_block": 5, "summaries": False}),
    ("cluster-select", {"num_clusters": 3, "select": 2, "cluster_keys": 2, "window": 4, "selection": "bound",
                        "bound_block": 3, "summaries": False, "own_group": True}),
    ("cluster-select", {"num_clusters": 4, "select": 2, "cluster_keys": 2, "window": 2, "own_group": True,
                        "kernel": "banded"}),
    ("cluster-select", {"num_clusters": 3, "select": 2, "cluster_keys": 4, "window": 4, "selection": "bound",
                        "bound_block": 3, "own_group": True, "sink": 2}),
    ("cluster-select", {"num_clusters": 3, "select": 1, "cluster_keys": 2, "window": 2, "sink": 1,
                        "kernel": "banded", "summaries": False}),
    ("cluster-select", {"num_clusters": 3, "select": 2, "cluster_keys": 2, "window": 4, "sink": 1,
                        "selection": "summaries", "grouping": "position"}),
    ("cluster-select", {"num_clusters": 3, "select": 2, "cluster_keys": 2, "window": 4, "summaries": False,
                        "members": "score"}),
    ("cluster-select", {"num_clusters": 2, "select": 2, "cluster_keys": 3, "window": 2, "summaries": False,
                        "members": "score", "selection": "bound", "bound_block": 3, "position_splits": 2,
                        "split_size": 5, "sink": 1, "kernel": "banded"}),
    ("sliding-window", {"window": 8, "stride": 3}),
    ("sliding-window", {"window": 6, "stride": 6}),
]


def one_per_mechanism(configs: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """The first configuration of each mechanism, in order."""
    seen: dict[str, dict] = {}
    for name, options in configs:
        seen.setdefault(name, options)
    return list(seen.items())
