"""The keys' spherical assignment timed, fused against its composition
(docs/speed-and-memory.md#cluster-select-its-kernels-and-its-training-step).

One forward and backward of :func:`clusterformer.ops.spherical.spherical_assignment` -- each key's nearest unit
centroid with the balance bias, its commitment distance, the per-cluster sums -- against
:func:`~clusterformer.ops.spherical.spherical_assignment_reference` (the tensor operations cluster-select and
routing ran before), interleaved, after a warm-up; medians and their ratio. Defaults: one layer of the 4,096-token
MQAR models (batch 16, 2 heads of 64, 64 clusters).

    OMP_NUM_THREADS=1 python docs/scripts/assignment_time.py [--batch 16] [--heads 2] [--length 4096] [--dim 64]
        [--clusters 64] [--repeats 7]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from clusterformer.ops.spherical import spherical_assignment, spherical_assignment_reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("batch", 16), ("heads", 2), ("length", 4096), ("dim", 64), ("clusters", 64),
                          ("repeats", 7)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    k = torch.randn(args.batch, args.heads, args.length, args.dim, generator=g)
    centroids = F.normalize(torch.randn(args.heads, args.clusters, args.dim, generator=g), dim=-1)
    bias = 0.05 * torch.randn(args.heads, args.clusters, generator=g)
    real = torch.ones(args.batch, args.length, dtype=torch.bool)
    ways = {"fused": spherical_assignment, "composition": spherical_assignment_reference}

    def once(assign) -> float:
        leaf = k.clone().requires_grad_()
        start = time.perf_counter()
        out = assign(leaf, centroids, bias=bias, real=real)
        out.gap.sum().backward()
        return time.perf_counter() - start

    for assign in ways.values():
        once(assign)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, assign in ways.items():
            times[name].append(once(assign))
    medians = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    print(f"spherical assignment, forward + backward, B {args.batch} H {args.heads} N {args.length} D {args.dim} "
          f"C {args.clusters}, median of {args.repeats}, threads={torch.get_num_threads()}:")
    for name, median in medians.items():
        print(f"  {name:12s} {median * 1e3:8.1f} ms  {median / medians['composition']:5.2f}x")


if __name__ == "__main__":
    main()
