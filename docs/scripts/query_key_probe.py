"""Would a query and the key it needs share a cluster? Nearest-centroid rules on a trained MQAR model.

neural-clustering with ``cluster_on="query-key"`` assigns each head's queries and keys apart to their nearest
centroid by cosine; a query then reads its cluster's keys. That recalls only if a query and the key it needs (the
value token after its key's earlier occurrence) land on one centroid. This probe asks it of the queries and keys a
trained model computes, without training: for every layer and head of ``RUN_DIR`` (a ``train --task mqar`` run:
full attention, or neural-clustering with ``cluster_on="query-key"``), on its first test sequences, the share of
MQAR queries whose needed key has the same nearest centroid as the query, under:

- ``random``: ``CLUSTERS`` random centroids, as a fresh layer starts (N(0, 1), the layer's initialisation);
- ``random, keys centred``: the same, each key less the mean of the keys up to it (a strictly causal centring that
  removes the direction all keys share; being a different vector for each key, it may change a query's ranking);
- ``k-means``: the centroids of 10 cosine Lloyd steps on the sequence's keys (what training the centroids could at
  best reach; it sees every key, so it is not causal);
- ``k-means, keys centred``;
- ``k-means of keys, shared``: one set of centroids per head for every probed sequence, 10 cosine Lloyd steps on all
  their keys together (what centroids learned over the training stream, as ``centroid_fit="keys"`` learns them,
  could reach);
- ``k-means of queries and keys, shared``: the same on the queries and keys together (what the default
  ``centroid_fit="queries-keys"`` fits them to);
- ``trained`` (only in a layer with ``cluster_on="query-key"``): the layer's own learned centroids, as it assigns.

Chance is about 1 / ``CLUSTERS``. Each row also gives ``best head``: the share of queries for which some head of
the layer shares the cluster, and ``largest``: the mean share of a sequence's keys in its largest cluster, per head
(1 / ``CLUSTERS`` when balanced). Writes nothing unless ``--json PATH``.

    python docs/scripts/query_key_probe.py RUN_DIR [--clusters 16] [--sequences 64] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from clusterformer.attention import AttentionLayer
from clusterformer.train import load_trained


def _kmeans(x: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """x (B, H, N, D) -> centroids (B, H, k, D): retrieval_probe.py's cosine Lloyd steps (loaded by path beside this
    script: docs/scripts is no package)."""
    spec = importlib.util.spec_from_file_location("retrieval_probe", Path(__file__).with_name("retrieval_probe.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._kmeans(x, k, generator=generator)[1]


def _nearest(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """(B, H, N, D) against (H, k, D) or (B, H, k, D) -> (B, H, N) the nearest by cosine."""
    if centroids.dim() == 3:
        centroids = centroids.unsqueeze(0)
    return (F.normalize(x, dim=-1) @ F.normalize(centroids, dim=-1).transpose(-1, -2)).argmax(-1)


def probe(run: str, clusters: int, sequences: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    shared_generator = torch.Generator().manual_seed(1)  # its own, so the rules before it draw as they always did
    model, task, config, step = load_trained(run)
    test = task.test
    ids, queries, sources = test.ids[:sequences], test.queries[:sequences], test.sources[:sequences]
    captured: dict[str, torch.Tensor] = {}
    layers = {name: m for name, m in model.named_modules() if isinstance(m, AttentionLayer)}
    handles = [m.register_forward_pre_hook(lambda m, args, kwargs, name=name: captured.__setitem__(
        name, args[0] if args else kwargs["x"]), with_kwargs=True) for name, m in layers.items()]
    with torch.no_grad():
        model(ids, None)
    for handle in handles:
        handle.remove()
    rows = []
    for name, layer in layers.items():
        with torch.no_grad():
            q, k, _ = layer.qkv(captured[name])  # (B, H, N, D)
        B, H, N, D = q.shape
        counts = torch.arange(1, N + 1, dtype=k.dtype).view(1, 1, N, 1)
        centred = k - k.cumsum(2) / counts  # each key less the mean of the keys up to it
        random = torch.randn(clusters, H * D, generator=generator).view(clusters, H, D).transpose(0, 1)
        rules = {"random": (k, random), "random, keys centred": (centred, random),
                 "k-means": (k, _kmeans(k, clusters, generator)),
                 "k-means, keys centred": (centred, _kmeans(centred, clusters, generator))}
        # one set per head for every sequence: (1, H, B * N, D) -> (H, k, D)
        every_key = k.transpose(0, 1).reshape(1, H, B * N, D)
        every_point = torch.cat([every_key, q.transpose(0, 1).reshape(1, H, B * N, D)], dim=2)
        rules["k-means of keys, shared"] = (k, _kmeans(every_key, clusters, shared_generator)[0])
        rules["k-means of queries and keys, shared"] = (k, _kmeans(every_point, clusters, shared_generator)[0])
        inner = layer.inner
        if getattr(getattr(inner, "options", None), "cluster_on", None) == "query-key":
            own = inner.centroids.detach()[:clusters]
            rules["trained"] = (k, own.view(own.shape[0], H, D).transpose(0, 1))
        rows_of_layer = {}
        index = queries.view(B, 1, -1).expand(B, H, -1)
        needed = sources.view(B, 1, -1).expand(B, H, -1)
        for rule, (keys, centroids) in rules.items():
            query_ids = _nearest(q, centroids).gather(2, index)
            key_ids = _nearest(keys, centroids).gather(2, needed)
            same = query_ids == key_ids  # (B, H, Q)
            sizes = F.one_hot(_nearest(keys, centroids), centroids.shape[-2]).sum(2)  # (B, H, k) keys per cluster
            rows_of_layer[rule] = {"per_head": [round(float(same[:, h].float().mean()), 4) for h in range(H)],
                                   "best_head": round(float(same.any(1).float().mean()), 4),
                                   "largest": [round(float(x), 4) for x in (sizes.amax(-1) / N).mean(0)]}
        rows.append({"layer": name, **rows_of_layer})
    return {"run": run, "step": step, "max_len": config.max_len, "clusters": clusters, "sequences": len(ids),
            "queries": int(queries[:sequences].numel()), "chance": round(1 / clusters, 4), "layers": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run")
    parser.add_argument("--clusters", type=int, default=16)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--json")
    args = parser.parse_args()
    result = probe(args.run, args.clusters, args.sequences)
    print(f"{result['run']} (step {result['step']}, N = {result['max_len']}, {result['clusters']} centroids, "
          f"{result['queries']} queries; chance {result['chance']}):")
    for row in result["layers"]:
        for rule in (name for name in row if name != "layer"):
            print(f"  {row['layer']:24s} {rule:36s} per head {row[rule]['per_head']}  best head "
                  f"{row[rule]['best_head']}  largest {row[rule]['largest']}")
    if args.json:
        result["command"] = ("python docs/scripts/query_key_probe.py " + args.run + f" --clusters {args.clusters} "
                             f"--sequences {args.sequences}")
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
            handle.write("\n")


if __name__ == "__main__":
    main()
