"""Time and memory of whole attention layers (projections, clustering and attention) against length.

Every (mechanism, length) runs in a fresh Python process so that CPU peak memory can be read from the
kernel (the process's resident-set high-water mark, reset just before the measured pass) without
allocator caches of earlier runs blurring it. On CUDA, ``torch.cuda.max_memory_allocated`` is used.

Timing: ``warmup`` untimed runs, then the median of ``repeats`` timed runs, for
* ``fwd_ms``: forward only, under ``torch.no_grad()`` in eval mode (inference);
* ``fwd_bwd_ms``: forward + backward of ``output.sum()`` in train mode (gradients of the input and all
  parameters), the layer-level training cost;
* ``fwd_bwd_aux_ms``: the same with the layer's auxiliary losses (e.g. clustering L1 and centroid
  sorting L2) added to the backward, as in training with mu = nu = 1; null for mechanisms without any.
``compile``: the layer wrapped in ``torch.compile`` (a mode, or ``"eager"``: Dynamo's tracing alone) before any
run; ``first_step_s`` is the first training step, the compilation included; no ``peak_tensor_mb`` then.
``cuda_graph`` (CUDA only): the same two steps again, each captured once in a CUDA graph and replayed
(:mod:`clusterformer.bench.graphs`), ``fwd_graph_ms`` and ``fwd_bwd_graph_ms`` (the training step there also
applies pending state updates), with ``graph_check``: the largest relative difference between two replays and
two eager steps from one state (output, gradients, state), beside the eager step's own spread (a second eager
run against the first), or ``graph_error`` when the step cannot be captured
(a host round trip, e.g. a shape read from a tensor). The eager numbers come first, so a failed capture keeps them.
Mechanisms that draw random numbers in every forward (lsh, clustered, improved-clustered) run staged there: each
replay's time includes drawing its numbers on the host and copying them into the layer's buffers.
``peak_mem_mb``: peak memory of one forward + backward pass above what was allocated before it
(parameters and input included in the baseline): the resident-set high-water mark on CPU (noisy: tens of MB
between identical runs; never below zero), ``torch.cuda.max_memory_allocated`` on CUDA. ``peak_tensor_mb``: the
most bytes of tensors created by that pass alive at once, counted exactly by
:class:`clusterformer.bench.memory.TensorMemoryTracker` in a separate untimed pass (any device;
deterministic, the number to compare mechanisms by on CPU). ``kept_tensor_mb``: in the same pass, the bytes of
those tensors still alive after the training forward, before the backward: what autograd keeps for the backward,
plus the output (the target is what flash keeps, q, k, v, the output and its log-sum-exp, plus O(N)
integers).

On CUDA, times are CUDA-event intervals (one ``cudaEventSynchronize`` per timed run, no host timers), and
``full`` runs SDPA forced to the FlashAttention backend in float16/bfloat16 (``sdpa_backend`` in the record;
an error, not a silent fallback, if flash cannot run). A configuration that fails (e.g. out of memory) is
recorded with its ``error`` instead of times and the benchmark goes on.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from .._checks import check_float
from .shape import LayerShape

__all__ = ["COMPILE_MODES", "DTYPE_ALIASES", "BenchConfig", "run_attention_benchmark"]

DTYPE_ALIASES = {"fp32": "float32", "fp64": "float64", "bf16": "bfloat16", "fp16": "float16"}
# torch.compile modes the benchmark takes; "eager" is Dynamo's tracing without a compiler (graph breaks show, any
# machine runs it)
COMPILE_MODES = ("eager", "default", "reduce-overhead", "max-autotune-no-cudagraphs")


@dataclass
class BenchConfig(LayerShape):
    """The layers ``names`` at each of ``lengths`` (cuda_graph: the eval forward and the training step replayed)."""

    names: list[str]
    lengths: list[int]
    warmup: int = 1
    repeats: int = 3
    padding: float = 0.0  # right padding, a fraction of N: sequence b padded by padding * N * b / (batch - 1)
    causal: bool = False  # call the layers with causal=True (strict causal chunking: causal_chunk_size, ...)
    compile: str | None = None  # torch.compile the layer: a mode (COMPILE_MODES), or "eager" (Dynamo alone)

    def __post_init__(self) -> None:
        check_float("padding", self.padding, minimum=0.0, maximum=1.0, exclusive_maximum=True)
        if self.compile is not None and self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)} or None; got {self.compile!r}")
        if self.compile is not None and self.cuda_graph:
            raise ValueError("compile and cuda_graph are two ways to remove the host's overhead: time one at a time "
                             "(compile='reduce-overhead' captures CUDA graphs itself)")
        from .graphs import check_graph_device

        check_graph_device(self.cuda_graph, self.device)


def padding_mask(batch: int, length: int, padding: float):
    """The benchmark's key padding mask (B, N), True = padding, or None without padding: sequence b is
    right-padded by round(padding * N * b / (B - 1)) tokens (by padding * N when B = 1)."""
    import torch

    if not padding:
        return None
    share = torch.arange(batch, dtype=torch.float64) / max(batch - 1, 1) if batch > 1 else torch.ones(1)
    pad_len = (padding * length * share).round().long()
    return torch.arange(length) >= (length - pad_len).unsqueeze(1)


def run_attention_benchmark(config: BenchConfig, progress: Callable[[str], None] | None = None) -> list[dict]:
    """Run every (name, length) in its own process; return the list of records."""
    from ..attention.registry import make_options

    for name in config.names:  # fail fast, before any long run, on unknown names or options
        make_options(name, config.options.get(name, {}))
    records = []
    total = len(config.names) * len(config.lengths)
    step = 0
    for length in config.lengths:
        for name in config.names:
            step += 1
            if progress:
                progress(f"[{step}/{total}] {name} N={length} ...")
            job = {**asdict(config), "name": name, "length": length}
            started = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-m", "clusterformer.bench.attention", json.dumps(job)],
                capture_output=True, text=True, check=False,
            )
            if proc.returncode != 0:
                lines = proc.stderr.strip().splitlines() or ["no output"]
                error = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1])
                records.append({"name": name, "length": length, "device": config.device, "dtype": config.dtype,
                                "error": error[-300:]})
                if progress:
                    progress(f"[{step}/{total}] {name} N={length}: FAILED: {error[-300:]}")
                continue
            record = json.loads(proc.stdout.strip().splitlines()[-1])
            records.append(record)
            if progress:
                aux = record["fwd_bwd_aux_ms"]
                progress(
                    f"[{step}/{total}] {name} N={length}: fwd {record['fwd_ms']:.1f} ms, "
                    f"fwd+bwd {record['fwd_bwd_ms']:.1f} ms"
                    + (f" ({aux:.1f} ms with aux losses)" if aux is not None else "")
                    + f", peak {record['peak_mem_mb']:.0f} MB ({time.perf_counter() - started:.0f} s)"
                    + _graph_progress(record)
                )
    return records


def _graph_progress(record: dict) -> str:
    if "graph_error" not in record:
        return ""
    if record["graph_error"]:
        return f"; CUDA graph: {record['graph_error']}"
    check = record["graph_check"]
    return (f"; CUDA graph: fwd {record['fwd_graph_ms']:.2f} ms, fwd+bwd {record['fwd_bwd_graph_ms']:.2f} ms "
            f"(replay vs eager: output {check['output']:.1e}, grads {check['grads']:.1e}, state {check['state']:.1e}; "
            f"eager vs eager: {check['eager_output']:.1e}, {check['eager_grads']:.1e}, {check['eager_state']:.1e})")


def _median_ms(fn: Callable[[], None], warmup: int, repeats: int, sync: Callable[[], None],
               cuda: bool = False) -> float:
    import torch

    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        if cuda:
            start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start_event.record()
            fn()
            end_event.record()
            end_event.synchronize()
            times.append(start_event.elapsed_time(end_event))
        else:
            start = time.perf_counter()
            fn()
            sync()
            times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times)


def _rss_mb(field_name: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, the peak resident set size (Linux >= 4.0)
        return True
    except OSError:
        return False


def _peak_rss_mb(step: Callable[[], object]) -> float:
    """The resident-set high-water mark while ``step()`` runs, above the resident set just before it, in MB (NaN
    where ``/proc`` cannot reset or read it).

    The high-water mark is reset first and the baseline read after, right before the pass: memory the process
    hands back in between (the allocator trimming its heap) then leaves both, where a baseline read before the
    reset would still hold it and the difference could come out below zero. Never negative: the kernel raises the
    stored mark lazily, so a resident set that grew after the reset and fell during the pass can still read below
    the baseline, and a pass cannot use less than nothing.
    """
    if not _reset_peak_rss():
        return float("nan")
    base = _rss_mb("VmRSS")
    step()
    hwm = _rss_mb("VmHWM")
    if base is None or hwm is None:
        return float("nan")
    return max(hwm - base, 0.0)


def _worker(job: dict) -> dict:
    import contextlib

    import torch

    from ..attention import build
    from ..attention.registry import get

    if job["threads"]:
        torch.set_num_threads(job["threads"])
    torch.manual_seed(job["seed"])
    device = torch.device(job["device"])
    dtype = getattr(torch, job["dtype"])
    dim = job["heads"] * job["head_dim"]
    layer = build(job["name"], dim=dim, heads=job["heads"], **job["options"].get(job["name"], {}))
    layer = layer.to(device=device, dtype=dtype)
    if job.get("compile"):  # the module's own attributes (inner, options) stay reachable through the wrapper
        mode = job["compile"]
        layer = torch.compile(layer, backend="eager") if mode == "eager" else torch.compile(
            layer, mode=None if mode == "default" else mode)
    x = torch.randn(job["batch"], job["length"], dim, device=device, dtype=dtype, requires_grad=True)
    pad = padding_mask(job["batch"], job["length"], job["padding"])
    if pad is not None:
        pad = pad.to(device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    backend = contextlib.nullcontext()
    sdpa_backend = None
    if cuda and get(job["name"]).interface_mode == "dense" and dtype in (torch.float16, torch.bfloat16):  # SDPA
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend, sdpa_backend = sdpa_kernel(SDPBackend.FLASH_ATTENTION), "flash"
    with backend:
        return _measure(job, layer, x, pad, device, cuda, sync, sdpa_backend)


def _measure(job, layer, x, pad, device, cuda, sync, sdpa_backend) -> dict:
    import torch

    from ..attention import collect_aux_losses

    def fwd() -> None:
        layer.eval()
        with torch.no_grad():
            layer(x, key_padding_mask=pad, causal=job["causal"])

    def fwd_bwd(with_aux: bool, after_forward: Callable[[], None] | None = None) -> Callable[[], None]:
        def run() -> None:
            layer.train()
            with collect_aux_losses() as aux:
                loss = layer(x, key_padding_mask=pad, causal=job["causal"]).sum()
            if after_forward is not None:
                after_forward()
            if with_aux:
                for value in aux.values():
                    loss = loss + value
            loss.backward()
            x.grad = None
            layer.zero_grad(set_to_none=True)

        return run

    # Peak memory of one training pass, measured first, before timing loops grow allocator caches.
    started = time.perf_counter()
    fwd_bwd(False)()  # build lazy state (kernels, thread pools; the compilation) outside the measured pass
    sync()
    first_step_s = time.perf_counter() - started
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fwd_bwd(False)()
        sync()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak = _peak_rss_mb(fwd_bwd(False))

    # Exact peak of live tensor bytes during one training pass (deterministic; see bench/memory.py). Not under
    # torch.compile: the tracker's dispatch mode would be traced into, or break, the compiled graph.
    from .memory import TensorMemoryTracker

    tracker, kept = None, []
    if not job.get("compile"):
        with TensorMemoryTracker() as tracker:
            fwd_bwd(False, lambda: kept.append(tracker.current_bytes))()
        sync()

    has_aux = bool(layer.inner.aux_losses)
    warmup, repeats = job["warmup"], job["repeats"]
    record = {
        "name": job["name"],
        "length": job["length"],
        "batch": job["batch"],
        "padding": job["padding"],
        "causal": job["causal"],
        "keys_per_query": layer.options.keys_per_query(job["length"], job["causal"]),  # keys read
        "keys_mixed": layer.options.keys_mixed(job["length"], job["causal"]),
        "heads": job["heads"],
        "head_dim": job["head_dim"],
        "device": str(device),
        "dtype": job["dtype"],
        "fwd_ms": _median_ms(fwd, warmup, repeats, sync, cuda),
        "fwd_bwd_ms": _median_ms(fwd_bwd(False), warmup, repeats, sync, cuda),
        "fwd_bwd_aux_ms": _median_ms(fwd_bwd(True), warmup, repeats, sync, cuda) if has_aux else None,
        "peak_mem_mb": peak,
        "peak_tensor_mb": None if tracker is None else tracker.peak_bytes / 2**20,
        "kept_tensor_mb": kept[0] / 2**20 if kept else None,
        "compile": job.get("compile"),
        "first_step_s": first_step_s,
        "sdpa_backend": sdpa_backend,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {os.cpu_count()} logical CPUs"
        + (f", {torch.cuda.get_device_name(device)}" if cuda else ""),
        "warmup": warmup,
        "repeats": repeats,
    }
    if job.get("cuda_graph"):
        record.update(_graph_timings(job, layer, x, pad, warmup, repeats, sync))
    return record


def _graph_timings(job: dict, layer, x, pad, warmup: int, repeats: int, sync) -> dict:
    """The eval forward and the training step replayed from CUDA graphs, and the replay-against-eager check;
    ``graph_error`` instead where the capture or the check fails."""
    import torch

    from ..attention import stage_draws
    from .graphs import capture, error_line, prepare, relative_difference, replay_matches_eager, training_step

    result: dict = {"fwd_graph_ms": None, "fwd_bwd_graph_ms": None, "graph_check": None, "graph_error": None}
    try:
        def fwd() -> torch.Tensor:
            layer.eval()
            with torch.no_grad():
                return layer(x, key_padding_mask=pad, causal=job["causal"])

        eager = fwd().clone()  # unstaged: the reference the staged replay must reproduce
        stage_draws(layer)  # lsh's rotations, clustered's planes: drawn into device buffers before each replay
        graph, static = capture(fwd)
        prepare(layer, training=False)
        graph.replay()
        sync()
        forward_check = relative_difference(static, eager)

        def replay_eval() -> None:  # the host's draw for the step is part of the step's time
            prepare(layer, training=False)
            graph.replay()

        result["fwd_graph_ms"] = _median_ms(replay_eval, warmup, repeats, sync, True)
        del graph, static
        check = replay_matches_eager(layer, x, pad, job["causal"])
        result["graph_check"] = {"eval_output": forward_check, **check}
        graph, _ = capture(training_step(layer, x, pad, job["causal"]))

        def replay_training() -> None:
            prepare(layer, training=True)
            graph.replay()

        result["fwd_bwd_graph_ms"] = _median_ms(replay_training, warmup, repeats, sync, True)
    except Exception as error:  # recorded, not raised: the eager numbers above stand
        result["graph_error"] = error_line(error)
    return result


if __name__ == "__main__":
    print(json.dumps(_worker(json.loads(sys.argv[1]))))
