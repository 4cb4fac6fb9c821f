"""Tensors alive after a layer's training forward, and the tensor peak over forward and backward, in units of the
input's bytes (docs/speed-and-memory.md#memory).

    python docs/scripts/kept_memory.py 16384 full,lsh,kmeans,routing
    TRITON_INTERPRET=1 python docs/scripts/kept_memory.py rounds fused     (or: rounds sdpa)

Layers: B = 1, dim 256 (4 heads of 64), float32, each mechanism's defaults (seed 1 where it needs one), on the CPU.
Counted exactly by clusterformer.bench.memory.training_pass_memory, so the figures repeat from run to run. To compare
with an older commit, run the same file with that commit's src first on PYTHONPATH.

``rounds KERNEL``: bucketed_attention alone (float64, B 1, 2 heads, N 256, D 16, 4 rounds, 8 buckets, chunks of 16;
the fused kernel runs in Triton's interpreter on the CPU), with its recipes and with them replaced by nothing (every
round's rows and outputs kept), in units of one (B, H, N, D) tensor.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from unittest import mock

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


def rounds(kernel: str) -> None:
    import clusterformer.ops.bucketed as bucketed_module
    from clusterformer.bench.memory import TensorMemoryTracker
    from clusterformer.ops import bucketed_attention

    for recipes in (False, True):
        with contextlib.ExitStack() as patches:
            if not recipes:
                patches.enter_context(mock.patch.object(bucketed_module, "attach_recipe",
                                                        lambda tensor, recipe: tensor))
                patches.enter_context(mock.patch.object(bucketed_module, "recompute_saved_all",
                                                        lambda pairs: contextlib.nullcontext()))
            g = torch.Generator().manual_seed(0)
            B, H, N, D, R = 1, 2, 256, 16, 4
            qk = torch.randn(B, H, N, D, dtype=torch.float64, generator=g, requires_grad=True)
            v = torch.randn(B, H, N, D, dtype=torch.float64, generator=g, requires_grad=True)
            buckets = torch.randint(0, 8, (B, H, R, N), generator=g)
            with TensorMemoryTracker() as tracker:
                out = bucketed_attention(qk, v, buckets, 16, num_buckets=8, kernel=kernel)
                gc.collect()
                kept = tracker.current_bytes
                (out * torch.linspace(-1, 1, D, dtype=torch.float64)).sum().backward()
        unit = qk.numel() * qk.element_size()
        print(f"rounds, kernel {kernel}, {'with' if recipes else 'without'} recipes: kept after forward "
              f"{kept / unit:5.2f} units, tensor peak {tracker.peak_bytes / unit:5.2f}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python docs/scripts/kept_memory.py LENGTH NAME[,NAME...]  |  ... rounds fused|sdpa")
    if sys.argv[1] == "rounds":
        rounds(sys.argv[2])
    else:
        main(int(sys.argv[1]), sys.argv[2].split(","))
