"""Clustered key selection on a trained *full-attention* MQAR model, without retraining
(docs/recall-and-aggregation.md#how-the-models-at-n--1024-are-trained-a-length-curriculum).

For every full-attention layer of a trained ``train --task mqar --attention full`` run, each query is restricted to
its causal window of ``WINDOW`` keys plus the keys of the clusters it scores highest: the layer's keys are grouped by
K-means (per sequence and head, cosine, 10 Lloyd steps from random keys), the clusters ranked by q . centroid, and
whole clusters taken, best first, while fewer than ``BUDGET`` earlier keys outside the window have been taken (so the
last cluster may pass the budget). Prints the accuracy on the first test sequences and, per layer, the share of
(query, head) pairs whose needed token is inside the restricted set. It asks whether a query trained with full
attention *finds* the distant key through cluster selection; the K-means here sees every key of the sequence, so
this is a decoding-time selection (as ClusterKV's), not a strictly causal training-time one.

    python docs/scripts/retrieval_probe.py RUN_DIR [BUDGET [CLUSTERS [WINDOW]]]   # defaults 32 16 32
    python docs/scripts/retrieval_probe.py --random RUN_DIR ...   # control: clusters ranked at random, not by q . c
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from clusterformer.attention.full import FullAttention
from clusterformer.train import load_trained

SEQUENCES = 128


def _kmeans(x: torch.Tensor, k: int, iters: int = 10, generator: torch.Generator | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, H, N, D) -> (assignments (B, H, N), centroids (B, H, k, D)), cosine Lloyd steps from k random keys of
    each sequence and head (drawn from ``generator``, or torch's own)."""
    centroids = x[:, :, torch.randperm(x.shape[2], generator=generator)[:k]]
    for _ in range(iters):
        assign = (F.normalize(x, dim=-1) @ F.normalize(centroids, dim=-1).transpose(-1, -2)).argmax(-1)
        one_hot = F.one_hot(assign, k).to(x.dtype)
        centroids = (one_hot.transpose(-1, -2) @ x) / one_hot.sum(-2).clamp(min=1).unsqueeze(-1)
    return assign, centroids


def probe(run: str, budget: int, clusters: int, window: int, random_order: bool = False) -> str:
    torch.manual_seed(0)
    model, task, _, _ = load_trained(run)
    test = task.test
    ids, queries, sources = test.ids[:SEQUENCES], test.queries[:SEQUENCES], test.sources[:SEQUENCES]
    allowed_by_layer = []

    def restricted(self, q, k, v, key_padding_mask=None, causal=False):
        N = q.shape[2]
        t = torch.arange(N)
        earlier = t[:, None] >= t[None, :]
        local = earlier & (t[:, None] - t[None, :] < window)
        assign, centroids = _kmeans(k, clusters)
        member = F.one_hot(assign, clusters).to(q.dtype)  # (B, H, N keys, C)
        scores = q @ centroids.transpose(-1, -2)  # (B, H, N queries, C)
        if random_order:
            scores = torch.rand_like(scores)
        order = scores.argsort(-1, descending=True)
        eligible = torch.einsum("qn,bhnc->bhqc", (earlier & ~local).to(q.dtype), member).gather(-1, order)
        taken_sorted = (eligible.cumsum(-1) - eligible) < budget  # a cluster is taken while the budget is not spent
        taken = torch.zeros_like(taken_sorted).scatter(-1, order, taken_sorted)
        selected = torch.einsum("bhqc,bhnc->bhqn", taken.to(q.dtype), member) > 0
        allowed = (selected & earlier & ~local) | local
        allowed_by_layer.append(allowed)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)

    FullAttention.forward = restricted
    with torch.no_grad():
        logits = model(ids)
    predictions = logits[torch.arange(len(ids))[:, None], queries].argmax(-1)
    accuracy = (predictions == test.targets[: len(ids)].gather(1, queries)).float().mean()
    rows = torch.arange(len(ids))[:, None]
    recalls = [float(a[rows, :, queries, sources].float().mean()) for a in allowed_by_layer]
    return (f"window {window} + clusters up to {budget} keys of {clusters}{' (random order)' if random_order else ''}: "
            f"accuracy {float(accuracy):.3f}, key recall "
            + " / ".join(f"{r:.2f}" for r in recalls))


if __name__ == "__main__":
    args = sys.argv[1:]
    random_order = args[:1] == ["--random"]
    args = args[1:] if random_order else args
    if not args:
        sys.exit(__doc__)
    numbers = [int(a) for a in args[1:]] + [32, 16, 32][len(args) - 1:]
    print(probe(args[0], *numbers[:3], random_order=random_order))
