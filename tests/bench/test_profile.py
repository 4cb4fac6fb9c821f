"""The profiling helper (python -m clusterformer.bench.profile) on CPU at a small size."""

from __future__ import annotations

import pytest

from clusterformer.bench.profile import main, profile


def test_profile_prints_both_modes_with_operator_rows(capsys):
    profile("neural-clustering", 64, "cpu", "float32", heads=2, head_dim=8, warmup=1, rows=5)
    out = capsys.readouterr().out
    assert "== neural-clustering, N=64, float32, eval forward" in out
    assert "== neural-clustering, N=64, float32, training step" in out
    assert out.count("Self CPU time total") == 2
    assert "aten::" in out


def test_profile_cli_rejects_an_unknown_dtype(monkeypatch):
    monkeypatch.setattr("sys.argv", ["profile", "--name", "full", "--dtype", "float7"])
    with pytest.raises(ValueError, match="--dtype"):
        main()
