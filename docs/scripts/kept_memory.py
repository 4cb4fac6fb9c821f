"""Tensors alive after a layer's training forward, and the tensor peak over forward and backward, in units of the
input's bytes (issue #35 §2; docs/benchmarks.md, "Without a GPU").

    python docs/scripts/kept_memory.py 16384 full,lsh,kmeans,routing

B = 1, dim 256 (4 heads of 64), float32, each mechanism's defaults (seed 1 where it needs one), on the CPU. Counted
exactly by clusterformer.bench.memory.training_pass_memory, so the figures repeat from run to run. To compare with an
older commit, run the same file with that commit's src first on PYTHONPATH.
"""

from __future__ import annotations

import sys

import torch

from clusterformer.attention import build
from clusterformer.bench.memory import training_pass_memory


def main(length: int, names: list[str]) -> None:
    for name in names:
        torch.manual_seed(0)
        seeded = {"seed": 1} if name in ("lsh", "clustered", "improved-clustered") else {}
        x = torch.randn(1, length, 256, requires_grad=True)
        kept, peak = training_pass_memory(build(name, dim=256, heads=4, **seeded), x)
        unit = x.numel() * x.element_size()
        print(f"{name:20s} N={length}: kept after forward {kept / unit:6.2f}x the input, "
              f"tensor peak {peak / unit:6.2f}x")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python docs/scripts/kept_memory.py LENGTH NAME[,NAME...]")
    main(int(sys.argv[1]), sys.argv[2].split(","))
