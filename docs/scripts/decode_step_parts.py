"""Where cluster retrieval's decoding step spends its time
(docs/long-context-decoding.md#what-a-decoding-step-costs).

One layer of SmolLM2-135M's shape (9 query heads, 3 key/value heads of 64) over a random cache of N keys, called
through the AttentionInterface function as ``clusterformer bench retrieval`` calls it, one thread. Reported:

* the time inside each layer of the call (medians over the steps): the whole function, ``attend_cache``,
  ``retrieval_attention``, the fused kernel's own call, and the index upkeep (``_index``; the joins of 16 keys,
  ``extend_index``, and the first build, ``build_index``, timed per call);
* the kernel alone with cold caches (a 128 MiB buffer written before each call, as a 30-layer model's other layers
  evict a layer's cache), at ``rerank`` 4 and 1 on the same arguments: their difference is the candidates' scoring;
* dense SDPA's time on the same cache, and the bytes each reads, as bandwidths.

    python docs/scripts/decode_step_parts.py --context 8192 --steps 300 [--dense-between]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from typing import Any

import torch
from transformers import AttentionInterface

from clusterformer.attention import retrieval as cache_readers
from clusterformer.bench.retrieval import _attention_module, _Cache
from clusterformer.hf.interface import register_attention
from clusterformer.ops import retrieval as ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--budget", type=float, default=0.1)
    parser.add_argument("--dense-between", action="store_true",
                        help="call dense SDPA between the steps (its 13 MB read at 8k evicts the step's cache lines, "
                             "as a model's other layers do); without it the steps run back to back, as in `bench "
                             "retrieval`, and dense SDPA is timed in a loop of its own afterwards")
    args = parser.parse_args()
    torch.set_num_threads(1)
    B, H, Hkv, D, n = 1, 9, 3, 64, args.context
    times: dict[str, list[float]] = {}

    def timed(owner: Any, attr: str, label: str) -> None:
        function = getattr(owner, attr)

        def wrapper(*a: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            out = function(*a, **kw)
            times.setdefault(label, []).append(time.perf_counter() - start)
            return out

        setattr(owner, attr, wrapper)

    kernel = ops.DECODE_KERNEL.load()
    if kernel is None:
        raise SystemExit(f"the fused decoding step is not built: {ops.DECODE_KERNEL.error}")
    calls: collections.deque[tuple] = collections.deque(maxlen=64)  # the last steps' arguments

    class Recorder:  # the kernel's call, timed, and its arguments kept for the cold-cache timing
        def decode(self, *a: Any) -> torch.Tensor:
            calls.append(a)
            start = time.perf_counter()
            out = kernel.decode(*a)
            times.setdefault("kernel", []).append(time.perf_counter() - start)
            return out

    ops.DECODE_KERNEL._module = Recorder()
    for owner, attr, label in ((cache_readers.CacheReadingAttention, "attend_cache", "attend_cache"),
                               (cache_readers, "retrieval_attention", "retrieval_attention"),
                               (cache_readers.ClusterRetrievalAttention, "_index", "index upkeep (_index)"),
                               (cache_readers, "extend_index", "join of 16 keys (extend_index)"),
                               (cache_readers, "build_index", "build (build_index)")):
        timed(owner, attr, label)
    function = AttentionInterface()[register_attention("cluster-retrieval", name="parts", budget=args.budget)]
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(B, Hkv, n, D, generator=g), torch.randn(B, Hkv, n, D, generator=g)
    module, cache = _attention_module(function, H // Hkv), _Cache()
    dense: list[float] = []
    with torch.no_grad():
        module(torch.randn(B, H, 1, D, generator=g), k, v, cache=_Cache())  # the prefill's call: learns the cache
        times.clear()
        calls.clear()
        for _ in range(args.steps):
            k = torch.cat([k, torch.randn(B, Hkv, 1, D, generator=g)], 2)
            v = torch.cat([v, torch.randn(B, Hkv, 1, D, generator=g)], 2)
            q = torch.randn(B, H, 1, D, generator=g)
            start = time.perf_counter()
            module(q, k, v, cache=cache)
            times.setdefault("the whole call", []).append(time.perf_counter() - start)
            if args.dense_between:
                start = time.perf_counter()
                torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, enable_gqa=True)
                dense.append(time.perf_counter() - start)
        for _ in range(0 if args.dense_between else args.steps):
            q = torch.randn(B, H, 1, D, generator=g)
            start = time.perf_counter()
            torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, enable_gqa=True)
            dense.append(time.perf_counter() - start)
        cold: dict[int, list[float]] = {4: [], 1: []}
        flush = torch.empty(32 << 20)  # 128 MiB
        for i, call in enumerate(calls):
            for rerank in (4, 1) if i % 2 else (1, 4):
                flush.fill_(i)
                start = time.perf_counter()
                kernel.decode(*call[:-2], rerank, call[-1])
                cold[rerank].append(time.perf_counter() - start)
    where = "between the steps" if args.dense_between else "apart"
    print(f"N = {n}, budget {args.budget}, one thread, dense SDPA {where}; medians in ms (calls)")
    for label in ("the whole call", "attend_cache", "retrieval_attention", "kernel", "index upkeep (_index)",
                  "join of 16 keys (extend_index)", "build (build_index)"):
        if label in times:
            print(f"  {label:32s} {statistics.median(times[label]) * 1e3:8.3f}  ({len(times[label])})")
    dense_ms = statistics.median(dense) * 1e3
    scoring = statistics.median(cold[4]) - statistics.median(cold[1])
    candidates = sum(int(r) for r in calls[-1][8][:, 0]) * 4 * Hkv  # rows[b, 0]: keys retrieved per unit
    row = D * k.element_size()
    print(f"  kernel, cold caches, rerank=4     {statistics.median(cold[4]) * 1e3:8.3f}")
    print(f"  kernel, cold caches, rerank=1     {statistics.median(cold[1]) * 1e3:8.3f}")
    print(f"  scoring {candidates} candidate rows ({candidates * row / 1e6:.2f} MB): {scoring * 1e3:.3f} ms, "
          f"{candidates * row / scoring / 1e9:.1f} GB/s")
    print(f"  dense SDPA                        {dense_ms:8.3f}  (keys and values, {2 * k.numel() * 4 / 1e6:.1f} MB: "
          f"{2 * k.numel() * 4 / dense_ms / 1e6:.1f} GB/s)")


if __name__ == "__main__":
    main()
