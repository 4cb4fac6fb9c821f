"""How large the groups a trained model's layers form are, on its own training batches
(docs/recall-and-aggregation.md#what-earns-the-recall-the-ranking-not-content-clusters): per layer that publishes
groups (cluster-select's key groups, neural-clustering's clusters), over every
(sequence, head) of ``--batches`` batches, the share of real keys in the largest group, the groups holding any key,
and the share of keys whose group holds more than ``--reach`` members (cluster-select reads at most
``cluster_keys`` members of a selected group, its most recent ones: the keys beyond that reach are read only when
they are recent).

    python docs/scripts/group_sizes.py RUN [RUN ...] [--batches 1] [--reach 32]
"""

from __future__ import annotations

import argparse

import torch

from clusterformer.attention import InnerAttention, record_groups
from clusterformer.train.loop import load_trained


def sizes(groups: torch.Tensor, real: torch.Tensor, reach: int) -> dict[str, float]:
    """groups (B, H, N) long (any id on padding), real (B, N) bool -> the statistics of the module docstring, over
    (B, H): largest_share and groups_used averaged over the (sequence, head) pairs, beyond_reach over the keys."""
    B, H, N = groups.shape
    ids = groups.clamp(min=0).reshape(B * H, N)
    keep = real.unsqueeze(1).expand(B, H, N).reshape(B * H, N)
    counts = torch.zeros(B * H, int(ids.max()) + 1, dtype=torch.long).scatter_add_(1, ids, keep.long())
    per_key = counts.gather(1, ids)  # (B H, N): the size of each key's group
    real_keys = keep.sum(1).clamp(min=1)
    return {"largest_share": float((counts.amax(1) / real_keys).mean()),
            "groups_used": float((counts > 0).sum(1).float().mean()),
            "beyond_reach": float(((per_key > reach) & keep).sum() / keep.sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--batches", type=int, default=1)
    parser.add_argument("--reach", type=int, default=32)
    args = parser.parse_args()
    for run in args.runs:
        model, task, config, _ = load_trained(run)
        layers = [m for m in model.modules() if isinstance(m, InnerAttention)]
        found: dict[int, list[dict[str, float]]] = {}
        with torch.no_grad():
            for batch in range(args.batches):
                ids, pad, _, _ = task.batch(batch, task.steps_per_epoch(config.batch_size, 1), config.batch_size, 0, 1,
                                            config.seed)
                with record_groups() as recorded:
                    model(ids, pad)
                real = torch.ones_like(ids, dtype=torch.bool) if pad is None else ~pad
                for index, layer in enumerate(layers):
                    if layer in recorded:
                        g = recorded[layer]  # (B, H, N), or (B, N) shared by the heads
                        g = g if g.dim() == 3 else g.unsqueeze(1)
                        found.setdefault(index, []).append(sizes(g, real, args.reach))
        print(run)
        for index, stats in found.items():
            mean = {key: sum(s[key] for s in stats) / len(stats) for key in stats[0]}
            print(f"  layer {index}: largest group {mean['largest_share']:.3f} of the keys, "
                  f"{mean['groups_used']:.1f} groups used, {mean['beyond_reach']:.3f} of the keys in groups of more "
                  f"than {args.reach}")


if __name__ == "__main__":
    main()
