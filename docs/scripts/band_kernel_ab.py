"""cluster-select's kernels, one causal layer's forward and backward, against full attention and against themselves
with other chunk lengths or another build of the library
(docs/speed-and-memory.md#cluster-select-its-kernels-and-its-training-step).

Every entry runs in this one process, interleaved (entry 1, entry 2, ..., full; five times after a warm-up), so the
ratios hold on a shared machine where absolute times do not. ``--chunks`` patches
``clusterformer.ops.selected_band.BAND_CHUNK`` per entry; ``--kernels`` times several of this build's kernels (e.g.
``banded,fused``: the chunk bands against the C++ key lists); ``--other SRC`` also times the
``clusterformer`` importable from SRC (e.g. the ``src`` of a ``git worktree`` at an earlier commit), with its own
defaults.

    OMP_NUM_THREADS=1 python docs/scripts/band_kernel_ab.py --length 4096 --window 512 --clusters 64 --batch 1 \
        --chunks 128,512 [--kernels banded,fused] [--other /path/to/old/src] [--options '{"selection": "bound"}'] \
        [--key-directions 8] [--eval]
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

import torch


def load(src: str | None):
    """The ``clusterformer`` package of ``src`` (None: the one on the path), imported afresh: its attention and
    the module that holds ``BAND_CHUNK`` (ops.selected_band; ops.selected in builds before the split)."""
    for name in [m for m in sys.modules if m == "clusterformer" or m.startswith("clusterformer.")]:
        del sys.modules[name]
    if src is not None:
        sys.path.insert(0, src)
    try:
        attention = importlib.import_module("clusterformer.attention")
        try:
            return attention, importlib.import_module("clusterformer.ops.selected_band")
        except ModuleNotFoundError:
            return attention, importlib.import_module("clusterformer.ops.selected")
    finally:
        if src is not None:
            sys.path.remove(src)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--window", type=int, default=96)
    parser.add_argument("--clusters", type=int, default=64)
    parser.add_argument("--select", type=int, default=4)
    parser.add_argument("--cluster-keys", type=int, default=24)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--chunks", default="", help="comma-separated BAND_CHUNK values (default: the library's)")
    parser.add_argument("--kernels", default="banded", help="comma-separated kernels of this build to time")
    parser.add_argument("--other", default=None, help="the src directory of another build to time as well")
    parser.add_argument("--options", default="{}", help="more cluster-select options as JSON")
    parser.add_argument("--eval", action="store_true", help="time the eval forward (no gradient) instead")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--key-directions", type=int, default=0,
                        help="draw the keys around this many directions (plus noise) so that they fall in that many "
                             "large clusters and every selected cluster fills its cluster_keys, as a trained model's "
                             "token-type clusters do; 0 (default): independent keys, spread over every cluster")
    args = parser.parse_args()

    torch.manual_seed(0)
    B, H, N, D = args.batch, args.heads, args.length, args.head_dim
    q, k, v = (torch.randn(B, H, N, D) for _ in range(3))
    if args.key_directions:
        directions = torch.randn(args.key_directions, D) * 3
        k = directions[torch.randint(0, args.key_directions, (B, H, N))] + k
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    options = {"num_clusters": args.clusters, "select": args.select, "cluster_keys": args.cluster_keys,
               "window": args.window, **json.loads(args.options)}
    kernels = [k for k in args.kernels.split(",") if k]
    entries = {}  # label -> (module, BAND_CHUNK to set or None, the selected module it lives in)
    builds = ([("other", args.other)] if args.other else []) + [("this", None)]
    for build_name, src in builds:
        attention, selected = load(src)
        for kernel in kernels if build_name == "this" else ["banded"]:
            torch.manual_seed(0)  # the same centroids for every kernel
            layer = attention.ClusterSelectAttention(H * D, H, attention.ClusterSelectOptions(**options,
                                                                                             kernel=kernel))
            layer.train(not args.eval)
            chunks = [int(c) for c in args.chunks.split(",") if c] if build_name == "this" else []
            for chunk in chunks or [None]:
                label = build_name + (f" {kernel}" if len(kernels) > 1 else "") + (f" chunk {chunk}" if chunk else "")
                entries[label] = (layer, chunk, selected)
        if build_name == "this":
            entries["full"] = (attention.FullAttention(H * D, H, attention.FullOptions()).train(not args.eval), None,
                               selected)

    def step(label: str) -> float:
        layer, chunk, selected = entries[label]
        default = selected.BAND_CHUNK if hasattr(selected, "BAND_CHUNK") else None
        if chunk is not None:
            selected.BAND_CHUNK = chunk
        start = time.perf_counter()
        if args.eval:
            with torch.no_grad():
                layer(q, k, v, causal=True)
        else:
            layer(q, k, v, causal=True).sum().backward()
        elapsed = time.perf_counter() - start
        if chunk is not None:
            selected.BAND_CHUNK = default
        return elapsed

    for label in entries:
        step(label)
    times: dict[str, list[float]] = {label: [] for label in entries}
    for _ in range(args.repeats):
        for label in entries:
            times[label].append(step(label))
    median = {label: sorted(t)[len(t) // 2] for label, t in times.items()}
    print(f"N={N} window={args.window} clusters={args.clusters} select={args.select}x{args.cluster_keys} "
          f"B={B} H={H} D={D} {args.options}, {'eval forward' if args.eval else 'forward and backward'}, "
          f"threads={torch.get_num_threads()}; median of {args.repeats} (s, x full):")
    for label, t in median.items():
        print(f"  {label:<16} {t:8.3f}  {t / median['full']:5.2f}x")


if __name__ == "__main__":
    main()
