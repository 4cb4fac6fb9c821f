"""`clusterformer bench retrieval`: the records it writes and their report (no timing is asserted)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from clusterformer.bench.retrieval import RetrievalBenchConfig, run_retrieval_benchmark
from clusterformer.cli import main


def test_records_cover_every_context_and_method(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["bench", "retrieval", "--contexts", "96,160", "--steps", "3", "--budget", "0.5",
                 "--options", '{"clusters": 4, "window": 8}', "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    assert [(r["context"], r["method"]) for r in records] == [
        (n, m) for n in (96, 160) for m in ("dense", "sink-window", "cluster-retrieval")]
    assert all(r["amortized_ms"] > 0 and r["speedup_vs_dense"] > 0 for r in records)
    assert all(r["speedup_vs_dense"] == 1.0 for r in records if r["method"] == "dense")
    # a short answer carries the whole index build: its time per token is the mean step + build / answer tokens
    for r in records:
        spread = r["build_ms"] / 48 if r["method"] == "cluster-retrieval" else 0.0
        assert r["answer_tokens"] == 48
        assert r["answer_ms"] == pytest.approx(r["amortized_ms"] - (r["build_ms"] / r["refresh"] if spread else 0)
                                               + spread, abs=2e-4)
    assert main(["bench", "report", "--json", str(out)]) == 0
    assert "cluster-retrieval" in capsys.readouterr().out


def test_methods_take_options_and_dense_runs_first(tmp_path):
    """Cache readers as NAME:key=value specs, several of one mechanism (the fused step against the composition);
    dense is timed first whatever the order given, so every ratio is to its time."""
    out = tmp_path / "r.json"
    assert main(["bench", "retrieval", "--contexts", "96", "--steps", "2", "--budget", "0.5",
                 "--methods", "cluster-retrieval:kernel=torch;dense;cluster-retrieval:rerank=1;quest",
                 "--options", '{"clusters": 4, "window": 8}', "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    assert [r["method"] for r in records] == ["dense", "cluster-retrieval:kernel=torch", "cluster-retrieval:rerank=1",
                                              "quest"]
    assert [r["refresh"] for r in records] == [None, 4096, 4096, None]  # only cluster retrieval builds an index
    with pytest.raises(ValueError, match="rerank"):
        run_retrieval_benchmark(RetrievalBenchConfig(contexts=[96], steps=1,
                                                     methods=["dense", "cluster-retrieval:rerank=0"]))
    with pytest.raises(ValueError, match="dense takes no options"):
        RetrievalBenchConfig(contexts=[64], methods=["dense:kernel=torch"])


def test_bad_configuration():
    with pytest.raises(ValueError, match="answer_tokens must be >= 1"):
        RetrievalBenchConfig(contexts=[64], answer_tokens=0)
    with pytest.raises(ValueError, match="kv_heads"):
        RetrievalBenchConfig(contexts=[64], heads=9, kv_heads=2)
    with pytest.raises(ValueError, match="methods"):
        run_retrieval_benchmark(RetrievalBenchConfig(contexts=[64], methods=["lsh"]))
