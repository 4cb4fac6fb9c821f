"""The CUDA-graph check (clusterformer.bench.graphs) on CPU, with stand-in graphs: one that recomputes the step into
the captured tensors (what a faithful replay does) and one that replays nothing new (what a graph does with a number
drawn on the host at capture, or a state update it did not record). The check must pass the first and catch the
second wherever the step's result changes from one step to the next. On CUDA the real capture runs in
tests/attention/test_cuda.py."""

from __future__ import annotations

import pytest
import torch

from clusterformer.attention import build
from clusterformer.bench import graphs
from clusterformer.bench.attention import BenchConfig
from clusterformer.bench.graphs import replay_matches_eager, training_step


class _Graph:
    """A stand-in CUDA graph: ``faithful`` replays recompute the step and copy its results into the tensors the
    capture returned (as a graph writes into its own memory); otherwise a replay leaves them as captured."""

    def __init__(self, step, static, tensors, faithful: bool):
        self.step, self.static, self.tensors, self.faithful = step, static, tensors, faithful

    def replay(self) -> None:
        if not self.faithful:
            return
        out = self.step()
        self.static.copy_(out)
        for static, fresh in zip(self.tensors(), self.fresh(), strict=True):
            if static is not None:
                static.copy_(fresh)


def _fake_capture(faithful: bool, layer, x):
    def capture(step, warmup: int = 3):
        for _ in range(warmup):
            step()
        static = step()
        grads = [x.grad, *(p.grad for p in layer.parameters() if p.requires_grad)]
        graph = _Graph(step, static, lambda: grads, faithful)
        graph.fresh = lambda: [x.grad, *(p.grad for p in layer.parameters() if p.requires_grad)]
        return graph, static

    return capture


def _layer_and_input(name: str, seed: int = 0):
    torch.manual_seed(seed)
    options = {  # the random draws must matter: fewer clusters than tokens, more buckets than one chunk spans
        "clustered": {"seed": 3, "num_clusters": 8}, "improved-clustered": {"seed": 3, "num_clusters": 8, "topk": 8},
        "lsh": {"seed": 3, "chunk_size": 8},
    }.get(name, {})
    layer = build(name, dim=32, heads=4, **options)
    x = torch.randn(2, 96, 32, requires_grad=True)
    return layer, x


@pytest.mark.parametrize("name", ["neural-clustering", "kmeans", "clustered", "improved-clustered", "lsh"])
def test_a_faithful_replay_matches_the_eager_steps(monkeypatch, name):
    layer, x = _layer_and_input(name)
    monkeypatch.setattr(graphs, "capture", _fake_capture(True, layer, x))
    check = replay_matches_eager(layer, x)
    assert check == {"output": 0.0, "grads": 0.0, "state": 0.0,  # on CPU the eager step repeats exactly
                     "eager_output": 0.0, "eager_grads": 0.0, "eager_state": 0.0}


@pytest.mark.parametrize(("name", "caught"), [
    ("kmeans", "state"),  # EMA centroids: a replay that does not record the update leaves the state behind
    ("clustered", "output"),  # hash planes drawn in every training forward: a replay must not reuse them
    ("lsh", "output"),  # rotations likewise
])
def test_a_frozen_replay_is_caught(monkeypatch, name, caught):
    layer, x = _layer_and_input(name)
    monkeypatch.setattr(graphs, "capture", _fake_capture(False, layer, x))
    check = replay_matches_eager(layer, x)
    assert check[caught] > 1e-3, check


def test_the_training_step_applies_pending_updates_and_clears_gradients():
    layer, x = _layer_and_input("kmeans")
    before = layer.inner.centroids.clone()
    out = training_step(layer, x)()
    assert not layer.inner.pending  # applied inside the step, so a replay leaves the state the next one reads
    assert not torch.equal(layer.inner.centroids, before)
    assert x.grad is not None and out.shape == x.shape
    first = x.grad.clone()
    training_step(layer, x)()
    assert x.grad.abs().sum() < 1.5 * first.abs().sum()  # the second step's gradient alone, not the sum of two


@pytest.mark.parametrize("name", ["lsh", "clustered", "neural-clustering"])
def test_the_benchmarks_graph_timings_stage_the_draws(monkeypatch, name):
    """bench attention --cuda-graph's own path (``_graph_timings``) with a faithful stand-in graph: the staged eval
    replay gives the unstaged eval output, the training replays the eager steps, and both are timed."""
    from clusterformer.bench import attention as bench_attention
    from clusterformer.bench.attention import _graph_timings

    layer, x = _layer_and_input(name)
    monkeypatch.setattr(graphs, "capture", _fake_capture(True, layer, x))
    timed = []

    def host_median(fn, warmup, repeats, sync, cuda):  # CUDA events have no CPU stand-in: count the calls instead
        for _ in range(warmup + repeats):
            fn()
        timed.append(warmup + repeats)
        return 1.0

    monkeypatch.setattr(bench_attention, "_median_ms", host_median)
    result = _graph_timings({"causal": False}, layer, x, None, 1, 2, lambda: None)
    assert result["graph_error"] is None, result
    assert result["graph_check"] == {"eval_output": 0.0, "output": 0.0, "grads": 0.0, "state": 0.0,
                                     "eager_output": 0.0, "eager_grads": 0.0, "eager_state": 0.0}
    assert timed == [3, 3]  # the eval replay and the training replay


def test_capture_and_the_graph_option_need_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match="capture needs CUDA"):
        graphs.capture(lambda: None)
    with pytest.raises(ValueError, match="cuda_graph needs device='cuda'"):
        BenchConfig(names=["full"], lengths=[64], cuda_graph=True)


def _decode_fixture():
    torch.manual_seed(5)
    layer = build("neural-clustering", dim=24, heads=3, causal_chunk_size=3, causal_clusters=3).eval()
    with torch.no_grad():
        _, cache = layer.prefill(torch.randn(2, 60, 24))
    tokens = torch.randn(12, 2, 24)
    return layer, cache, tokens


class _StepGraph:
    """A stand-in graph of a decoding step: a faithful replay runs the step on the captured cache and writes its
    output into the captured tensor; a frozen one leaves it."""

    def __init__(self, fn, out, faithful):
        self.fn, self.out, self.faithful = fn, out, faithful

    def replay(self):
        if self.faithful:
            self.out.copy_(self.fn())


@pytest.mark.parametrize("faithful", [True, False])
def test_the_decoding_graph_is_checked_against_eager_steps(monkeypatch, faithful):
    from clusterformer.bench.decode import DecodeBenchConfig, _graph_step

    def fake_capture(fn, warmup: int = 3):
        for _ in range(warmup):
            fn()
        out = fn()
        return _StepGraph(fn, out, faithful), out

    monkeypatch.setattr(graphs, "capture", fake_capture)
    layer, cache, tokens = _decode_fixture()
    config = DecodeBenchConfig(names=["neural-clustering"], contexts=[60], steps=3, repeats=2)
    with torch.no_grad():
        result = _graph_step(layer, cache, tokens, config, lambda: None)
    assert result["graph_error"] is None and result["ms_per_token_graph"] > 0
    if faithful:
        assert result["graph_check"] == 0.0
    else:
        assert result["graph_check"] > 1e-3


def test_a_decoding_step_that_cannot_be_captured_is_recorded(monkeypatch):
    from clusterformer.bench.decode import DecodeBenchConfig, _graph_step

    def failing_capture(fn, warmup: int = 3):
        raise RuntimeError("operation not permitted when stream is capturing\nsecond line")

    monkeypatch.setattr(graphs, "capture", failing_capture)
    layer, cache, tokens = _decode_fixture()
    config = DecodeBenchConfig(names=["neural-clustering"], contexts=[60])
    with torch.no_grad():
        result = _graph_step(layer, cache, tokens, config, lambda: None)
    assert result == {"ms_per_token_graph": None, "graph_check": None,
                      "graph_error": "RuntimeError: operation not permitted when stream is capturing second line"}
    with pytest.raises(ValueError, match="cuda_graph needs device='cuda'"):
        DecodeBenchConfig(names=["full"], contexts=[64], cuda_graph=True)


def test_the_reports_show_the_graph_columns():
    from clusterformer.bench.report import attention_table, decode_table

    decode = [{"name": "full", "context": 64, "ms_per_token": 0.5, "prefill_ms": 1.0, "cache_mb": 1.0,
               "ms_per_token_graph": None, "graph_check": None, "graph_error": "RuntimeError: grows"},
              {"name": "neural-clustering", "context": 64, "ms_per_token": 0.9, "prefill_ms": 1.0, "cache_mb": 0.5,
               "ms_per_token_graph": 0.05, "graph_check": 0.0, "graph_error": None}]
    table = decode_table(decode)
    assert "| full | 64 | 0.500 | 1.0x | 1 | 1.00 | not captured: RuntimeError: grows | | |" in table
    assert "| neural-clustering | 64 | 0.900 | 0.6x | 1 | 0.50 | 0.050 | 10.0x | 0.0e+00 |" in table
    layer = [{"name": "full", "length": 64, "fwd_ms": 2.0, "fwd_bwd_ms": 6.0, "peak_mem_mb": 1.0,
              "fwd_graph_ms": 1.0, "fwd_bwd_graph_ms": 4.0, "graph_error": None,
              "graph_check": {"output": 0.0, "grads": 0.0, "state": 0.0, "eager_output": 0.0, "eager_grads": 0.0,
                              "eager_state": 0.0}},
             {"name": "lsh", "length": 64, "fwd_ms": 2.0, "fwd_bwd_ms": 3.0, "peak_mem_mb": 1.0, "fwd_graph_ms": None,
              "fwd_bwd_graph_ms": None, "graph_check": None, "graph_error": "RuntimeError: a\nb"}]
    table = attention_table(layer)
    zeros = "0.0e+00, 0.0e+00, 0.0e+00"
    assert f"| full | 64 | 1.0 | 6.0 | 4.0 | 1.5x | 1.0x | 1.5x | {zeros} | {zeros} |" in table
    assert "| lsh | 64 | - | 3.0 | not captured: RuntimeError: a b | | | | | |" in table  # one line


def test_bench_attention_compiles_the_layer_when_asked(tmp_path, capsys):
    """--compile eager (Dynamo's tracing without a compiler, so any machine runs it): the record says so and times
    the first step; the dispatch-mode tensor tracker stays out of the compiled run."""
    import json

    from clusterformer.bench.attention import BenchConfig
    from clusterformer.cli import main

    out = tmp_path / "compiled.json"
    assert main(["bench", "attention", "--names", "neural-clustering", "--lengths", "64", "--repeats", "1",
                 "--warmup", "0", "--compile", "eager", "--json", str(out)]) == 0
    (record,) = json.loads(out.read_text())
    assert record["compile"] == "eager" and record["first_step_s"] > 0 and record["peak_tensor_mb"] is None
    assert record["fwd_bwd_ms"] > 0
    with pytest.raises(ValueError, match="compile must be one of"):
        BenchConfig(names=["full"], lengths=[64], compile="fast")
    with pytest.raises(ValueError, match="time one at a time"):
        BenchConfig(names=["full"], lengths=[64], device="cuda", compile="default", cuda_graph=True)


@pytest.mark.parametrize("name", ["full", "neural-clustering"])
def test_a_compiled_layer_steps_as_the_plain_one(name):
    """torch.compile (bench attention --compile) traced by Dynamo without a compiler ('eager', so CI runs it): the
    same outputs and gradients, bit for bit, as the uncompiled layer in float64, through the recomputation's hooks
    and recipes. The compiling modes are timed on a GPU (docs/scripts/gpu_checks.sh, stage compile)."""
    results = []
    for compiled in (False, True):
        torch.manual_seed(11)
        layer = build(name, dim=32, heads=4).double().train()
        x = torch.randn(2, 100, 32, dtype=torch.float64, requires_grad=True)
        run = torch.compile(layer, backend="eager") if compiled else layer
        out = run(x)
        out.pow(2).sum().backward()
        results.append((out.detach(), x.grad, [p.grad for p in layer.parameters() if p.grad is not None]))
    (out, grad, params), (out_c, grad_c, params_c) = results
    assert torch.equal(out, out_c) and torch.equal(grad, grad_c)
    assert len(params) == len(params_c) and all(torch.equal(a, b) for a, b in zip(params, params_c, strict=True))
