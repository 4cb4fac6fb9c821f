"""Training: end-to-end runs on small data, exact resume after SIGKILL, two-process DDP, checkpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from clusterformer.cli import main
from clusterformer.train import TrainConfig, load_checkpoint, ranking_metrics, run_training, save_checkpoint
from shared_data import SHARED, needs_data

WORDS = ["good", "great", "fine", "bad", "awful", "poor", "film", "plot", "actor", "the", "a", "very"]


def _write_task(tmp_path: Path, n_train: int = 240, n_test: int = 60) -> tuple[Path, Path]:
    """A small real-format text-classification task: label = whether positive words outnumber negative ones."""
    g = torch.Generator().manual_seed(0)

    def lines(n):
        rows = []
        for _ in range(n):
            words = [WORDS[i] for i in torch.randint(len(WORDS), (int(torch.randint(5, 15, (1,), generator=g)),),
                                                         generator=g)]
            pos = sum(w in WORDS[:3] for w in words) >= sum(w in WORDS[3:6] for w in words)
            rows.append(f"{int(pos)} {' '.join(words)}")
        return "\n".join(rows) + "\n"

    train, test = tmp_path / "train.txt", tmp_path / "test.txt"
    train.write_text(lines(n_train))
    test.write_text(lines(n_test))
    return train, test


def _argv(train, test, out, *extra):
    return ["train", "--task", "text-classification", "--train-file", str(train), "--test-file", str(test),
            "--out", str(out), "--dim", "16", "--depth", "2", "--heads", "2", "--max-len", "16", "--no-progress",
            "--warmup-steps", "5", *extra]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(out)["model"]


def test_train_writes_metrics_logs_and_learns(tmp_path):
    train, test = _write_task(tmp_path)
    out = tmp_path / "run"
    assert main(_argv(train, test, out, "--attention", "neural-clustering", "--epochs", "8", "--batch-size", "16",
                      "--log-every", "5", "--lr", "3e-3")) == 0
    result = json.loads((out / "metrics.json").read_text())
    assert result["steps"] == 8 * (240 // 16) and result["attention"] == "neural-clustering"
    assert result["metrics"]["accuracy"] > 0.75, result["metrics"]  # the rule is learnable from word counts
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 5 and "clustering" in rows[0] and rows[-1]["step"] == result["steps"]
    assert (out / "metrics.csv").read_text().startswith("step,epoch,loss")
    evaluated = json.loads(subprocess.run([sys.executable, "-m", "clusterformer", "eval", "--checkpoint", str(out)],
                                          capture_output=True, text=True, check=True).stdout)
    assert evaluated["metrics"]["accuracy"] == pytest.approx(result["metrics"]["accuracy"])
    # a new run (no --resume) in the same directory starts its logs afresh
    assert main(_argv(train, test, out, "--max-steps", "10", "--batch-size", "16", "--log-every", "5")) == 0
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [5, 10]
    assert len((out / "metrics.csv").read_text().splitlines()) == 3


def test_resume_after_sigkill_matches_an_uninterrupted_run(tmp_path):
    train, test = _write_task(tmp_path, n_train=400)
    common = ["--attention", "lsh", "--attention-options", '{"bucket_size": 4}', "--max-steps", "150",
              "--batch-size", "8", "--checkpoint-every", "5", "--dropout", "0.2"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert main(_argv(train, test, straight, *common)) == 0
    cmd = [sys.executable, "-m", "clusterformer", *_argv(train, test, killed, *common)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (killed / "checkpoint.prev.pt").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run must have been killed mid-way"
    assert not (killed / "metrics.json").exists()
    step = load_checkpoint(killed)["step"]
    assert 0 < step < 150
    assert main(_argv(train, test, killed, *common, "--resume")) == 0
    a, b = _weights(straight), _weights(killed)
    assert a.keys() == b.keys()
    for name in a:
        if torch.is_tensor(a[name]):
            assert torch.equal(a[name], b[name]), name
        elif a[name] is not None:  # an attention layer's generator state (extra state)
            assert torch.equal(a[name]["generator"], b[name]["generator"]), name
    lines = [json.loads(x) for x in (killed / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["step"] == 150


@pytest.mark.parametrize(("attention", "options"), [
    ("routing", '{"window_size": 4, "num_clusters": 3, "decay": 0.5}'),
    ("kmeans", '{"bucket_size": 4, "num_clusters": 3, "decay": 0.5}'),
    ("cluster-former", '{"window": 4, "stride": 2, "num_clusters": 3, "update_every": 4}'),
    ("lsh", '{"bucket_size": 4}'),
    ("neural-clustering", "{}"),
    ("neural-clustering", '{"num_clusters": 3, "cluster_on": "query-key", "centroid_update": "ema", '
     '"centroid_decay": 0.5}'),
    ("neural-clustering", '{"num_clusters": 3, "cluster_on": "query-key", "centroid_update": "ema", '
     '"centroid_decay": 0.5, "head_clusters": "shared"}'),
])
def test_a_crashed_and_resumed_run_equals_an_uninterrupted_one(tmp_path, monkeypatch, attention, options):
    """Every stateful mechanism: a run that crashes at step 23 (checkpoints every 5) and is resumed ends with
    bit-identical weights, buffers and extra state (generators, pending updates), the same final metrics and
    evaluation history, and logs every step exactly once."""
    from clusterformer.train.tasks import ClassificationTask

    train, test = _write_task(tmp_path)
    common = ["--attention", attention, "--attention-options", options, "--max-steps", "30", "--batch-size", "8",
              "--checkpoint-every", "5", "--log-every", "1", "--eval-every", "10", "--dropout", "0.1"]
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    assert main(_argv(train, test, straight, *common)) == 0

    original = ClassificationTask.batch

    def crash_at_23(task, step, *args):
        if step == 23:
            raise RuntimeError("simulated crash")
        return original(task, step, *args)

    monkeypatch.setattr(ClassificationTask, "batch", crash_at_23)
    with pytest.raises(RuntimeError, match="simulated crash"):
        main(_argv(train, test, crashed, *common))
    monkeypatch.setattr(ClassificationTask, "batch", original)
    assert load_checkpoint(crashed)["step"] == 20
    assert main(_argv(train, test, crashed, *common, "--resume")) == 0

    a, b = load_checkpoint(straight)["model"], load_checkpoint(crashed)["model"]
    assert a.keys() == b.keys()
    for name in a:
        if torch.is_tensor(a[name]):
            assert torch.equal(a[name], b[name]), name
        else:  # extra state: generator states and pending updates
            assert (a[name] is None) == (b[name] is None), name
            for key in (a[name] or {}):
                left, right = a[name][key], b[name][key]
                if isinstance(left, dict):
                    assert left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left), name
                else:
                    assert torch.equal(left, right), name
    ma, mb = (json.loads((d / "metrics.json").read_text()) for d in (straight, crashed))
    assert ma["metrics"] == mb["metrics"] and ma["evaluations"] == mb["evaluations"]
    assert [e["step"] for e in mb["evaluations"]] == [10, 20]
    logged = [json.loads(x) for x in (crashed / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in logged if "loss" in r]
    assert train_steps == list(range(1, 31)), "every step logged exactly once"
    straight_rows = [json.loads(x) for x in (straight / "metrics.jsonl").read_text().splitlines()]
    timing = ("examples_per_s", "tokens_per_s", "elapsed_s")
    strip = lambda rows: [{k: v for k, v in r.items() if k not in timing} for r in rows]  # noqa: E731
    assert strip(logged) == strip(straight_rows)
    csv_steps = [line.split(",")[0] for line in (crashed / "metrics.csv").read_text().splitlines()[1:]]
    assert csv_steps == [str(r["step"]) for r in logged]


def test_a_finished_run_continued_to_more_steps_equals_a_longer_run(tmp_path):
    """A run of 20 steps continued to 30 (``--resume`` with a larger ``--max-steps``, constant learning rate) ends
    with the weights, final metrics and evaluation history of a 30-step run: its last step, evaluated as the final
    one of the shorter run, is evaluated again on resume and stays in the history."""
    train, test = _write_task(tmp_path)
    common = ["--attention", "routing", "--attention-options", '{"window_size": 4, "num_clusters": 3}',
              "--batch-size", "8", "--checkpoint-every", "5", "--eval-every", "10", "--schedule", "constant",
              "--dropout", "0.1"]
    longer, continued = tmp_path / "longer", tmp_path / "continued"
    assert main(_argv(train, test, longer, *common, "--max-steps", "30")) == 0
    assert main(_argv(train, test, continued, *common, "--max-steps", "20")) == 0
    assert [e["step"] for e in json.loads((continued / "metrics.json").read_text())["evaluations"]] == [10]
    assert main(_argv(train, test, continued, *common, "--max-steps", "30", "--resume")) == 0
    ma, mb = (json.loads((d / "metrics.json").read_text()) for d in (longer, continued))
    assert [e["step"] for e in mb["evaluations"]] == [10, 20]
    assert ma["metrics"] == mb["metrics"] and ma["evaluations"] == mb["evaluations"]
    a, b = _weights(longer), _weights(continued)
    assert all(torch.equal(a[name], b[name]) for name in a if torch.is_tensor(a[name]))


def test_evaluation_sees_the_last_steps_centroids(tmp_path):
    """The final evaluation (and a checkpoint) holds the centroids after the last step's EMA update, not the
    ones before it: the pending update is applied after each optimiser step."""
    train, test = _write_task(tmp_path)
    out = tmp_path / "run"
    assert main(_argv(train, test, out, "--attention", "routing", "--attention-options",
                      '{"window_size": 4, "num_clusters": 3, "decay": 0.5}', "--max-steps", "6",
                      "--batch-size", "8")) == 0
    state = load_checkpoint(out)["model"]
    pending = [v for k, v in state.items() if k.endswith("_extra_state") and v and "pending" in v]
    assert pending == [], "no update may be left pending in the final checkpoint"


def test_corrupt_checkpoint_is_reported_and_the_previous_one_kept(tmp_path, capsys):
    train, test = _write_task(tmp_path)
    out = tmp_path / "run"
    assert main(_argv(train, test, out, "--max-steps", "10", "--batch-size", "8", "--checkpoint-every", "5")) == 0
    good = (out / "checkpoint.prev.pt").read_bytes()
    data = (out / "checkpoint.pt").read_bytes()
    (out / "checkpoint.pt").write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(SystemExit) as exc:
        main(_argv(train, test, out, "--max-steps", "20", "--batch-size", "8", "--resume"))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "corrupt or truncated" in err and "checkpoint.prev.pt" in err and "Traceback" not in err
    assert (out / "checkpoint.prev.pt").read_bytes() == good
    assert load_checkpoint(out / "checkpoint.prev.pt")["step"] == 5


def test_save_checkpoint_is_atomic_under_failure(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, {"step": 1})

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, {"step": 2})
    assert load_checkpoint(tmp_path)["step"] == 1  # the last good checkpoint survives a failed write


@pytest.mark.parametrize("crash_at", [0, 1, 2])
def test_a_crash_during_save_leaves_a_checkpoint_to_resume_from(tmp_path, monkeypatch, crash_at):
    """A process killed between any two of save_checkpoint's file operations (the previous checkpoint's link,
    its rename, the new one's rename) leaves a complete checkpoint.pt, old or new, which --resume reads; once the
    save completes, checkpoint.prev.pt holds the old one."""
    import clusterformer.train.checkpoint as checkpoint

    save_checkpoint(tmp_path, {"step": 1})
    calls = []
    real_link, real_replace = os.link, os.replace

    def counted(real):
        def operation(*args, **kwargs):
            if len(calls) == crash_at:
                raise KeyboardInterrupt("killed")
            calls.append(real.__name__)
            return real(*args, **kwargs)
        return operation

    monkeypatch.setattr(checkpoint.os, "link", counted(real_link))
    monkeypatch.setattr(checkpoint.os, "replace", counted(real_replace))
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, {"step": 2})
    assert load_checkpoint(tmp_path)["step"] == 1  # the old one: the new one was never renamed into place
    monkeypatch.undo()
    save_checkpoint(tmp_path, {"step": 2})  # the next save cleans up after the interrupted one
    assert load_checkpoint(tmp_path)["step"] == 2
    assert load_checkpoint(tmp_path / "checkpoint.prev.pt")["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.prev.pt", "checkpoint.pt"]


def _write_fixed_length_task(tmp_path: Path, n_train: int = 96, n_test: int = 24, words: int = 10):
    """Like _write_task, but every example has ``words`` words: no padding, so every rank of a distributed run
    holds the same number of real tokens and token-averaged auxiliary losses average exactly over ranks."""
    g = torch.Generator().manual_seed(1)

    def lines(n):
        rows = []
        for _ in range(n):
            picked = [WORDS[i] for i in torch.randint(len(WORDS), (words,), generator=g)]
            rows.append(f"{int(sum(w in WORDS[:3] for w in picked) >= sum(w in WORDS[3:6] for w in picked))} "
                        + " ".join(picked))
        return "\n".join(rows) + "\n"

    train, test = tmp_path / "train.txt", tmp_path / "test.txt"
    train.write_text(lines(n_train))
    test.write_text(lines(n_test))
    return train, test


def _compare_ddp_with_single(single: Path, ddp: Path) -> None:
    result = json.loads((ddp / "metrics.json").read_text())
    assert result["world_size"] == 2
    w0, w1 = result["rank_weight_checksums"]
    assert w0 == w1, "both ranks must end with identical weights"
    b0, b1 = result["rank_buffer_checksums"]
    assert b0 == b1, "both ranks must end with identical buffers (centroids, memory banks)"
    assert result.get("dense_steps") == json.loads((single / "metrics.json").read_text()).get("dense_steps")
    a, b = _weights(single), _weights(ddp)
    for name in a:
        if not torch.is_tensor(a[name]):
            continue
        if name.endswith("attn.to_qkv.bias") and a[name].shape[0] % 3 == 0 and not name.startswith("x"):
            # The key bias shifts every score of a query's row equally: softmax ignores it, so its true gradient
            # is 0 and Adam turns float noise (which differs with the reduction order) into lr-sized steps.
            # Compare the query and value biases only (shared-QK layers have no separate key bias).
            dim = a[name].shape[0] // 3
            a[name] = torch.cat([a[name][:dim], a[name][2 * dim:]])
            b[name] = torch.cat([b[name][:dim], b[name][2 * dim:]])
        if not a[name].is_floating_point():
            assert torch.equal(b[name], a[name]), name
            continue
        torch.testing.assert_close(b[name], a[name], atol=1e-5, rtol=1e-4, msg=name)


def _run_ddp(argv: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "clusterformer", *argv], env=env, capture_output=True, timeout=300, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize(("attention", "options", "extra"), [
    # auxiliary losses on (L1, L2), equal real tokens per rank
    ("neural-clustering", "{}", []),
    # stateful: EMA centroids (all-reduced statistics), commitment loss on
    ("routing", '{"window_size": 4, "num_clusters": 3, "decay": 0.5}', []),
    ("kmeans", '{"bucket_size": 4, "num_clusters": 3, "decay": 0.5}', []),
    ("neural-clustering", '{"num_clusters": 3, "cluster_on": "query-key", "centroid_update": "ema", '
     '"centroid_decay": 0.5}', ["--max-steps", "3"]),  # EMA of the keys' means, summed over ranks (few steps:
    # the centroids follow the keys, and so the key bias, whose float noise Adam makes lr-sized as noted below)
    ("neural-clustering", '{"num_clusters": 3, "cluster_on": "query-key", "centroid_update": "ema", '
     '"centroid_decay": 0.5, "head_clusters": "shared"}', ["--max-steps", "3"]),  # one set for every head
    ("cluster-select", '{"num_clusters": 3, "select": 2, "cluster_keys": 2, "window": 4, "decay": 0.5, '
     '"balance": 0.5}', ["--dense-warmup-steps", "3"]),  # EMA key centroids, balance biases; dense, then selected
    ("cluster-select", '{"num_clusters": 3, "select": 2, "cluster_keys": 2, "window": 4, "decay": 0.5}',
     ["--max-steps", "24", "--dense-warmup-steps", "30", "--dense-warmup-loss", "1e6"]),  # the loss ends it (20)
    # stateful: memory bank gathered from both ranks, centroids recomputed every 3 steps
    ("cluster-former", '{"window": 4, "stride": 2, "num_clusters": 3, "update_every": 3}', []),
    # reversible blocks (nested recompute in the backward) with a stateful mechanism
    ("routing", '{"window_size": 4, "num_clusters": 3, "decay": 0.5}', ["--reversible"]),
    ("neural-clustering", "{}", ["--reversible"]),  # aux losses as outputs of the reversible function
])
def test_two_process_ddp_equals_one_process_with_the_global_batch(tmp_path, attention, options, extra):
    train, test = _write_fixed_length_task(tmp_path)
    common = ["--attention", attention, "--attention-options", options, "--max-steps", "8", "--dropout", "0",
              "--checkpoint-every", "0", "--commitment-weight", "0.1", *extra]
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    assert main(_argv(train, test, single, *common, "--batch-size", "8")) == 0
    _run_ddp(_argv(train, test, ddp, *common, "--batch-size", "4"))
    _compare_ddp_with_single(single, ddp)


def test_two_process_ddp_with_padding_and_aux_losses_off(tmp_path):
    """Sequences of different lengths (padding): exact with the token-averaged aux losses switched off (they
    are averaged per rank, documented)."""
    train, test = _write_task(tmp_path)
    common = ["--attention", "neural-clustering", "--max-steps", "12", "--dropout", "0", "--checkpoint-every", "0",
              "--clustering-weight", "0", "--centroid-sorting-weight", "0"]
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    assert main(_argv(train, test, single, *common, "--batch-size", "8")) == 0
    _run_ddp(_argv(train, test, ddp, *common, "--batch-size", "4"))
    _compare_ddp_with_single(single, ddp)


def test_ranking_metrics_on_a_known_example():
    scores = torch.tensor([0.9, 0.8, 0.1, 0.3, 0.7, 0.2, 0.5])
    labels = torch.tensor([0, 1, 1, 1, 0, 0, 0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2])  # question 2 has no correct answer: filtered out
    m = ranking_metrics(scores, labels, groups)
    # q0: ranks 0.9(0) 0.8(1) 0.1(1): AP = (1/2 + 2/3) / 2, RR = 1/2. q1: 0.7(0) 0.3(1) 0.2(0): AP = 1/2, RR = 1/2.
    assert m["map"] == pytest.approx(((1 / 2 + 2 / 3) / 2 + 1 / 2) / 2)
    assert m["mrr"] == pytest.approx(0.5)


def test_train_config_errors():
    with pytest.raises(ValueError, match="--epochs or --max-steps"):
        TrainConfig(task="mr", out="x")
    with pytest.raises(ValueError, match="task"):
        TrainConfig(task="sst2", out="x", max_steps=1)
    with pytest.raises(ValueError, match="unknown option"):
        TrainConfig(task="mr", out="x", max_steps=1, attention="lsh", attention_options={"num_clusterz": 3})
    with pytest.raises(ValueError, match="it needs reversible"):
        TrainConfig(task="mr", out="x", max_steps=1, tied=True)
    for spec in ({"attention": "cluster-retrieval"}, {"layer_attention": {0: ["sink-window", {}]}}):
        with pytest.raises(ValueError, match="reads its key/value cache"):  # training them would be full attention
            TrainConfig(task="mr", out="x", max_steps=1, **spec)


def test_causal_lm_refuses_non_causal_mechanisms(tmp_path):
    (tmp_path / "tinyshakespeare").mkdir()
    (tmp_path / "tinyshakespeare" / "input.txt").write_text("to be or not to be, that is the question\n" * 40)
    with pytest.raises(ValueError, match="causal"):
        run_training(TrainConfig(task="shakespeare-char", out=str(tmp_path / "o"), attention="clustered",
                                 data_dir=str(tmp_path), max_steps=2, max_len=16, batch_size=2, progress=False))


@needs_data
@pytest.mark.parametrize("task", ["mr", "20news", "imdb", "wikiqa", "shakespeare-char"])
def test_real_task_slices_train_end_to_end(tmp_path, task):
    limit = {"mr": 300, "20news": 6, "imdb": 20, "wikiqa": 300, "shakespeare-char": 20000}[task]
    result = run_training(TrainConfig(task=task, out=str(tmp_path / task), data_dir=str(SHARED), limit=limit,
                                      attention="neural-clustering", max_steps=4, max_len=64, batch_size=8,
                                      dim=16, heads=2, progress=False))
    metric = {"shakespeare-char": "bpc", "wikiqa": "map"}.get(task, "accuracy")
    assert torch.isfinite(torch.tensor(result["metrics"][metric]))
    if task == "wikiqa":
        assert 0 < result["metrics"]["mrr"] <= 1


def test_report_table_and_plot(tmp_path, capsys):
    runs = []
    for attention, acc, seconds in (("full", 0.8, 20.0), ("neural-clustering", 0.79, 15.0)):
        run = tmp_path / attention
        run.mkdir()
        (run / "metrics.json").write_text(json.dumps({
            "task": "mr", "attention": attention, "metrics": {"accuracy": acc}, "epochs": 5.0,
            "seconds_per_epoch": seconds, "train_seconds": 5 * seconds, "wall_seconds": 5 * seconds + 3,
            "device": "cpu", "config": {"out": str(run), "seed": 3,
                                        "attention_options": {"look_back": 2} if attention != "full" else {}}}))
        runs.append(str(run))
    assert main(["report", *runs, "--plot", str(tmp_path / "p.png")]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[2] == "| full | mr | full | 3 | accuracy | 80.00 | 5.00 | 20.0 | 100 | 103 | cpu |"
    assert rows[3].startswith("| neural-clustering | mr | neural-clustering (look_back=2) | 3 | accuracy | 79.00 |")
    assert (tmp_path / "p.png").stat().st_size > 1000
    with pytest.raises(SystemExit):
        main(["report", str(tmp_path / "missing")])


def test_cross_validation_runs_every_fold_and_summarises(tmp_path, capsys):
    """--cv: one run per fold under out/fold-i, a summary with the mean and sample std of the fold accuracies;
    the test folds partition the data."""
    train, _ = _write_task(tmp_path, n_train=100)
    (tmp_path / "mr").mkdir()
    (tmp_path / "mr" / "rt-polarity.all").write_text(train.read_text())
    out = tmp_path / "cv"
    assert main(["train", "--task", "mr", "--cv", "--folds", "3", "--data-dir", str(tmp_path), "--out", str(out),
                 "--dim", "16", "--depth", "1", "--heads", "2", "--max-len", "16", "--no-progress",
                 "--max-steps", "2", "--batch-size", "8", "--attention", "neural-clustering"]) == 0
    summary = json.loads((out / "metrics.json").read_text())
    folds = [json.loads((out / f"fold-{i}" / "metrics.json").read_text()) for i in range(3)]
    accs = [f["metrics"]["accuracy"] for f in folds]
    assert summary["metrics"]["fold_accuracy"] == accs and summary["protocol"] == "3-fold CV"
    assert summary["metrics"]["accuracy"] == pytest.approx(sum(accs) / 3)
    assert summary["metrics"]["accuracy_std"] == pytest.approx(torch.tensor(accs).std().item())
    assert sum(f["metrics"]["test_examples"] for f in folds) == 100
    with pytest.raises(SystemExit):
        main(["train", "--task", "20news", "--cv", "--max-steps", "1", "--data-dir", str(tmp_path),
              "--out", str(tmp_path / "x")])
    assert "--cv is for the sentence tasks" in capsys.readouterr().err


@pytest.mark.parametrize(("attention", "options", "message"), [
    ("cluster-former", {}, "allow-non-strict-causal"),
    ("neural-clustering", {"causal_mode": "paper"}, "allow-non-strict-causal"),
    ("clustered", {}, "cannot be causal"),
])
def test_language_model_refuses_mechanisms_that_are_not_strictly_causal(tmp_path, attention, options, message):
    """A non-strict causal mode sees more than the past, so its bits per character are optimistic."""
    from clusterformer.train import TrainConfig

    with pytest.raises(ValueError, match=message):
        TrainConfig(task="shakespeare-char", attention=attention, attention_options=options, out=str(tmp_path),
                    max_steps=1)
    if message == "allow-non-strict-causal":  # the explicit opt-in is honoured
        config = TrainConfig(task="shakespeare-char", attention=attention, attention_options=options,
                             out=str(tmp_path), max_steps=1, allow_non_strict_causal=True)
        assert config.allow_non_strict_causal
    for strict in ("full", "neural-clustering", "lsh"):
        TrainConfig(task="shakespeare-char", attention=strict, out=str(tmp_path), max_steps=1)


def test_cli_names_the_opt_in_flag(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--task", "shakespeare-char", "--attention", "cluster-former", "--max-steps", "1",
              "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "--allow-non-strict-causal" in capsys.readouterr().err


def test_no_character_gets_the_padding_id(tmp_path):
    """No character gets id 0, the embedding's padding_idx, whose embedding is frozen at zero."""
    from clusterformer.train.tasks import prepare_task

    (tmp_path / "tinyshakespeare").mkdir()
    (tmp_path / "tinyshakespeare" / "input.txt").write_text("\nA b\n" * 30)  # '\n' sorts first
    task = prepare_task("shakespeare-char", data_dir=tmp_path, max_len=8)
    stream = torch.cat([task.train_stream, task.test_stream])
    assert int(stream.min()) >= 1
    assert task.vocab_size == int(stream.max()) + 1 == 5  # '\n', ' ', 'A', 'b' and the padding id


def test_cluster_layers_build_the_cluster_former_stack(tmp_path):
    """--cluster-layers builds the paper's stack: sliding-window layers, Cluster-Former layers where named."""
    from clusterformer.train import TrainConfig
    from clusterformer.train.loop import build_model
    from clusterformer.train.tasks import prepare_task

    train, test = _write_task(tmp_path)
    config = TrainConfig(task="text-classification", out=str(tmp_path / "o"), train_file=str(train),
                         test_file=str(test), max_steps=1, depth=3, dim=16, heads=2, attention="cluster-former",
                         attention_options={"window": 8, "stride": 4, "num_clusters": 3}, cluster_layers=[-1])
    task = prepare_task("text-classification", data_dir=None, max_len=32, train_file=str(train), test_file=str(test))
    model = build_model(config, task)
    inner = [block.attn.inner for block in model.encoder.blocks]
    assert [type(a).__name__ for a in inner] == ["SlidingWindowAttention", "SlidingWindowAttention",
                                                 "ClusterFormerAttention"]
    assert all((a.options.window, a.options.stride) == (8, 4) for a in inner) and inner[2].options.num_clusters == 3
    for bad, message in (({"attention": "sliding-window", "attention_options": {}}, "needs attention='cluster-former'"),
                         ({"cluster_layers": [3]}, "outside depth=3"), ({"cluster_layers": []}, "at least one")):
        with pytest.raises(ValueError, match=message):
            TrainConfig(**{**config.__dict__, **bad})


def test_centroid_lr_scale_scales_only_the_clustering_parameters_update(tmp_path):
    """One AdamW step moves each parameter by lr * (g / |g| + weight decay * p): proportional to its group's lr.
    With --centroid-lr-scale 4 the centroids and W^C move exactly 4x as far, every other weight exactly as far; with
    0 they do not move at all (frozen), the other weights again exactly as far."""
    train, test = _write_task(tmp_path)
    moved = {}
    for scale in ("1", "4", "0"):
        out = tmp_path / f"scale{scale}"
        assert main(_argv(train, test, out, "--attention", "neural-clustering", "--max-steps", "1", "--batch-size",
                          "16", "--dropout", "0", "--centroid-lr-scale", scale)) == 0
        moved[scale] = _weights(out)
    torch.manual_seed(0)  # the initial weights of both runs (build_model after the run's own manual_seed)
    from clusterformer.train.loop import build_model
    from clusterformer.train.tasks import prepare_task

    config = TrainConfig(task="text-classification", out=str(tmp_path / "x"), train_file=str(train),
                         test_file=str(test), max_steps=1, dim=16, depth=2, heads=2, max_len=16,
                         attention="neural-clustering")
    task = prepare_task("text-classification", data_dir=None, max_len=16, train_file=str(train), test_file=str(test))
    initial = build_model(config, task).state_dict()
    clustering = [n for n in initial if n.endswith(("inner.centroids", "inner.to_cluster.weight"))]
    assert len(clustering) == 4
    for name, start in initial.items():
        if not (isinstance(start, torch.Tensor) and start.is_floating_point()):
            continue
        d1, d4 = moved["1"][name] - start, moved["4"][name] - start
        if name in clustering:
            # float32 weights of size ~1 round each delta to ~1e-7: compare the ratio of norms and each entry
            assert d1.abs().max() > 1e-5 and abs(d4.norm() / d1.norm() - 4) < 1e-3, name
            assert torch.allclose(d4, 4 * d1, rtol=1e-2, atol=1e-6), name
            assert torch.equal(moved["0"][name], start), name
        else:
            assert torch.equal(moved["1"][name], moved["4"][name]), name
            assert torch.equal(moved["1"][name], moved["0"][name]), name


def test_centroid_init_kmeans_fits_query_key_centroids_once_before_the_first_step(tmp_path, capsys):
    """--centroid-init kmeans: before the first step of a new run, each query-key layer's centroids become the
    spherical k-means of its keys on the first step's batch -- unit rows per head, not the random init (frozen here
    by --centroid-lr-scale 0, so the checkpoint holds the fit), reported in metrics.json. A resumed run does not fit
    again: with the centroids training, 1 step + resume to 2 equals 2 uninterrupted steps bit for bit. A model
    without a query-key layer is refused, naming the flag."""
    train, test = _write_task(tmp_path)
    qk = ["--attention", "neural-clustering", "--attention-options", '{"num_clusters": 3, "cluster_on": "query-key"}',
          "--batch-size", "16", "--dropout", "0"]
    for name, extra in (("random", []), ("fitted", ["--centroid-init", "kmeans"])):
        assert main(_argv(train, test, tmp_path / name, *qk, "--max-steps", "1", "--centroid-lr-scale", "0",
                          *extra)) == 0
    for block in (0, 1):
        key = f"encoder.blocks.{block}.attn.inner.centroids"
        fitted, random = _weights(tmp_path / "fitted")[key][:3], _weights(tmp_path / "random")[key][:3]
        assert torch.allclose(fitted.view(3, 2, 8).norm(dim=-1), torch.ones(3, 2), atol=1e-6)
        assert not torch.allclose(fitted, random, atol=1e-3)
    report = json.loads((tmp_path / "fitted" / "metrics.json").read_text())["init"]["centroid_init"]
    assert report["layers"] == ["encoder.blocks.0.attn.inner", "encoder.blocks.1.attn.inner"]
    assert report["sequences"] == 16
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert main(_argv(train, test, whole, *qk, "--max-steps", "2", "--centroid-init", "kmeans")) == 0
    assert main(_argv(train, test, split, *qk, "--max-steps", "1", "--centroid-init", "kmeans")) == 0
    assert main(_argv(train, test, split, *qk, "--max-steps", "2", "--centroid-init", "kmeans", "--resume")) == 0
    a, b = _weights(whole), _weights(split)
    assert not torch.equal(a["encoder.blocks.0.attn.inner.centroids"], _weights(tmp_path / "fitted")[
        "encoder.blocks.0.attn.inner.centroids"])  # the centroids did train
    assert all(torch.equal(a[name], b[name]) for name in a if isinstance(a[name], torch.Tensor))
    with pytest.raises(SystemExit) as exc:
        main(_argv(train, test, tmp_path / "bad", "--attention", "neural-clustering", "--max-steps", "1",
                   "--centroid-init", "kmeans"))
    assert exc.value.code == 2 and "centroid_init='kmeans'" in capsys.readouterr().err


def test_centroid_flow_flag_builds_the_papers_flow_and_resume_refuses_a_change(tmp_path, capsys):
    from clusterformer.train.loop import build_model, parameter_groups
    from clusterformer.train.tasks import prepare_task

    train, test = _write_task(tmp_path)
    config = TrainConfig(task="text-classification", out=str(tmp_path / "o"), train_file=str(train),
                         test_file=str(test), max_steps=1, dim=16, depth=3, heads=2, attention="neural-clustering",
                         centroid_flow=True)
    task = prepare_task("text-classification", data_dir=None, max_len=16, train_file=str(train), test_file=str(test))
    model = build_model(config, task)
    owners = [any(n == "centroids" for n, _ in block.attn.inner.named_parameters()) for block in model.encoder.blocks]
    assert owners == [True, False, False]  # layer 1 owns C; later layers start from the flowed C_hat
    assert len(parameter_groups(model, config)) == 1
    for bad, message in (({"attention": "full"}, "needs attention='neural-clustering'"),
                         ({"reversible": True}, "reversible"),
                         ({"centroid_flow": False, "centroid_lr_scale": -1.0}, "centroid_lr_scale must be >= 0"),
                         ({"centroid_flow": False, "centroid_lr_scale": 2.0, "attention": "routing"},
                          "centroid_lr_scale acts on neural-clustering")):
        with pytest.raises(ValueError, match=message):
            TrainConfig(**{**config.__dict__, **bad})
    out = tmp_path / "run"
    assert main(_argv(train, test, out, "--attention", "neural-clustering", "--max-steps", "2", "--batch-size", "16",
                      "--centroid-flow", "--checkpoint-every", "1")) == 0
    assert json.loads((out / "metrics.json").read_text())["config"]["centroid_flow"] is True
    with pytest.raises(SystemExit) as exc:
        main(_argv(train, test, out, "--attention", "neural-clustering", "--max-steps", "3", "--batch-size", "16",
                   "--resume"))
    assert exc.value.code == 2 and "different centroid_flow" in capsys.readouterr().err


def test_layer_attention_builds_a_layer_wise_hybrid_and_resume_refuses_a_change(tmp_path, capsys):
    """--layer-attention puts a named mechanism in the given layers (negative from the last), the others keep
    --attention; bad specs name the flag, a causal task refuses a layer that is not strictly causal, the run
    records the largest budget of its layers, and --resume refuses a different layer_attention."""
    from clusterformer.train.loop import build_model
    from clusterformer.train.tasks import prepare_task

    train, test = _write_task(tmp_path)
    config = TrainConfig(task="text-classification", out=str(tmp_path / "o"), train_file=str(train),
                         test_file=str(test), max_steps=1, dim=16, depth=3, heads=2, attention="routing",
                         layer_attention={"-3": ["sliding-window", {"window": 4, "stride": 2}]})
    assert config.layer_attention == {0: ["sliding-window", {"window": 4, "stride": 2}]}
    task = prepare_task("text-classification", data_dir=None, max_len=16, train_file=str(train), test_file=str(test))
    inner = [block.attn.inner for block in build_model(config, task).encoder.blocks]
    assert [type(a).__name__ for a in inner] == ["SlidingWindowAttention", "RoutingAttention", "RoutingAttention"]
    assert inner[0].options.window == 4
    for bad, message in (({"layer_attention": {"3": ["full", {}]}}, "outside depth=3"),
                         ({"layer_attention": {"x": ["full", {}]}}, "not a layer index"),
                         ({"layer_attention": {"0": "full"}}, r"must be \[name, options\]"),
                         ({"layer_attention": {"0": ["full", {}], "-3": ["full", {}]}}, "twice"),
                         ({"layer_attention": {"0": ["sliding-window", {"window": 0}]}}, r"layer_attention\[0\]"),
                         ({"layer_attention": {"0": ["nope", {}]}}, r"layer_attention\[0\]"),
                         ({"layer_attention": {"0": ["full", {}]}, "centroid_flow": True,
                           "attention": "neural-clustering"}, "cannot be combined")):
        with pytest.raises(ValueError, match=message):
            TrainConfig(**{**config.__dict__, **bad})
    with pytest.raises(ValueError, match=r"layer_attention\[1\].*not strictly causal"):
        TrainConfig(task="mqar", out=str(tmp_path / "c"), max_steps=1, attention="full",
                    layer_attention={"1": ["neural-clustering", {"causal_mode": "paper"}]})
    out = tmp_path / "run"
    spec = json.dumps({"0": ["sliding-window", {"window": 4, "stride": 2}]})
    assert main(_argv(train, test, out, "--attention", "full", "--max-steps", "2", "--batch-size", "16",
                      "--layer-attention", spec, "--checkpoint-every", "1")) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["keys_per_query"] == 16  # the full layer's, the largest
    assert main(_argv(train, test, out, "--attention", "full", "--max-steps", "3", "--batch-size", "16",
                      "--layer-attention", spec, "--resume")) == 0  # the same spec resumes
    with pytest.raises(SystemExit) as exc:
        main(_argv(train, test, out, "--attention", "full", "--max-steps", "4", "--batch-size", "16", "--resume"))
    assert exc.value.code == 2 and "different layer_attention" in capsys.readouterr().err


def test_dense_warmup_steps_attend_densely_in_the_first_training_steps_only(tmp_path, monkeypatch, capsys):
    """--dense-warmup-steps N: the first N training forwards of every neural-clustering layer attend to every key,
    the later ones and every evaluation to the clusters; a model without neural-clustering refuses the flag, and
    --resume refuses a different N."""
    from clusterformer.attention import NeuralClusteringAttention

    seen = []  # (training, dense) of each neural-clustering forward
    attend = NeuralClusteringAttention._attend

    def spy(self, *args, dense=False):
        seen.append((self.training, dense))
        return attend(self, *args, dense=dense)

    monkeypatch.setattr(NeuralClusteringAttention, "_attend", spy)
    train, test = _write_task(tmp_path)
    out = tmp_path / "run"
    assert main(_argv(train, test, out, "--attention", "neural-clustering", "--max-steps", "5", "--batch-size", "16",
                      "--dense-warmup-steps", "3", "--eval-every", "2", "--checkpoint-every", "1")) == 0
    trained = [dense for training, dense in seen if training]
    assert trained == [True] * 6 + [False] * 4  # two layers: steps 1-3 dense, 4-5 clustered
    assert not any(dense for training, dense in seen if not training)
    with pytest.raises(ValueError, match="dense_warmup_steps"):
        TrainConfig(task="mr", out="x", max_steps=1, dense_warmup_steps=-1)
    with pytest.raises(SystemExit) as exc:
        main(_argv(train, test, tmp_path / "full", "--attention", "full", "--max-steps", "1",
                   "--dense-warmup-steps", "1"))
    assert exc.value.code == 2 and "dense_warmup_steps" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(_argv(train, test, out, "--attention", "neural-clustering", "--max-steps", "6", "--batch-size", "16",
                   "--dense-warmup-steps", "4", "--resume"))
    assert exc.value.code == 2 and "different dense_warmup_steps" in capsys.readouterr().err
    from clusterformer.attention import ClusterSelectAttention  # the other mechanism with a dense warm-up

    seen.clear()
    monkeypatch.setattr(ClusterSelectAttention, "forward", lambda self, *a, **k: seen.append(
        (self.training, self.dense_training)) or a[0])
    assert main(_argv(train, test, tmp_path / "select", "--attention", "cluster-select", "--max-steps", "3",
                      "--batch-size", "16", "--dense-warmup-steps", "2")) == 0
    assert [dense for training, dense in seen if training] == [True, True, True, True, False, False]


def test_dense_warmup_loss_ends_the_warm_up_once_the_loss_is_below_it(tmp_path, monkeypatch, capsys):
    """--dense-warmup-loss X (window of 2 steps here): the warm-up ends after the first step whose windowed task
    loss is below X; a threshold never reached leaves the --dense-warmup-steps cap; a run interrupted inside the
    window resumes to the same switch and the same weights; the flag needs the cap, and --resume refuses another X."""
    from clusterformer.attention import ClusterSelectAttention
    from clusterformer.train import loop

    monkeypatch.setattr(loop, "DENSE_WARMUP_WINDOW", 2)
    seen = []
    forward = ClusterSelectAttention.forward

    def spy(self, *args, **kwargs):
        seen.append((self.training, self.dense_training))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(ClusterSelectAttention, "forward", spy)
    train, test = _write_task(tmp_path)

    def trained(out, *flags):
        seen.clear()
        assert main(_argv(train, test, out, "--attention", "cluster-select", "--batch-size", "16", *flags)) == 0
        return [dense for training, dense in seen if training], json.loads((out / "metrics.json").read_text())

    # any loss is below 1e6: the window fills after step 2, which ends the warm-up (two layers per step)
    dense, reached = trained(tmp_path / "reached", "--max-steps", "5", "--dense-warmup-steps", "4",
                             "--dense-warmup-loss", "1e6")
    assert dense == [True] * 4 + [False] * 6 and reached["dense_steps"] == 2
    dense, capped = trained(tmp_path / "capped", "--max-steps", "5", "--dense-warmup-steps", "3",
                            "--dense-warmup-loss", "1e-9")
    assert dense == [True] * 6 + [False] * 4 and capped["dense_steps"] == 3
    out = tmp_path / "resumed"
    trained(out, "--max-steps", "1", "--dense-warmup-steps", "4", "--dense-warmup-loss", "1e6",
            "--checkpoint-every", "1")
    dense, resumed = trained(out, "--max-steps", "5", "--dense-warmup-steps", "4", "--dense-warmup-loss", "1e6",
                             "--resume")
    assert dense == [True] * 2 + [False] * 6 and resumed["dense_steps"] == 2  # step 2 dense, then sparse
    assert resumed["rank_weight_checksums"] == reached["rank_weight_checksums"]
    out = tmp_path / "resumed-after"  # interrupted after the switch: it stays sparse
    trained(out, "--max-steps", "3", "--dense-warmup-steps", "4", "--dense-warmup-loss", "1e6",
            "--checkpoint-every", "1")
    dense, resumed = trained(out, "--max-steps", "5", "--dense-warmup-steps", "4", "--dense-warmup-loss", "1e6",
                             "--resume")
    assert dense == [False] * 4 and resumed["dense_steps"] == 2
    assert resumed["rank_weight_checksums"] == reached["rank_weight_checksums"]
    with pytest.raises(ValueError, match="dense_warmup_loss ends a dense warm-up early"):
        TrainConfig(task="mr", out="x", max_steps=1, dense_warmup_loss=0.5)
    with pytest.raises(ValueError, match="dense_warmup_loss"):
        TrainConfig(task="mr", out="x", max_steps=1, dense_warmup_steps=2, dense_warmup_loss=0.0)
    with pytest.raises(SystemExit) as exc:
        main(_argv(train, test, out, "--attention", "cluster-select", "--batch-size", "16", "--max-steps", "6",
                   "--dense-warmup-steps", "4", "--dense-warmup-loss", "0.5", "--resume"))
    assert exc.value.code == 2 and "different dense_warmup_loss" in capsys.readouterr().err


def test_tokenizer_from_takes_another_runs_vocabulary_and_none_of_its_weights(tmp_path, capsys):
    """--tokenizer-from PATH: the run tokenizes with the checkpoint's saved tokenizer (fitted on another training
    file), not one fitted on its own; its weights start fresh (the from-scratch control of a pretraining claim)."""
    first = tmp_path / "first"
    first.mkdir()
    train_a, test_a = _write_task(first)
    source = tmp_path / "source"
    assert main(_argv(train_a, test_a, source, "--max-steps", "1", "--batch-size", "16")) == 0
    train_b, test_b = tmp_path / "train_b.txt", tmp_path / "test_b.txt"  # words the source never saw
    train_b.write_text("".join(f"{i % 2} story movie scene {WORDS[i % len(WORDS)]}\n" for i in range(64)))
    test_b.write_text("".join(f"{i % 2} story movie {WORDS[i % len(WORDS)]}\n" for i in range(16)))
    own, borrowed = tmp_path / "own", tmp_path / "borrowed"
    assert main(_argv(train_b, test_b, own, "--max-steps", "1", "--batch-size", "16")) == 0
    assert main(_argv(train_b, test_b, borrowed, "--max-steps", "1", "--batch-size", "16",
                      "--tokenizer-from", str(source))) == 0
    saved = {name: load_checkpoint(out) for name, out in (("source", source), ("own", own), ("borrowed", borrowed))}
    assert saved["borrowed"]["tokenizer"] == saved["source"]["tokenizer"] != saved["own"]["tokenizer"]
    assert "story" in saved["own"]["tokenizer"] and "story" not in saved["source"]["tokenizer"]
    from clusterformer.train.loop import _set_up  # the run as built, before its first step: fresh weights
    run = _set_up(TrainConfig(task="text-classification", out=str(tmp_path / "built"), train_file=str(train_b),
                              test_file=str(test_b), max_steps=1, dim=16, depth=2, heads=2, max_len=16,
                              tokenizer_from=str(source)), None)
    trained, fresh = saved["source"]["model"], run.model.state_dict()
    compared = [k for k, v in trained.items() if isinstance(v, torch.Tensor) and v.is_floating_point() and v.std() > 0]
    assert trained.keys() == fresh.keys() and len(compared) > 10
    assert not any(torch.equal(trained[k], fresh[k]) for k in compared)  # source's weights: one step further
    assert "init" not in json.loads((borrowed / "metrics.json").read_text())
    with pytest.raises(SystemExit) as exc:
        main(_argv(train_b, test_b, tmp_path / "bad", "--max-steps", "1", "--tokenizer-from", str(tmp_path)))
    assert exc.value.code == 2 and "tokenizer_from must be a checkpoint" in capsys.readouterr().err


def test_centroid_lr_scale_applies_when_fine_tuning_from_a_checkpoint(tmp_path):
    """--init PATH builds the same neural-clustering layers: their centroids and W^C take their own rate (the
    checkpoint's values loaded); a pretrained model of clusterformer.hf, which owns its layers, is refused."""
    from clusterformer.train.loop import _set_up

    train, test = _write_task(tmp_path)
    source = tmp_path / "source"
    assert main(_argv(train, test, source, "--attention", "neural-clustering", "--max-steps", "1", "--batch-size",
                      "16")) == 0
    common = dict(task="text-classification", train_file=str(train), test_file=str(test), max_steps=1, dim=16,
                  depth=2, heads=2, max_len=16, attention="neural-clustering", init=str(source), lr=1e-3)
    run = _set_up(TrainConfig(out=str(tmp_path / "tuned"), centroid_lr_scale=0.1, **common), None)
    groups = run.optimizer.param_groups
    assert len(groups) == 2 and groups[1]["lr"] == pytest.approx(0.1 * groups[0]["lr"]) and groups[0]["lr"] > 0
    clustering = {id(p) for p in groups[1]["params"]}
    named = dict(run.model.named_parameters())
    assert {n for n, p in named.items() if id(p) in clustering} == {
        f"encoder.blocks.{i}.attn.inner.{name}" for i in (0, 1) for name in ("centroids", "to_cluster.weight")}
    loaded = load_checkpoint(source)["model"]
    assert all(torch.equal(named[n], loaded[n]) for n in named if id(named[n]) in clustering)
    with pytest.raises(ValueError, match="no pretrained model as init"):
        TrainConfig(out="x", **{**common, "init": "minilm"}, centroid_lr_scale=0.1)
    with pytest.raises(ValueError, match="centroid_flow cannot be combined"):  # it would rewire the layers
        TrainConfig(out="x", **common, centroid_flow=True)


def test_a_checkpoint_written_under_earlier_defaults_is_rebuilt_as_it_was_trained(tmp_path, capsys):
    """cluster-select's defaults changed (version 2: the bound, the own group, a sink). A checkpoint that records no
    defaults versions (written before) and gives only sizes is rebuilt with the defaults of then -- by evaluation,
    load_trained and --init -- and --resume with the same flags is refused, naming the options to give."""
    from clusterformer.train.loop import evaluate_checkpoint, load_trained

    train, test = _write_task(tmp_path)
    out = tmp_path / "run"
    sizes = {"window": 4, "cluster_keys": 2, "num_clusters": 4}
    then = {"selection": "summaries", "own_group": False, "sink": 0}
    assert main(_argv(train, test, out, "--attention", "cluster-select", "--attention-options",
                      json.dumps({**sizes, **then}), "--max-steps", "2", "--batch-size", "16")) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["defaults_versions"]["cluster-select"] == 2
    assert {k: metrics["resolved_options"]["attention"][k] for k in then} == then
    state = load_checkpoint(out)
    assert state["defaults_versions"]["cluster-select"] == 2
    del state["defaults_versions"]  # as the runs before version 2 wrote it: the sizes given, the defaults implied
    state["config"]["attention_options"] = dict(sizes)
    save_checkpoint(out, state)

    model, _task, config, _step = load_trained(out)
    assert config.attention_options == {**sizes, **then}
    for block in model.encoder.blocks:
        assert {k: getattr(block.attn.inner.options, k) for k in then} == then
    assert evaluate_checkpoint(out, device="cpu")["metrics"] == pytest.approx(metrics["metrics"])
    with pytest.raises(SystemExit):
        main(_argv(train, test, out, "--attention", "cluster-select", "--attention-options", json.dumps(sizes),
                   "--max-steps", "3", "--batch-size", "16", "--resume"))
    err = capsys.readouterr().err
    assert "defaults of its mechanism changed" in err and "'own_group': False" in err
    assert main(_argv(train, test, out, "--attention", "cluster-select", "--attention-options",
                      json.dumps({**sizes, **then}), "--max-steps", "3", "--batch-size", "16", "--resume")) == 0
