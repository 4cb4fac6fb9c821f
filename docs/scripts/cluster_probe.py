"""How a trained model's clustering layers group the tokens of its task's test texts
(docs/pretraining.md#why-pretrained-neural-clustering-fine-tunes-worse-on-20news).

For each run (a classification run's directory), the first ``--examples`` test texts go through the model in
evaluation mode and every layer that publishes groups (neural-clustering's clusters, cluster-select's key clusters)
is read: per layer, the share of real tokens in the largest group of their (sequence, head), the groups holding
any token, and the normalised entropy of the group sizes (1: equal groups, 0: one group). ``--start`` also builds
each run's model as it *started* fine-tuning -- the run's own ``--init`` checkpoint loaded as ``train`` loads it --
and reports the same for it, and the normalised mutual information of the start's and the end's groups (1: the same
grouping up to the groups' ids; how much fine-tuning moved the clustering).

    python docs/scripts/cluster_probe.py RUN [RUN ...] [--examples 64] [--start] [--data-dir ../shared/data]
"""

from __future__ import annotations

import argparse
import copy
import math

import torch

from clusterformer.attention import InnerAttention, record_groups
from clusterformer.train.loop import init_from_checkpoint, load_trained, read_checkpoint


def groups_of(model: torch.nn.Module, ids: torch.Tensor, pad: torch.Tensor, batch: int) -> list[torch.Tensor]:
    """Per publishing layer (in model order), its groups (n, H, N) over the texts (long; -1 on padding)."""
    layers = [m for m in model.modules() if isinstance(m, InnerAttention)]
    found: list[list[torch.Tensor]] = [[] for _ in layers]
    with torch.no_grad():
        for first in range(0, len(ids), batch):
            with record_groups() as recorded:
                model(ids[first:first + batch], pad[first:first + batch])
            for index, layer in enumerate(layers):
                if layer in recorded:
                    g = recorded[layer]
                    g = g if g.dim() == 3 else g.unsqueeze(1)  # (B, N) groups shared by the heads
                    found[index].append(g.masked_fill(pad[first:first + batch, None, :], -1))
    return [torch.cat(parts) for parts in found if parts]


def statistics(groups: torch.Tensor) -> dict[str, float]:
    """Largest group's share of the real tokens, groups in use, normalised entropy of the sizes: means over
    (text, head)."""
    n, H, _ = groups.shape
    bins = int(groups.max()) + 1
    shares, used, entropy = [], [], []
    for row in groups.reshape(n * H, -1):
        real = row[row >= 0]
        if real.numel() == 0:
            continue
        counts = torch.bincount(real, minlength=bins).double()
        p = counts[counts > 0] / counts.sum()
        shares.append(float(p.max()))
        used.append(int((counts > 0).sum()))
        entropy.append(float(-(p * p.log()).sum()) / math.log(bins) if bins > 1 else 0.0)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"largest": mean(shares), "used": mean(used), "of": bins, "entropy": mean(entropy)}


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Normalised mutual information of two groupings of the same tokens (n, H, N; -1 on padding), mean over
    (text, head): 1 when one is a relabelling of the other (group ids need not match), 0 when independent."""
    n, H, _ = a.shape
    values = []
    for x, y in zip(a.reshape(n * H, -1), b.reshape(n * H, -1), strict=True):
        real = x >= 0
        x, y = x[real], y[real]
        if x.numel() == 0:
            continue
        joint = torch.zeros(int(x.max()) + 1, int(y.max()) + 1, dtype=torch.float64)
        joint.index_put_((x, y), torch.ones_like(x, dtype=torch.float64), accumulate=True)
        joint /= joint.sum()
        px, py = joint.sum(1), joint.sum(0)
        nz = joint > 0
        mutual = float((joint[nz] * (joint[nz] / (px[:, None] * py[None, :])[nz]).log()).sum())
        hx = float(-(px[px > 0] * px[px > 0].log()).sum())
        hy = float(-(py[py > 0] * py[py > 0].log()).sum())
        values.append(mutual / math.sqrt(hx * hy) if hx > 0 and hy > 0 else float(hx == hy == 0))
    return sum(values) / len(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--examples", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--start", action="store_true", help="also the model as it started fine-tuning (--init)")
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()
    for run in args.runs:
        model, task, config, step = load_trained(run, data_dir=args.data_dir, device="cpu")
        ids, pad = task.test.ids[:args.examples], task.test.pad[:args.examples]
        end = groups_of(model, ids, pad, args.batch)
        print(f"{run} (step {step}, {config.attention}):")
        start = None
        if args.start and config.init is not None:
            first = copy.deepcopy(model)  # the same model, its weights replaced by the --init checkpoint's
            init_from_checkpoint(first, read_checkpoint(config.init), config)
            start = groups_of(first.eval(), ids, pad, args.batch)
        for layer, groups in enumerate(end):
            line = "  layer {}: end   largest {largest:.3f}  used {used:.1f} of {of}  entropy {entropy:.3f}".format(
                layer, **statistics(groups))
            print(line)
            if start is not None:
                print("  layer {}: start largest {largest:.3f}  used {used:.1f} of {of}  entropy {entropy:.3f}"
                      "  start-end NMI {nmi:.3f}".format(layer, nmi=agreement(start[layer], groups),
                                                         **statistics(start[layer])))


if __name__ == "__main__":
    main()
