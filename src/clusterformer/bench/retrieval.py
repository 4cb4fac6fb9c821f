"""Decode attention time per token over a long cache: dense SDPA vs cluster retrieval
(docs/long-context-decoding.md#what-a-decoding-step-costs).

One attention call per generated token, as a decoder layer makes it through ``transformers``' AttentionInterface
(:mod:`clusterformer.hf.interface`; the registered functions themselves are timed, called from an attention module
with the cache as its ``cache`` argument, as a decoder layer calls them): a random cache of N keys
and values in the shapes of SmolLM2-135M (9 query heads, 3 key/value heads, head size 64), grown by one token
per step with ``torch.cat`` as ``DynamicCache`` does (not timed: every method pays it). Per (context, method):

* ``build_ms``: the first step, which builds the key index (K-means of every key/value head; once per prompt).
  An untimed call before it stands for the prefill (on a cache of its own: it leaves no index).
* ``ms_per_token``: median over ``steps`` later steps (keys joining the index in batches included).
* ``amortized_ms``: mean over those steps + ``build_ms / refresh`` (the index is re-clustered every ``refresh``
  keys): the cost per token of retrieval *and* clustering over a long generation.
* ``answer_ms``: mean over those steps + ``build_ms / answer_tokens``: the cost per token of a short answer after a
  long prompt (``longctx`` generates at most 48 tokens), where the index's build is spread over those tokens
  alone; ``answer_speedup_vs_dense`` compares it with dense's.

Methods (``dense``, or a cache reader as ``NAME[:key=value,...]``: ``sink-window``, ``cluster-retrieval``,
``oracle``, ``quest``) run one after another in this process, dense first, so ratios come from the same
conditions; ``options`` apply to every entry whose mechanism keeps a key index (cluster-retrieval), beside its own
(e.g. ``cluster-retrieval:kernel=torch`` against the default fused decoding step).
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._checks import check_int
from .._specs import parse_spec
from ..attention.registry import DENSE, get, names_where

__all__ = ["METHODS", "RetrievalBenchConfig", "run_retrieval_benchmark"]

METHODS = (DENSE, *names_where(kind="cache"))  # dense SDPA and the cache readers


@dataclass
class RetrievalBenchConfig:
    contexts: list[int]
    methods: list[str] = field(default_factory=lambda: [DENSE, "sink-window", "cluster-retrieval"])
    budget: float | int = 0.1
    options: dict[str, Any] = field(default_factory=dict)  # options of the index keepers besides the budget
    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    steps: int = 64
    answer_tokens: int = 48  # the answer a long prompt is read for: the build is spread over these (answer_ms)
    threads: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("heads", "kv_heads", "head_dim", "steps", "answer_tokens"):
            check_int(name, getattr(self, name), minimum=1)
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        for n in self.contexts:
            check_int("contexts entry", n, minimum=16)
        for method in self.methods:
            name, options = parse_spec(method)
            if name not in METHODS:
                raise ValueError(f"methods must be among {', '.join(METHODS)} (cache readers with options as "
                                 f"NAME:key=value,...); got {method!r}")
            if name == DENSE and options:
                raise ValueError(f"dense takes no options; got {method!r}")
        # dense first: the others' ratios are to its time in the same conditions
        self.methods = sorted(self.methods, key=lambda method: method != DENSE)


class _Cache:
    """Stands for the ``transformers`` cache object a decoder passes its attention modules."""


def _attention_module(function: Callable[..., Any] | None, groups: int) -> Any:
    """A module that calls an AttentionInterface function as a decoder's attention module does (its cache as
    ``cache=``)."""
    import torch

    class Attention(torch.nn.Module):
        is_causal = True
        num_key_value_groups = groups

        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: Any = None) -> Any:
            return function(self, q, k, v, None, scaling=q.shape[-1] ** -0.5)

    return Attention()


def run_retrieval_benchmark(config: RetrievalBenchConfig,
                            progress: Callable[[str], None] | None = None) -> list[dict]:
    """One record per (context, method)."""
    import torch
    from transformers import AttentionInterface

    from ..attention.registry import make_options
    from ..hf.interface import register_attention
    from ..ops.retrieval import JOIN_BATCH

    if config.threads:
        torch.set_num_threads(config.threads)
    functions: dict[str, Any] = {}
    refreshes: dict[str, int] = {}
    for number, method in enumerate(config.methods):
        name, inline = parse_spec(method)
        if name == DENSE:
            functions[method] = None
            continue
        indexes = get(name).keeps_index  # an index to build, re-clustered every `refresh` keys
        options = {"budget": config.budget, **(config.options if indexes else {}), **inline}
        registered = register_attention(name, name=f"clusterformer-bench-{number}", **options)
        functions[method] = AttentionInterface()[registered]  # the function transformers will call
        if indexes:
            refreshes[method] = make_options(name, options).refresh
    B, H, Hkv, D = 1, config.heads, config.kv_heads, config.head_dim
    records = []
    for n in config.contexts:
        dense_ms = dense_answer = None
        for method in config.methods:
            g = torch.Generator().manual_seed(config.seed)
            k = torch.randn(B, Hkv, n, D, generator=g)
            v = torch.randn(B, Hkv, n, D, generator=g)
            module = _attention_module(functions[method], H // Hkv)
            cache = _Cache()  # what the function's state is kept with, as transformers' DynamicCache
            times = []
            with torch.no_grad():
                if functions[method] is not None:
                    # untimed: the prefill's call (the interface reads each call's cache from the module's
                    # forward); the index is built at the first timed step and kept with `cache` for the next ones
                    module(torch.randn(B, H, 1, D, generator=g), k, v, cache=_Cache())
                for _ in range(config.steps + 1):
                    k = torch.cat([k, torch.randn(B, Hkv, 1, D, generator=g)], 2)
                    v = torch.cat([v, torch.randn(B, Hkv, 1, D, generator=g)], 2)
                    q = torch.randn(B, H, 1, D, generator=g)
                    start = time.perf_counter()
                    if functions[method] is None:
                        torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, enable_gqa=True)
                    else:
                        module(q, k, v, cache=cache)
                    times.append(time.perf_counter() - start)
            build_ms = times[0] * 1000
            steps = times[1:]
            median = statistics.median(steps) * 1000
            builds = method in refreshes  # the methods with an index to build
            refresh = refreshes.get(method)
            amortized = statistics.fmean(steps) * 1000 + (build_ms / refresh if builds else 0)
            answer = statistics.fmean(steps) * 1000 + (build_ms / config.answer_tokens if builds else 0)
            if method == DENSE:
                dense_ms, dense_answer = amortized, answer
            record = {"context": n, "method": method, "budget": config.budget, "ms_per_token": round(median, 4),
                      "amortized_ms": round(amortized, 4), "build_ms": round(build_ms, 2),
                      "speedup_vs_dense": round(dense_ms / amortized, 3) if dense_ms else None,
                      "answer_tokens": config.answer_tokens, "answer_ms": round(answer, 4),
                      "answer_speedup_vs_dense": round(dense_answer / answer, 3) if dense_ms else None,
                      "join_batch": JOIN_BATCH, "refresh": refresh, "heads": H, "kv_heads": Hkv, "head_dim": D,
                      "threads": torch.get_num_threads(), "torch": torch.__version__,
                      "machine": platform.processor() or platform.machine()}
            records.append(record)
            if progress:
                progress(f"N={n} {method}: {median:.3f} ms/token median, {amortized:.3f} amortized, build "
                         f"{build_ms:.1f} ms" + (f", {record['speedup_vs_dense']:.2f}x dense"
                                                 if record["speedup_vs_dense"] else ""))
    return records


def retrieval_table(records: list[dict]) -> str:
    """Markdown: per context, each method's time per token and its speed-up over dense SDPA."""
    lines = ["| context | method | ms/token (median) | amortized ms/token | vs dense | index build ms | "
             "ms/token over a short answer | vs dense |", "|---|---|---|---|---|---|---|---|"]
    for r in records:
        answer = (f"{r['answer_ms']:.3f} ({r['answer_tokens']} tokens) | {r['answer_speedup_vs_dense']:.2f}x"
                  if "answer_ms" in r else "— | —")  # records written before answer_ms existed
        lines.append(f"| {r['context']} | {r['method']} | {r['ms_per_token']:.3f} | {r['amortized_ms']:.3f} | "
                     f"{r['speedup_vs_dense']:.2f}x | {r['build_ms']:.1f} | {answer} |")
    return "\n".join(lines)
