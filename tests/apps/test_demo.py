"""The demo's timing: nothing it times holds a first call (a C++ kernel's build, first allocations, the thread pool),
and the untimed warm-up changes nothing the demo reports."""

import time

import pytest

from clusterformer.apps import demo
from clusterformer.apps.demo import DemoConfig
from clusterformer.attention.base import AttentionLayer

TINY = dict(length=40, train_steps=3, batch=2, eval_examples=4, dim=16, bench_lengths=(32,))


def _spy(monkeypatch):
    """Record, in order, every reading of the demo's clock ("clock") and every call of an attention layer ("call")."""
    events = []
    monkeypatch.setattr(demo, "clock", lambda: events.append("clock") or time.perf_counter())
    forward = AttentionLayer.forward

    def spied(self, *args, **kwargs):
        events.append("call")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(AttentionLayer, "forward", spied)
    return events


@pytest.mark.parametrize("name", ["full", "cluster-select"])
def test_training_is_timed_after_the_layers_were_called(monkeypatch, name):
    events = _spy(monkeypatch)
    demo.train_one(name, DemoConfig(**TINY), log=lambda line: None)
    first_clock = events.index("clock")
    assert events[:first_clock] == ["call"] * 2  # the warm-up step: both layers of the model, before the clock


def test_the_benchmark_starts_after_every_layer_was_called(monkeypatch, tmp_path):
    events = _spy(monkeypatch)
    import clusterformer.bench as bench
    import clusterformer.bench.plot as plot

    def benchmark(config, progress):
        events.append("benchmark")
        return [{"name": name, "length": n, "fwd_bwd_ms": 1.0} for name in config.names for n in config.lengths]

    def no_plot(records, path):
        raise RuntimeError("not drawn here")

    monkeypatch.setattr(bench, "run_attention_benchmark", benchmark)
    monkeypatch.setattr(plot, "plot_attention_benchmark", no_plot)
    monkeypatch.setattr(demo, "train_one", lambda name, config, log: {
        "attention": name, "keys_per_query": 1, "accuracy": 1.0, "final_task_loss": 0.0, "train_seconds": 1.0,
        "ms_per_step": 1.0})
    demo.run_demo(tmp_path, DemoConfig(**TINY), log=lambda line: None)
    # every mechanism's layer called in training and in evaluation, all before the benchmark
    assert events[:events.index("benchmark")].count("call") == 2 * 3


@pytest.mark.parametrize("name", ["neural-clustering", "cluster-select"])
def test_the_warm_up_changes_nothing_the_demo_reports(monkeypatch, name):
    """The warm-up runs on a copy: the trained model (its state updates, its generators), the data and the global
    random state are the same with it as without it, so the losses and the accuracy are equal to the bit."""
    config = DemoConfig(**TINY)
    warm = demo.train_one(name, config, log=lambda line: None)
    monkeypatch.setattr(demo, "warm_up", lambda *args: None)
    cold = demo.train_one(name, config, log=lambda line: None)
    assert (warm["final_task_loss"], warm["accuracy"]) == (cold["final_task_loss"], cold["accuracy"])
