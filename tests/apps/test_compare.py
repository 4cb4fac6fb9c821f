"""``clusterformer compare``: the grid runs, is resumable, and its summary and paired test are right."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from clusterformer._specs import parse_spec, split_specs
from clusterformer.apps.compare import sign_flip_p_value, summary_markdown
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


def _train_flags(root, steps: int = 4) -> list[str]:
    return ["--", "--train-file", str(root / "train.txt"), "--test-file", str(root / "test.txt"), "--limit", "48",
            "--max-steps", str(steps), "--checkpoint-every", "2", "--batch-size", "8", "--dim", "16", "--heads", "2",
            "--depth", "1", "--max-len", "16", "--warmup-steps", "1"]


def test_compare_runs_the_grid_resumes_and_summarises(tmp_path, capsys):
    """The issue's tiny grid: 2 tasks (a classification file, generated ListOps) x 2 mechanisms x 2 seeds, two runs
    at a time; then an interrupted run resumes from its mid-run checkpoint and ends where it would have."""
    _write_task(tmp_path)
    out = tmp_path / "cmp"
    argv = ["compare", "--tasks", "text-classification,listops", "--attention", "full,neural-clustering",
            "--seeds", "0,1", "--jobs", "2", "--out", str(out), *_train_flags(tmp_path)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "[1/8] text-classification full seed0: running" in err and "[8/8] listops neural-clustering seed1" in err
    assert err.count("finished in") == 8
    summary = json.loads((out / "summary.json").read_text())
    for task in ("text-classification", "listops"):
        rows = summary["tasks"][task]["mechanisms"]
        assert set(rows) == {"full", "neural-clustering"}
        for name, row in rows.items():
            scores = [json.loads((out / task / name / f"seed{s}" / "metrics.json").read_text())
                      ["metrics"]["accuracy"] for s in (0, 1)]
            assert row["n"] == 2 and row["mean"] == pytest.approx(sum(scores) / 2)
            assert row["peak_rss_mb"] > 10
        nc, full = rows["neural-clustering"], rows["full"]
        assert nc["vs_full"]["pairs"] == 2
        assert nc["vs_full"]["mean_difference"] == pytest.approx(nc["mean"] - full["mean"])
        assert "vs_full" not in full and "vs_neural-clustering" in full
    markdown = (out / "summary.md").read_text()
    assert "| neural-clustering |" in markdown
    assert "| entry | text-classification (accuracy) | listops (accuracy) | time text-classification |" in markdown
    nc = [summary["tasks"][t]["mechanisms"]["neural-clustering"] for t in ("text-classification", "listops")]
    row = " | ".join([*(f"{r['mean']:.4f} ± {r['std']:.4f}" for r in nc), *(f"{r['time_vs_full']:.2f}" for r in nc)])
    assert f"| neural-clustering | {row} |" in markdown  # the overview row
    runs = [json.loads(p.read_text()) for p in out.glob("*/*/seed*/metrics.json")]
    threads = int(os.environ.get("OMP_NUM_THREADS", max(1, (os.cpu_count() or 1) // 2)))  # --jobs 2 shares the cores
    assert {r["threads"] for r in runs} == {threads}
    assert summary["runs_finished"] == 8 and summary["machines"] == [f"{runs[0]['machine']}, cpu, torch "
                                                                      f"{torch.__version__}, {threads} thread(s)"]
    assert summary["wall_seconds"] == pytest.approx(sum(r["wall_seconds"] for r in runs))
    # interrupt one run after its step-2 checkpoint: its final checkpoint and metrics are gone, the step-2 one is
    # the latest. A finished run is skipped; the interrupted one resumes and reaches the same end, exactly.
    done = out / "listops" / "full" / "seed1"
    stamp = os.path.getmtime(done / "checkpoint.pt")
    cut = out / "text-classification" / "neural-clustering" / "seed1"
    finished = json.loads((cut / "metrics.json").read_text())
    (cut / "metrics.json").unlink()
    os.replace(cut / "checkpoint.prev.pt", cut / "checkpoint.pt")
    assert torch.load(cut / "checkpoint.pt", weights_only=False)["step"] == 2
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "listops full seed1: done, skipped" in err and "neural-clustering seed1: resuming" in err
    assert err.count("resuming") == 1 and err.count("finished in") == 1
    assert os.path.getmtime(done / "checkpoint.pt") == stamp
    resumed = json.loads((cut / "metrics.json").read_text())
    assert resumed["metrics"] == finished["metrics"]
    assert torch.load(cut / "checkpoint.pt", weights_only=False)["step"] == 4


def test_compare_entries_carry_their_options_and_train_flags(tmp_path, capsys):
    """A spec (NAME:key=value) and a --variants label train what they say, under their own labels."""
    _write_task(tmp_path)
    out = tmp_path / "cmp"
    variants = {"nc-no-losses": {"attention": "neural-clustering", "options": {"look_back": 2},
                                 "train_args": ["--clustering-weight", "0", "--centroid-sorting-weight", "0"]}}
    assert main(["compare", "--tasks", "text-classification", "--attention",
                 "full,neural-clustering:grouping=random,look_back=2,nc-no-losses", "--seeds", "0", "--jobs", "2",
                 "--variants", json.dumps(variants), "--out", str(out), *_train_flags(tmp_path, steps=2)]) == 0
    task = out / "text-classification"
    random = json.loads((task / "neural-clustering--grouping-random--look_back-2" / "seed0" / "metrics.json")
                        .read_text())["config"]
    assert random["attention"] == "neural-clustering"
    assert random["attention_options"] == {"grouping": "random", "look_back": 2}
    no_losses = json.loads((task / "nc-no-losses" / "seed0" / "metrics.json").read_text())["config"]
    assert no_losses["attention_options"] == {"look_back": 2}
    assert no_losses["clustering_weight"] == 0 and no_losses["centroid_sorting_weight"] == 0
    assert random["clustering_weight"] > 0
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["tasks"]["text-classification"]["mechanisms"]) == [
        "full", "neural-clustering:grouping=random,look_back=2", "nc-no-losses"]
    assert summary["entries"]["nc-no-losses"]["train_args"] == variants["nc-no-losses"]["train_args"]


def test_compare_replaces_seed_in_train_flags_with_each_runs_seed(tmp_path, capsys):
    """``{seed}`` in a train flag -- the grid's or a variant's -- becomes each run's seed (what lets ``--init
    stage1/seed{seed}`` continue every seed from its own checkpoint)."""
    _write_task(tmp_path)
    out = tmp_path / "cmp"
    flags = _train_flags(tmp_path)
    flags[flags.index("--max-steps") + 1] = "{seed}"  # seed 1 trains 1 step, seed 2 two
    variants = {"short": {"attention": "full", "train_args": ["--warmup-steps", "{seed}"]}}
    assert main(["compare", "--tasks", "text-classification", "--attention", "full,short", "--seeds", "1,2",
                 "--variants", json.dumps(variants), "--out", str(out), *flags]) == 0
    for label in ("full", "short"):
        for seed in (1, 2):
            metrics = json.loads((out / "text-classification" / label / f"seed{seed}" / "metrics.json").read_text())
            assert metrics["steps"] == seed and metrics["config"]["seed"] == seed
            assert metrics["config"]["warmup_steps"] == (seed if label == "short" else 1)


def test_compare_summary_only_summarises_the_finished_runs_and_trains_nothing(tmp_path, capsys):
    """Entries run with different seeds (full with 0, sliding-window with 1): --summary-only over both entries and
    both seeds writes one summary of the two finished runs, and starts no training."""
    _write_task(tmp_path)
    out = tmp_path / "cmp"
    for label, seed in (("full", "0"), ("sliding-window", "1")):
        assert main(["compare", "--tasks", "text-classification", "--attention", label, "--seeds", seed, "--out",
                     str(out), *_train_flags(tmp_path, steps=1)]) == 0
    capsys.readouterr()
    assert main(["compare", "--tasks", "text-classification", "--attention", "full,sliding-window", "--seeds", "0,1",
                 "--summary-only", "--out", str(out), *_train_flags(tmp_path, steps=1)]) == 0
    err = capsys.readouterr().err
    assert err.count("not finished, left out (--summary-only)") == 2 and "running" not in err
    task = out / "text-classification"
    assert not (task / "full" / "seed1").exists() and not (task / "sliding-window" / "seed0").exists()
    rows = json.loads((out / "summary.json").read_text())["tasks"]["text-classification"]["mechanisms"]
    assert {name: (row["n"], list(row["scores"])) for name, row in rows.items()} == {
        "full": (1, ["seed0"]), "sliding-window": (1, ["seed1"])}
    assert "nan" not in (out / "summary.md").read_text()  # no seed in common with full: no paired difference


def test_split_specs_keeps_options_with_their_mechanism():
    assert split_specs("full,neural-clustering:k=4,look_back=2,lsh") == [
        "full", "neural-clustering:k=4,look_back=2", "lsh"]
    assert split_specs("a:x=1,y=2;b:z=3") == ["a:x=1,y=2", "b:z=3"]
    assert parse_spec("neural-clustering:grouping=random,look_back=2,scale=0.5,flag=true") == (
        "neural-clustering", {"grouping": "random", "look_back": 2, "scale": 0.5, "flag": True})
    with pytest.raises(ValueError, match="must be key=value"):
        parse_spec("lsh:oops")


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
        (["--tasks", "mr", "--attention", "full,neural-clustering:nonsense=1"], "unknown option 'nonsense'"),
        (["--tasks", "mr", "--attention", "lsh:num_clusters=0"], "--attention 'lsh:num_clusters=0'"),
        (["--tasks", "mr", "--attention", "nope"], "unknown mechanism 'nope'"),
        (["--tasks", "mr", "--attention", "full,full"], "names a label twice"),
        (["--tasks", "mr", "--variants", '{"v": {"attention": "full"}}'], "does not name: v"),
        (["--tasks", "mr", "--attention", "v", "--variants", '{"v": {"options": {}}}'], "'attention' mechanism"),
        (["--tasks", "mr", "--attention", "v", "--variants",
          '{"v": {"attention": "full", "train_args": ["--seed", "1"]}}'], "--seed are set by compare itself"),
        (["--tasks", "mr", "--attention", "v", "--variants", '{"v": {"attention": "full", "flags": []}}'],
         "unknown fields flags"),
        (["--tasks", "mr", "--jobs", "0"], "--jobs must be a positive int"),
    ):
        with pytest.raises(SystemExit):
            main(["compare", "--out", str(tmp_path / "x"), *argv])
        assert message in capsys.readouterr().err


def _block(metric: str, rows: dict[str, tuple[float, float]]) -> dict:
    return {"metric": metric, "better": "higher", "mechanisms": {
        name: {"mean": mean, "std": 0.01, "time_vs_full": time} for name, (mean, time) in rows.items()}}


def test_summary_markdown_without_full_shows_no_time_ratio():
    """A grid without full (e.g. two neural-clustering variants) has no time ratio: the cell reads "—", not nan."""
    row = {"mean": 0.44, "std": 0.02, "n": 4, "seconds_per_epoch": 158.4, "peak_rss_mb": 2254.0}
    summary = {"units": "seeds", "test": "sign-flip", "runs_finished": 8, "wall_seconds": 3600.0, "machines": [],
               "tasks": {"20news": {"metric": "accuracy", "better": "higher",
                                    "mechanisms": {"neural-clustering": row, "nc-centroid-flow": dict(row)}}}}
    table = [line for line in summary_markdown(summary).splitlines()
             if line.startswith("| nc-centroid-flow | — | — | 0.4400 ± 0.0200 (4)")]  # — : no keys read, mixed
    assert len(table) == 1 and table[0].endswith("| 158.4 | — | 2254 |")
    assert "nan" not in summary_markdown(summary)


def test_summary_markdown_shows_gpu_peak_only_for_gpu_grids():
    """Rows from GPU runs carry the accelerator's peak (host RSS says nothing about it): a column appears for it,
    a CPU row in the same table reads nan there rather than a made-up number, and CPU-only grids have no column."""
    cpu = {"mean": 0.5, "std": 0.0, "n": 2, "seconds_per_epoch": 10.0, "peak_rss_mb": 900.0, "time_vs_full": 1.0}
    gpu = dict(cpu, peak_device_mb=1234.4)
    summary = {"units": "seeds", "test": "sign-flip", "runs_finished": 4, "wall_seconds": 60.0, "machines": [],
               "tasks": {"listops": {"metric": "accuracy", "better": "higher",
                                     "mechanisms": {"full": gpu, "lsh": cpu}}}}
    text = summary_markdown(summary)
    assert "| time vs full | peak RSS MB | peak GPU MB |" in text
    assert "| full | — | — | 0.5000 ± 0.0000 (2) |" in text and "| 900 | 1234 |" in text and "| 900 | nan |" in text
    summary["tasks"]["listops"]["mechanisms"] = {"full": cpu}
    assert "peak GPU MB" not in summary_markdown(summary)


def test_summary_markdown_shows_where_the_needed_key_is_the_largest_weight():
    """Recall-task rows: key recall per layer, and in brackets the share where the needed key outweighs every other
    key of the head when the runs measured it (runs from before that measure show recall alone)."""
    row = {"mean": 0.9, "std": 0.0, "n": 1, "seconds_per_epoch": 10.0, "peak_rss_mb": 900.0,
           "key_recall": {"l0": 1.0, "l1": 0.5}}
    summary = {"units": "seeds", "test": "sign-flip", "runs_finished": 2, "wall_seconds": 60.0, "machines": [],
               "tasks": {"mqar": {"metric": "accuracy", "better": "higher",
                                  "mechanisms": {"old": row, "new": dict(row, key_argmax={"l0": 0.25, "l1": 0.125})}}}}
    text = summary_markdown(summary)
    assert "| key recall (argmax) per layer |" in text
    assert text.count("| 1.00 / 0.50 |") == 1 and "| 1.00 (0.25) / 0.50 (0.12) |" in text


def test_report_grids_joins_comparisons_into_one_table(tmp_path, capsys):
    """Planted summaries: the average covers the accuracy columns only and only full rows; a task present in two
    grids is told apart by the grid's name; times are per column."""
    a = {"tasks": {"20news": _block("accuracy", {"full": (0.50, 1.0), "neural-clustering": (0.40, 0.5)}),
                   "wikiqa": _block("map", {"full": (0.90, 1.0), "neural-clustering": (0.10, 0.8)})}}
    b = {"tasks": {"20news": _block("accuracy", {"full": (0.30, 1.0), "neural-clustering": (0.60, 0.25),
                                                 "lsh": (0.2, 2.0)})}}
    for name, summary in (("short", a), ("long", b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    assert main(["report", "--grids", str(tmp_path / "short"), str(tmp_path / "long" / "summary.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| entry | 20news (short) accuracy | wikiqa map | 20news (long) accuracy | "
                               "avg accuracy (2 columns) |")
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in lines[2:]}
    assert rows["full"][4] == "0.4000" and rows["neural-clustering"][4] == "0.5000"  # MAP not averaged
    assert rows["lsh"][1:5] == ["—", "—", "0.2000 ± 0.0100", "—"]  # no average over a partial row
    assert rows["neural-clustering"][5:] == ["0.50", "0.80", "0.25 |"]
    for argv, message in ((["report", "--grids", str(tmp_path / "nothing")], "neither a comparison directory"),
                          (["report"], "give run directories"),
                          (["report", str(tmp_path), "--grids", str(tmp_path / "long")],
                           "comparison directories only")):
        with pytest.raises(SystemExit):
            main(argv)
        assert message in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit):
        main(["report", "--grids", str(tmp_path / "bad.json")])
    assert "not a comparison summary" in capsys.readouterr().err


def test_compare_refuses_to_add_runs_to_an_entry_trained_under_earlier_defaults(tmp_path, capsys):
    """A finished cluster-select run whose metrics.json records no defaults versions (written before version 2 of
    its defaults) and a seed still to run: one summary row would mix two configurations, so compare refuses before
    training anything, naming the run; --summary-only, or a record of the current defaults, goes on."""
    _write_task(tmp_path)
    out = tmp_path / "cmp"
    argv = ["compare", "--tasks", "text-classification", "--attention", "cluster-select", "--seeds", "0,1",
            "--out", str(out), *_train_flags(tmp_path, steps=1)]
    assert main([*argv[:argv.index("0,1")], "0", *argv[argv.index("0,1") + 1:]]) == 0  # seed 0 alone
    old = out / "text-classification" / "cluster-select" / "seed0"
    record = json.loads((old / "metrics.json").read_text())
    assert record["defaults_versions"]["cluster-select"] == 2
    (old / "metrics.json").write_text(json.dumps({k: v for k, v in record.items() if k != "defaults_versions"}))
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(argv)
    err = capsys.readouterr().err
    assert "seed0 ran cluster-select under its earlier defaults (version 1, now 2)" in err
    assert not (out / "text-classification" / "cluster-select" / "seed1").exists()
    assert main([*argv[:argv.index("--out")], "--summary-only", *argv[argv.index("--out"):]]) == 0
    # a current record of the same entry does not stop it
    (old / "metrics.json").write_text(json.dumps(record))
    assert main(argv) == 0
    assert (out / "text-classification" / "cluster-select" / "seed1" / "metrics.json").is_file()


def test_a_grid_file_runs_the_grid_and_flags_override_it(tmp_path):
    """``--grid FILE`` holds the whole grid (tasks, entries with variants, seeds, the train flags, out); a flag on the
    command line overrides the file (here --seeds, and --attention naming a subset); a bad file is a ValueError naming
    the key."""
    from clusterformer.cli.compare import read_grid

    _write_task(tmp_path)
    out = tmp_path / "cmp"
    grid = {"description": "a tiny grid", "tasks": ["text-classification"], "attention": ["full", "short"],
            "variants": {"short": {"attention": "sliding-window", "options": {"window": 4, "stride": 2}}},
            "seeds": [0, 1, 2], "out": str(out), "train_args": _train_flags(tmp_path, steps=2)[1:]}
    path = tmp_path / "grid.json"
    path.write_text(json.dumps(grid))
    assert main(["compare", "--grid", str(path), "--seeds", "3"]) == 0
    rows = json.loads((out / "summary.json").read_text())["tasks"]["text-classification"]["mechanisms"]
    assert set(rows) == {"full", "short"} and all(row["n"] == 1 for row in rows.values())
    assert (out / "text-classification" / "short" / "seed3" / "metrics.json").exists()
    assert not (out / "text-classification" / "short" / "seed0").exists()
    for subset in ("short", "full"):  # a subset of the grid's entries: the others' definitions are not an error
        assert main(["compare", "--grid", str(path), "--seeds", "3", "--attention", subset]) == 0
        rows = json.loads((out / "summary.json").read_text())["tasks"]["text-classification"]["mechanisms"]
        assert set(rows) == {subset}
    for bad, key in [({"task": ["mr"]}, "unknown key"), ({"variants": []}, "variants"),
                     ({"train_args": "--dim 8"}, "train_args")]:
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=key):
            read_grid(path)
    path.write_text(json.dumps({"attention": ["full"]}))
    with pytest.raises(SystemExit):  # no tasks anywhere: the CLI's clear error
        main(["compare", "--grid", str(path), "--out", str(out)])


GRID_FILES = sorted((Path(__file__).resolve().parents[2] / "grids").glob("*.json"))


@pytest.mark.parametrize("path", GRID_FILES, ids=[p.name for p in GRID_FILES])
def test_the_committed_grid_files_read_and_every_entry_builds(path):
    """Each grid the docs run with one ``compare --grid`` command: it reads, names known tasks, writes under
    results/, and every entry is a registered mechanism or a variant whose options build, at the grid's budget where it
    has one (the options ``for_budget`` adds meet it, in the causal form where the task's model is causal)."""
    from clusterformer.apps.compare import run_shape
    from clusterformer.attention.registry import make_options, names
    from clusterformer.cli.compare import read_grid
    from clusterformer.train.tasks import TASKS

    grid = read_grid(path)
    assert grid["out"].startswith("results/")
    assert all(task in TASKS for task in grid["tasks"])
    shapes = {run_shape(task, grid["train_args"]) for task in grid["tasks"]}
    assert len(shapes) == 1, "one length and causal form per grid"
    ((length, causal),) = shapes
    for label in grid["attention"]:
        variant = grid.get("variants", {}).get(label, {"attention": label, "options": {}})
        assert variant["attention"] in names(), label
        options = dict(variant.get("options", {}))
        if "keys_per_query" in grid:
            try:
                options.update(make_options(variant["attention"], options).for_budget(grid["keys_per_query"], length,
                                                                                       causal))
            except ValueError:  # full: no option sets a budget, and it reads every key
                assert make_options(variant["attention"], options).keys_read(length, causal) == length
            else:
                assert make_options(variant["attention"], options).keys_read(length, causal) <= grid["keys_per_query"]
        make_options(variant["attention"], options)
