"""The bounded memory of strict-causal neural clustering, measured on MQAR's positions
(docs/recall-and-aggregation.md#why-neural-clustering-does-not-recall).

Under ``causal_mode="strict"`` a token of cluster c with r earlier members of c sees the members of c of rank in
``[(r // w - look_back) w, r]`` (``w = causal_chunk_size``): at most ``(look_back + 1) w`` keys, whatever the
length. So even a *perfect* clustering -- every query in the same cluster as the key it needs -- recalls a key only
if few enough members of that cluster came between them. This script measures that ceiling: MQAR sequences
(:mod:`clusterformer.data.recall`, uniform gaps), each query put in its key's cluster, every other token in a
uniformly random cluster of ``causal_clusters``, and the share of queries whose key is still in the window.

    python docs/scripts/causal_recall_cap.py            # the table in docs/recall-and-aggregation.md
"""

from __future__ import annotations

import torch

from clusterformer.data.recall import MQARSpec, generate_recall
from clusterformer.ops.layouts import group_ranks


def recall_ceiling(length: int, clusters: int, chunk: int, look_back: int = 1, sequences: int = 64,
                   seed: int = 0) -> float:
    """Share of MQAR queries whose needed token (the value) is inside the query's strict-causal cluster window when
    the query and the value share a cluster and every other token's cluster is random."""
    batch = generate_recall(MQARSpec(length=length, num_pairs=8, vocab_size=128), seed, "test", 0, sequences)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, clusters, (sequences, length), generator=g)
    rows = torch.arange(sequences).unsqueeze(1)
    ids[rows, batch.queries] = ids[rows, batch.sources]  # the perfect grouping of each query with its value
    rank, _ = group_ranks(ids, clusters)
    first = (rank[rows, batch.queries] // chunk - look_back) * chunk  # the window's first rank
    return (rank[rows, batch.sources] >= first).float().mean().item()


def main() -> None:
    print("| N | causal_clusters | causal_chunk_size | keys per query | history kept (clusters x keys) | ceiling |")
    print("|---|---|---|---|---|---|")
    for length in (1024, 4096, 16384):
        for clusters, chunk in ((16, 16), (64, 16), (256, 16), (16, 64)):
            cap = recall_ceiling(length, clusters, chunk)
            print(f"| {length} | {clusters} | {chunk} | {2 * chunk} | {clusters * 2 * chunk} | {cap:.3f} |")


if __name__ == "__main__":
    main()
