"""Time per generated token of cached decoding against the context length (issue #15).

For each (mechanism, context N): one attention layer (projections + mechanism, dim = heads * head_dim) in eval
mode prefills a random context of N tokens (``prefill_ms``, one run), then decodes one token at a time with its
cache: ``warmup`` untimed steps, then ``repeats`` timed runs of ``steps`` consecutive steps; ``ms_per_token`` is
the median run's time divided by ``steps`` (the context grows by ``steps`` tokens per run, which is noise next to
N). ``cache_mb``: bytes held by the cache after the prefill (:meth:`clusterformer.ops.decode.DecodeCache.memory_bytes`;
the full KV cache's capacity doubles, so it holds up to 2x the keys it uses). Everything runs in this process,
the mechanisms of one context one after another, so ratios between mechanisms come from the same conditions.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._checks import check_int

__all__ = ["DecodeBenchConfig", "run_decode_benchmark"]


@dataclass
class DecodeBenchConfig:
    names: list[str]
    contexts: list[int]
    batch: int = 1
    heads: int = 4
    head_dim: int = 64
    steps: int = 32
    warmup: int = 8
    repeats: int = 5
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = None
    options: dict[str, dict[str, Any]] = field(default_factory=dict)  # per-mechanism build options
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("batch", "heads", "head_dim", "steps", "repeats"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("warmup", self.warmup, minimum=0)
        for n in self.contexts:
            check_int("contexts entry", n, minimum=1)


def run_decode_benchmark(config: DecodeBenchConfig, progress: Callable[[str], None] | None = None) -> list[dict]:
    """One record per (mechanism, context)."""
    import torch

    from ..attention import build
    from ..attention.registry import make_options

    for name in config.names:  # fail fast on unknown names or options
        make_options(name, config.options.get(name, {}))
    if config.threads:
        torch.set_num_threads(config.threads)
    device, dtype = torch.device(config.device), getattr(torch, config.dtype)
    dim = config.heads * config.head_dim
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    records, total, done = [], len(config.names) * len(config.contexts), 0
    for context in config.contexts:
        for name in config.names:
            done += 1
            torch.manual_seed(config.seed)
            layer = build(name, dim=dim, heads=config.heads, **config.options.get(name, {}))
            layer = layer.to(device=device, dtype=dtype).eval()
            x = torch.randn(config.batch, context, dim, device=device, dtype=dtype)
            tokens = torch.randn(config.warmup + config.repeats * config.steps, config.batch, dim, device=device,
                                 dtype=dtype)
            with torch.no_grad():
                start = time.perf_counter()
                _, cache = layer.prefill(x)
                sync()
                prefill_ms = (time.perf_counter() - start) * 1000
                cache_mb = cache.memory_bytes() / 2**20
                for t in range(config.warmup):
                    _, cache = layer.step(tokens[t], cache)
                runs = []
                for r in range(config.repeats):
                    sync()
                    start = time.perf_counter()
                    for t in range(config.steps):  # decoding is sequential: one step per token
                        _, cache = layer.step(tokens[config.warmup + r * config.steps + t], cache)
                    sync()
                    runs.append((time.perf_counter() - start) * 1000 / config.steps)
            record = {"name": name, "context": context, "batch": config.batch, "heads": config.heads,
                      "head_dim": config.head_dim, "device": str(device), "dtype": config.dtype,
                      "threads": torch.get_num_threads(), "machine": f"{platform.machine()} "
                      f"{torch.get_num_threads()} threads", "options": config.options.get(name, {}),
                      "prefill_ms": prefill_ms, "ms_per_token": statistics.median(runs), "cache_mb": cache_mb,
                      "steps": config.steps, "repeats": config.repeats}
            records.append(record)
            if progress:
                progress(f"[{done}/{total}] {name} context={context}: {record['ms_per_token']:.3f} ms/token, "
                         f"prefill {prefill_ms:.0f} ms, cache {cache_mb:.1f} MiB")
            del layer, cache, x
    return records
