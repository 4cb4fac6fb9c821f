"""bench decode's reference steps: sdpa-decode computes full attention's own step, the projections
step is the step without attention, and both are timed and replayed like the mechanisms' steps."""

from __future__ import annotations

import pytest
import torch

from clusterformer.attention import build
from clusterformer.bench import graphs
from clusterformer.bench.decode import DecodeBenchConfig, reference_steps, run_decode_benchmark
from clusterformer.bench.report import decode_table


@pytest.mark.parametrize("batch,context,heads", [(1, 37, 3), (2, 100, 2)])
def test_sdpa_decode_is_full_attentions_step(batch, context, heads):
    torch.manual_seed(11)  # float64: the same computation as full's step, so rounding only
    layer = build("full", dim=heads * 8, heads=heads).double().eval()
    x = torch.randn(batch, context, heads * 8, dtype=torch.float64)
    config = DecodeBenchConfig(names=["full"], contexts=[context], batch=batch, heads=heads, head_dim=8, steps=2,
                               repeats=1, warmup=1, dtype="float64")
    sdpa, projections = reference_steps(layer, x, config, lambda: None)
    assert sdpa["name"] == "sdpa-decode" and projections["name"] == "projections"
    assert sdpa["check"] < 1e-12 and projections["check"] < 1e-12
    assert sdpa["cache_mb"] == pytest.approx(2 * batch * heads * (context + 1) * 8 * 8 / 2**20)
    assert sdpa["ms_per_token"] > 0 and projections["ms_per_token"] > 0 and "ms_per_token_graph" not in sdpa


def test_the_references_run_in_the_benchmark_and_the_report_bounds_the_speed_up(monkeypatch):
    def fake_capture(fn, warmup: int = 3):  # a faithful stand-in graph: replay() runs the captured call again
        out = fn()

        class Replay:
            @staticmethod
            def replay():
                out.copy_(fn())

        return Replay, out

    monkeypatch.setattr(graphs, "capture", fake_capture)
    monkeypatch.setattr("clusterformer.bench.decode.DecodeBenchConfig.__post_init__", lambda self: None)
    config = DecodeBenchConfig(names=["full"], contexts=[48], heads=2, head_dim=8, steps=2, repeats=1, warmup=1,
                               references=True, cuda_graph=True)
    records = run_decode_benchmark(config)
    assert [r["name"] for r in records] == ["sdpa-decode", "projections", "full"]
    sdpa, projections = records[0], records[1]
    assert sdpa["graph_error"] is None and sdpa["graph_check"] < 1e-6 and sdpa["ms_per_token_graph"] > 0
    assert projections["graph_check"] < 1e-6
    table = decode_table(records)
    floor = f"{sdpa['ms_per_token_graph'] / projections['ms_per_token_graph']:.1f}x"
    assert f"At 48 tokens (CUDA graphs): the sdpa-decode step takes {sdpa['ms_per_token_graph']:.3f} ms" in table
    assert f"no mechanism's step can be more than {floor} faster than sdpa-decode's" in table
