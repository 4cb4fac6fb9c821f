"""``clusterformer compare``: the grid runs, is resumable, and its summary and paired test are right."""

from __future__ import annotations

import json
import os

import pytest

from clusterformer.apps.compare import sign_flip_p_value
from clusterformer.cli import main


def test_sign_flip_p_value_is_exact():
    assert sign_flip_p_value([1.0, 2.0, 3.0]) == pytest.approx(2 / 8)  # only all-plus and all-minus reach 6
    assert sign_flip_p_value([1.0, -1.0]) == 1.0
    assert sign_flip_p_value([0.5, 0.4, 0.3, 0.2, 0.1]) == pytest.approx(2 / 32)
    # {+3, -1, +1}: |sum| >= 3 for the patterns with sign(3) fixed and the others giving >= 0: 2 * 3 of 8
    assert sign_flip_p_value([3.0, -1.0, 1.0]) == pytest.approx(6 / 8)


def _write_task(root):
    lines = [f"{i % 2} {'good fine great' if i % 2 else 'bad poor awful'} film number {i}" for i in range(48)]
    (root / "train.txt").write_text("\n".join(lines) + "\n")
    (root / "test.txt").write_text("\n".join(lines[:16]) + "\n")


def test_compare_runs_the_grid_resumes_and_summarises(tmp_path, capsys):
    _write_task(tmp_path)
    out = tmp_path / "cmp"
    train = ["--", "--train-file", str(tmp_path / "train.txt"), "--test-file", str(tmp_path / "test.txt"),
             "--max-steps", "3", "--batch-size", "8", "--dim", "16", "--heads", "2", "--depth", "1",
             "--max-len", "16", "--warmup-steps", "1"]
    argv = ["compare", "--tasks", "text-classification", "--attention", "full,neural-clustering,lsh",
            "--seeds", "0,1", "--out", str(out), "--options", '{"lsh": {"bucket_size": 4}}', *train]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "[1/6] text-classification full seed0: running" in err and "[6/6]" in err
    summary = json.loads((out / "summary.json").read_text())
    rows = summary["tasks"]["text-classification"]["mechanisms"]
    assert set(rows) == {"full", "neural-clustering", "lsh"}
    for name, row in rows.items():
        scores = [json.loads((out / "text-classification" / name / f"seed{s}" / "metrics.json").read_text())
                  ["metrics"]["accuracy"] for s in (0, 1)]
        assert row["n"] == 2 and row["mean"] == pytest.approx(sum(scores) / 2)
        assert row["peak_rss_mb"] > 10
    lsh, full = rows["lsh"], rows["full"]
    assert lsh["vs_full"]["pairs"] == 2
    assert lsh["vs_full"]["mean_difference"] == pytest.approx(lsh["mean"] - full["mean"])
    assert "vs_full" not in full and "vs_neural-clustering" in full
    assert "| lsh |" in (out / "summary.md").read_text()
    # a finished run is skipped; a deleted one runs again; an interrupted one (checkpoint, no metrics) resumes
    done = out / "text-classification" / "lsh" / "seed1"
    stamp = os.path.getmtime(done / "checkpoint.pt")
    (out / "text-classification" / "full" / "seed1" / "metrics.json").unlink()
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "lsh seed1: done, skipped" in err and "full seed1: resuming" in err
    assert os.path.getmtime(done / "checkpoint.pt") == stamp


def test_compare_runs_the_cluster_former_stack(tmp_path, capsys):
    _write_task(tmp_path)
    out = tmp_path / "cmp"
    assert main(["compare", "--tasks", "text-classification", "--attention", "cluster-former-stack", "--seeds", "0",
                 "--out", str(out), "--options", '{"cluster-former-stack": {"window": 8, "stride": 4}}', "--",
                 "--train-file", str(tmp_path / "train.txt"), "--test-file", str(tmp_path / "test.txt"),
                 "--max-steps", "2", "--batch-size", "8", "--dim", "16", "--heads", "2", "--depth", "2",
                 "--max-len", "16"]) == 0
    config = json.loads((out / "text-classification" / "cluster-former-stack" / "seed0" / "metrics.json").read_text())
    assert config["config"]["attention"] == "cluster-former" and config["config"]["cluster_layers"] == [-1]
    assert "cluster-former-stack" in json.loads((out / "summary.json").read_text())["tasks"]["text-classification"][
        "mechanisms"]


def test_compare_rejects_bad_arguments(tmp_path, capsys):
    for argv, message in (
        (["--tasks", "sst2"], "unknown task 'sst2'"),
        (["--tasks", "mr", "--options", '{"lsh": {}}'], "not compared: lsh"),
        (["--tasks", "mr", "--", "--seed", "3"], "--seed are set by compare itself"),
    ):
        with pytest.raises(SystemExit):
            main(["compare", "--out", str(tmp_path / "x"), *argv])
        assert message in capsys.readouterr().err
