"""The fused key-list kernel alone (docs/speed-and-memory.md#cluster-select-its-kernels-and-its-training-step): forward,
and forward with backward, of
:func:`clusterformer.ops.listed_attention.listed_attention` on random lists, medians after a warm-up.

Two shapes by default: the demo's heads (B 16, H 4, N 512, D 16, a window of 64 and 80 listed keys: 144 keys per
query) and MQAR's (B 16, H 2, N 1,024, D 64, a window of 128 and 128 listed keys: 256). To compare two builds of
``ops/csrc/listed_attention.cpp``, run it on each (the extension rebuilds itself when the source changes).

    OMP_NUM_THREADS=1 python docs/scripts/listed_kernel_bench.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import time

import torch

from clusterformer.ops import listed_attention as la

SHAPES = {"demo heads": (16, 4, 512, 16, 64, 80), "MQAR heads": (16, 2, 1024, 64, 128, 128)}  # B, H, N, D, W, M


def bench(B: int, H: int, N: int, D: int, window: int, listed: int, repeats: int) -> tuple[float, float]:
    """Median seconds of the forward, and of the forward with the backward."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, generator=generator).requires_grad_() for _ in range(3))
    index = torch.randint(0, N, (B, H, N, listed), generator=generator)
    forward, both = [], []
    for repeat in range(repeats + 2):  # two warm-ups
        start = time.perf_counter()
        out, _ = la.listed_attention(q, k, v, index, window=window, window_offset=window // 2)
        middle = time.perf_counter()
        out.sum().backward()
        end = time.perf_counter()
        if repeat >= 2:
            forward.append(middle - start)
            both.append(end - start)
    return sorted(forward)[len(forward) // 2], sorted(both)[len(both) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if not la.extension_available():
        raise SystemExit(f"the fused kernel is not built here: {la.extension_error()}")
    print(f"listed_attention, threads={torch.get_num_threads()}, medians of {args.repeats}:")
    for name, (B, H, N, D, window, listed) in SHAPES.items():
        forward, both = bench(B, H, N, D, window, listed, args.repeats)
        print(f"  {name:11s} B={B} H={H} N={N} D={D} window={window} listed={listed}: forward {forward * 1e3:6.1f} ms, "
              f"forward+backward {both * 1e3:6.1f} ms")


if __name__ == "__main__":
    main()
