"""``train --init PATH`` takes the architecture from its checkpoint: flags left out are the checkpoint's, a flag
given overrides the length, and a flag that contradicts the checkpoint's weights is refused, naming both values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clusterformer.cli import main
from clusterformer.train import load_checkpoint
from clusterformer.train.loop import INIT_ARCHITECTURE, init_architecture

WORDS = ["good", "great", "fine", "bad", "awful", "poor", "film", "plot"]


def _task(tmp_path: Path) -> list[str]:
    """The flags of a tiny text-classification task (label: whether a positive word comes first)."""
    rows = [f"{int(i % 8 < 3)} {WORDS[i % 8]} {WORDS[(i * 5) % 8]} {WORDS[(i * 3) % 8]}" for i in range(48)]
    train, test = tmp_path / "train.txt", tmp_path / "test.txt"
    train.write_text("\n".join(rows) + "\n")
    test.write_text("\n".join(rows[:16]) + "\n")
    return ["train", "--task", "text-classification", "--train-file", str(train), "--test-file", str(test),
            "--batch-size", "8", "--max-steps", "2", "--warmup-steps", "1", "--no-progress"]


def _config(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())["config"]


def test_init_path_takes_the_architecture_from_its_checkpoint(tmp_path, capsys):
    task = _task(tmp_path)
    source = tmp_path / "source"
    architecture = ["--dim", "16", "--depth", "3", "--heads", "2", "--ff-dim", "24", "--max-len", "12",
                    "--reversible", "--tied-lipschitz", "0.25"]
    assert main([*task, "--out", str(source), *architecture]) == 0
    want = {"dim": 16, "depth": 3, "heads": 2, "ff_dim": 24, "max_len": 12, "reversible": True, "tied": False,
            "tied_lipschitz": 0.25}
    assert {name: _config(source)[name] for name in INIT_ARCHITECTURE} == want

    # no architecture flag: every one is the checkpoint's, and the whole model continues
    taken = tmp_path / "taken"
    assert main([*task, "--out", str(taken), "--init", str(source)]) == 0
    assert {name: _config(taken)[name] for name in INIT_ARCHITECTURE} == want
    report = json.loads((taken / "metrics.json").read_text())["init"]
    assert report["skipped"] == [] == report["unused"] == report["differences"]
    saved = [value for value in load_checkpoint(source)["model"].values() if value is not None]  # not empty states
    assert report["transferred"] == len(saved) > 10

    # a flag given overrides: a longer --max-len (sinusoidal positions: nothing to lack); one equal to the
    # checkpoint's is no conflict
    longer = tmp_path / "longer"
    assert main([*task, "--out", str(longer), "--init", str(source), "--max-len", "20", "--heads", "2"]) == 0
    assert {name: _config(longer)[name] for name in INIT_ARCHITECTURE} == {**want, "max_len": 20}
    assert json.loads((longer / "metrics.json").read_text())["init"]["skipped"] == []

    # a flag that contradicts the weights: ValueError naming both values (the command line exits with it)
    with pytest.raises(ValueError, match=r"--dim 32 conflicts with the checkpoint .* trained with dim=16"):
        init_architecture(source, {"dim": 32})
    with pytest.raises(ValueError, match=r"--reversible False conflicts .* reversible=True"):
        init_architecture(source, {"reversible": False})
    with pytest.raises(SystemExit) as exc:
        main([*task, "--out", str(tmp_path / "bad"), "--init", str(source), "--dim", "32"])
    assert exc.value.code == 2 and "--dim 32 conflicts with the checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()  # refused before anything ran
    # ... unless --init-partial, which transfers what matches
    assert init_architecture(source, {"dim": 32}, partial=True) == {**want, "dim": 32}

    # without --init, the flags left out are TrainConfig's defaults, as before
    plain = tmp_path / "plain"
    assert main([*task, "--out", str(plain), "--max-steps", "1"]) == 0
    assert {name: _config(plain)[name] for name in INIT_ARCHITECTURE} == {
        "dim": 128, "depth": 2, "heads": 4, "ff_dim": None, "max_len": 256, "reversible": False, "tied": False,
        "tied_lipschitz": 0.5}
