"""Where a trained recall model's clusters put an MQAR query, per layer
(docs/recall-and-aggregation.md#why-neural-clustering-does-not-recall).

For each query of the first test sequences of a trained ``train --task mqar`` run, and each attention layer that
publishes its groups (neural-clustering, routing: head 0, ...): whether the query shares its cluster with the value
it needs (position s) and with the first occurrence of its own key (position s - 1, the same token), the number of
clusters in use, and the largest cluster's share of the tokens. With the key-recall column of the run's
``metrics.json`` this separates "the clustering keeps query and value apart" from "they share a cluster, but the
value is outside the keys the query sees in it" (strict-causal windows hold a cluster's most recent members).

    python docs/scripts/cluster_sharing.py RUN_DIR [RUN_DIR ...]
    python docs/scripts/cluster_sharing.py --init SEED RUN_DIR   # the run's model untrained (torch seed SEED)
    python docs/scripts/cluster_sharing.py --assignments RUN_DIR  # neural-clustering layers: P's shared direction, and
                                                                  # the clusters under both strict-causal assignments
"""

from __future__ import annotations

import sys

import torch

from clusterformer.attention import record_groups
from clusterformer.train import load_trained
from clusterformer.train.loop import _prepare, build_model, load_run

SEQUENCES = 64


def cluster_sharing(run: str, init_seed: int | None = None) -> list[str]:
    """One line per grouping layer of the run in directory ``run`` (with ``init_seed``: its model untrained)."""
    state, config = load_run(run)
    task = _prepare(config, state.get("tokenizer"))
    if init_seed is not None:
        torch.manual_seed(init_seed)
    model = build_model(config, task)
    if init_seed is None:
        model.load_state_dict(state["model"])
    model.eval()
    test = task.test
    ids, queries, sources = test.ids[:SEQUENCES], test.queries[:SEQUENCES], test.sources[:SEQUENCES]
    with torch.no_grad(), record_groups() as groups:
        model(ids)
    rows = torch.arange(ids.shape[0]).unsqueeze(1)
    lines = []
    for layer, (module, g) in enumerate(groups.items()):
        g = g if g.dim() == 2 else g[:, 0]  # (B, N); per-head groups: head 0
        at_query = g[rows, queries]
        largest = torch.bincount(g.reshape(-1)).max() / g.numel()
        lines.append(f"layer {layer} ({type(module).__name__}): query with its value "
                     f"{float((at_query == g[rows, sources]).float().mean()):.2f}, with its key's first occurrence "
                     f"{float((at_query == g[rows, sources - 1]).float().mean()):.2f}; clusters in use "
                     f"{int(g.unique().numel())}, the largest holds {float(largest):.2f} of the tokens")
    return lines


def assignments(run: str) -> list[str]:
    """For each neural-clustering layer of a trained run: the length of the mean of its clustering input P against
    a token's mean deviation from it, and the clusters the layer's own P and centroids give under
    ``causal_assign="nearest"`` and ``"prefix"`` (the same statistics as :func:`cluster_sharing`)."""
    import torch.nn.functional as F

    from clusterformer.attention import NeuralClusteringAttention

    model, task, _, _ = load_trained(run)
    test = task.test
    ids, queries, sources = test.ids[:SEQUENCES], test.queries[:SEQUENCES], test.sources[:SEQUENCES]
    caught = []
    for module in model.modules():
        if isinstance(module, NeuralClusteringAttention):
            def keep(x, projection, module=module, original=module._cluster_input):
                points = original(x, projection)
                caught.append((module, points.detach()))
                return points
            module._cluster_input = keep
    with torch.no_grad():
        model(ids)
    rows = torch.arange(ids.shape[0]).unsqueeze(1)
    lines = []
    for layer, (module, points) in enumerate(caught):
        mean = points.mean((0, 1))
        deviation = (points - mean).norm(dim=-1).mean()
        o = module.options
        scores = o.similarity_scale * (F.normalize(points, dim=-1)
                                       @ F.normalize(module.centroids[: o.strict_causal_clusters()], dim=-1).T)
        lines.append(f"layer {layer}: |mean of P| {float(mean.norm()):.1f}, mean |P - mean| {float(deviation):.1f}")
        for name, g in (("nearest", scores.argmax(-1)), ("prefix", (scores - scores.logcumsumexp(1)).argmax(-1))):
            at_query = g[rows, queries]
            largest = torch.bincount(g.reshape(-1)).max() / g.numel()
            value, first = ((at_query == g[rows, where]).float().mean() for where in (sources, sources - 1))
            lines.append(f"  {name}: query with its value {float(value):.2f}, with its key's first occurrence "
                         f"{float(first):.2f}; clusters in use {int(g.unique().numel())}, the largest holds "
                         f"{float(largest):.2f}")
    return lines


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--assignments"]:
        for path in args[1:] or sys.exit(__doc__):
            print(path)
            for line in assignments(path):
                print("  " + line)
        sys.exit(0)
    seed = None
    if args[:1] == ["--init"]:
        if len(args) < 3:
            sys.exit(__doc__)
        seed, args = int(args[1]), args[2:]
    if not args:
        sys.exit(__doc__)
    for path in args:
        print(path if seed is None else f"{path} (untrained, seed {seed})")
        for line in cluster_sharing(path, seed):
            print("  " + line)
