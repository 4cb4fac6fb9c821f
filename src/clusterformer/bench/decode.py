"""Time per generated token of cached decoding against the context length
(docs/speed-and-memory.md#decoding-one-token-with-a-cache).

For each (mechanism, context N): one attention layer (projections + mechanism, dim = heads * head_dim) in eval
mode prefills a random context of N tokens (``prefill_ms``, one run), then decodes one token at a time with its
cache: ``warmup`` untimed steps, then ``repeats`` timed runs of ``steps`` consecutive steps; ``ms_per_token`` is
the median run's time divided by ``steps`` (the context grows by ``steps`` tokens per run, which is noise next to
N). With ``cuda_graph`` (CUDA), the step is also captured once in a CUDA graph and replayed (``ms_per_token_graph``,
the token copied into the graph's input buffer counted in), after three replays checked against eager steps on a
copy of the cache (``graph_check``, the largest relative difference of the outputs), or ``graph_error`` where the
step cannot be captured (full's KV cache grows; lsh draws its rotations on the host). ``cache_mb``: bytes held by
the cache after the prefill (:meth:`clusterformer.ops.decode.DecodeCache.memory_bytes`;
the full KV cache's capacity doubles, so it holds up to 2x the keys it uses). Everything runs in this process,
the mechanisms of one context one after another, so ratios between mechanisms come from the same conditions.

With ``references``, two more records per context, timed the same way (:func:`reference_steps`): ``sdpa-decode``,
the step as a flash-decoding kernel runs it (one unmasked ``F.scaled_dot_product_attention`` over exactly the
context's keys: the baseline a decoding speed-up should be measured against, where the library's own full step is a
masked matmul-softmax), and ``projections``, the step without attention: the floor under every mechanism's step at
this shape, since its Q/K/V and output projections are the same whatever the attention reads.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._checks import check_int
from .shape import LayerShape

__all__ = ["REFERENCES", "DecodeBenchConfig", "reference_steps", "run_decode_benchmark"]

REFERENCES = ("sdpa-decode", "projections")  # the reference steps' record names


@dataclass
class DecodeBenchConfig(LayerShape):
    """Cached decoding steps of ``names`` over each of ``contexts`` (cuda_graph: the step replayed)."""

    names: list[str]
    contexts: list[int]
    steps: int = 32
    warmup: int = 8
    repeats: int = 5
    references: bool = False  # also time the sdpa-decode and projections-only steps per context

    def __post_init__(self) -> None:
        for name in ("batch", "heads", "head_dim", "steps", "repeats"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("warmup", self.warmup, minimum=0)
        from .graphs import check_graph_device

        check_graph_device(self.cuda_graph, self.device)
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
    records, done = [], 0
    total = (len(config.names) + (len(REFERENCES) if config.references else 0)) * len(config.contexts)
    for context in config.contexts:
        if config.references:
            torch.manual_seed(config.seed)
            layer = build("full", dim=dim, heads=config.heads).to(device=device, dtype=dtype).eval()
            x = torch.randn(config.batch, context, dim, device=device, dtype=dtype)
            for record in reference_steps(layer, x, config, sync):
                done += 1
                records.append(record)
                if progress:
                    graph = "" if not config.cuda_graph else (
                        f"; CUDA graph: {record['graph_error']}" if record["graph_error"] else
                        f"; CUDA graph {record['ms_per_token_graph']:.3f} ms/token")
                    progress(f"[{done}/{total}] {record['name']} context={context}: "
                             f"{record['ms_per_token']:.3f} ms/token (step vs full's: {record['check']:.1e}){graph}")
            del layer, x
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
                decoding = _Decoding(layer, tokens, cache)
                runs = _time_runs(decoding.step, config, sync)
                cache = decoding.cache
            record = {"name": name, "context": context, "batch": config.batch, "heads": config.heads,
                      "head_dim": config.head_dim, "device": str(device), "dtype": config.dtype,
                      "threads": torch.get_num_threads(), "machine": f"{platform.machine()} "
                      f"{torch.get_num_threads()} threads", "options": config.options.get(name, {}),
                      "prefill_ms": prefill_ms, "ms_per_token": statistics.median(runs), "cache_mb": cache_mb,
                      "steps": config.steps, "repeats": config.repeats}
            if config.cuda_graph:
                with torch.no_grad():
                    record.update(_graph_step(layer, cache, tokens, config, sync))
            records.append(record)
            if progress:
                graph = ("" if not config.cuda_graph else f"; CUDA graph: {record['graph_error']}"
                         if record["graph_error"] else f"; CUDA graph {record['ms_per_token_graph']:.3f} ms/token "
                         f"(replay vs eager {record['graph_check']:.1e})")
                progress(f"[{done}/{total}] {name} context={context}: {record['ms_per_token']:.3f} ms/token, "
                         f"prefill {prefill_ms:.0f} ms, cache {cache_mb:.1f} MiB{graph}")
            del layer, cache, x
    return records


def _graph_step(layer, cache, tokens, config: DecodeBenchConfig, sync) -> dict:
    """The decoding step captured in a CUDA graph (its cache updated in place and, for full attention, reserved to a
    fixed capacity first, as tests/models/test_decoding.py checks for the mechanisms that allow it): three replays
    against eager steps on a copy of the cache, then the median of ``repeats`` runs of ``steps`` replays.
    ``graph_error`` where the capture or the check fails."""
    import copy

    from .graphs import capture, error_line, relative_difference

    result: dict = {"ms_per_token_graph": None, "graph_check": None, "graph_error": None}
    try:
        cache.reserve(6 + config.repeats * config.steps)  # capture warm-up, checks, timed replays: no growth
        static = tokens[0].clone()
        graph, static_out = capture(lambda: layer.step(static, cache)[0])
        twin = copy.deepcopy(cache)  # the same state: eager steps on it, replays on the graph's own cache
        worst = 0.0
        for t in range(3):
            static.copy_(tokens[t])
            graph.replay()
            eager, twin = layer.step(tokens[t], twin)
            sync()
            worst = max(worst, relative_difference(static_out, eager))
        runs = []
        for r in range(config.repeats):
            sync()
            start = time.perf_counter()
            for t in range(config.steps):
                static.copy_(tokens[(r * config.steps + t) % tokens.shape[0]])
                graph.replay()
            sync()
            runs.append((time.perf_counter() - start) * 1000 / config.steps)
        result.update(ms_per_token_graph=statistics.median(runs), graph_check=worst)
    except Exception as error:  # recorded, not raised: the eager numbers stand
        result["graph_error"] = error_line(error)
    return result


def reference_steps(layer, x, config: DecodeBenchConfig, sync) -> list[dict]:
    """The two reference steps at context N = x.shape[1], both with full attention's ``layer`` (its weights):

    * ``sdpa-decode``: the token projected, its key and value written into slot N of a cache holding exactly N + 1
      keys, one unmasked ``F.scaled_dot_product_attention`` over them (CUDA: the flash kernel, which splits the keys
      over the GPU for a single query), the output projected. Every step writes the same slot, so replays need no
      growing state; ``check`` is the largest relative difference of its output from full's own first step after
      the same prefill (the same computation: rounding only).
    * ``projections``: the Q/K/V projection of the token and the output projection of its value, no attention; the
      step of a mechanism that read nothing. ``check``: against that computation done by hand.

    Timed as the mechanisms' steps are (``ms_per_token``; ``ms_per_token_graph`` with ``cuda_graph``)."""
    import torch
    import torch.nn.functional as F

    from .graphs import relative_difference

    B, N, dim = x.shape
    tokens = torch.randn(config.warmup + config.repeats * config.steps, B, dim, device=x.device, dtype=x.dtype)
    with torch.no_grad():
        _, cache = layer.prefill(x)
        _, k, v = layer.qkv(x)
        keys = torch.cat([k, k[:, :, :1]], dim=2)  # (B, H, N + 1, D); slot N is the new token's
        values = torch.cat([v, v[:, :, :1]], dim=2)
        expected, _ = layer.step(tokens[0], cache)  # full's own first step after the prefill
        by_hand = F.linear(layer.qkv(tokens[0].unsqueeze(1))[2].reshape(B, dim), layer.to_out.weight,
                           layer.to_out.bias)

    def sdpa_step(x_t: torch.Tensor) -> torch.Tensor:
        q_t, k_t, v_t = layer.qkv(x_t.unsqueeze(1))  # (B, H, 1, D)
        keys[:, :, N:].copy_(k_t)
        values[:, :, N:].copy_(v_t)
        out = F.scaled_dot_product_attention(q_t, keys, values)
        return layer.to_out(out.reshape(B, dim))

    def projections_step(x_t: torch.Tensor) -> torch.Tensor:
        _, _, v_t = layer.qkv(x_t.unsqueeze(1))
        return layer.to_out(v_t.reshape(B, dim))

    records = []
    for name, step, bytes_read in (("sdpa-decode", sdpa_step, keys.numel() * keys.element_size() * 2),
                                   ("projections", projections_step, 0)):
        with torch.no_grad():
            check = relative_difference(step(tokens[0]), expected if name == "sdpa-decode" else by_hand)
            runs = _time_runs(lambda t, step=step: step(tokens[t]), config, sync)
            record = {"name": name, "reference": True, "context": N, "batch": B, "heads": config.heads,
                      "head_dim": config.head_dim, "device": str(x.device), "dtype": config.dtype,
                      "threads": torch.get_num_threads(), "options": {}, "prefill_ms": None,
                      "ms_per_token": statistics.median(runs), "cache_mb": bytes_read / 2**20, "check": check,
                      "steps": config.steps, "repeats": config.repeats}
            if config.cuda_graph:
                record.update(_graph_replays(step, tokens, config, sync))
        records.append(record)
    return records


class _Decoding:
    """A mechanism's decoding, one token per call: step(t) feeds tokens[t] to the layer and keeps the cache."""

    def __init__(self, layer, tokens, cache) -> None:
        self.layer, self.tokens, self.cache = layer, tokens, cache

    def step(self, t: int) -> None:  # decoding is sequential: one step per token
        _, self.cache = self.layer.step(self.tokens[t], self.cache)


def _time_runs(step: Callable[[int], Any], config: DecodeBenchConfig, sync) -> list[float]:
    """``warmup`` untimed calls step(t), then ``repeats`` timed runs of ``steps`` calls: ms per call of each run."""
    for t in range(config.warmup):
        step(t)
    runs = []
    for r in range(config.repeats):
        sync()
        start = time.perf_counter()
        for t in range(config.steps):
            step(config.warmup + r * config.steps + t)
        sync()
        runs.append((time.perf_counter() - start) * 1000 / config.steps)
    return runs


def _graph_replays(step, tokens, config: DecodeBenchConfig, sync) -> dict:
    """A stateless step (the references') captured once and replayed: the median of ``repeats`` runs of ``steps``
    replays, the token copied into the graph's input counted in; ``graph_check`` compares three replays with eager
    calls. ``graph_error`` where the capture fails."""
    from .graphs import capture, error_line, relative_difference

    result: dict = {"ms_per_token_graph": None, "graph_check": None, "graph_error": None}
    try:
        static = tokens[0].clone()
        graph, static_out = capture(lambda: step(static))
        worst = 0.0
        for t in range(3):
            static.copy_(tokens[t])
            graph.replay()
            sync()
            worst = max(worst, relative_difference(static_out, step(tokens[t])))

        def replay(t: int) -> None:
            static.copy_(tokens[t % tokens.shape[0]])
            graph.replay()

        runs = _time_runs(replay, config, sync)
        result.update(ms_per_token_graph=statistics.median(runs), graph_check=worst)
    except Exception as error:  # recorded, not raised: the eager numbers stand
        result["graph_error"] = error_line(error)
    return result
