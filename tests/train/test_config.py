"""The training configuration in parts (clusterformer.train.config): each part checks its own fields alone, the
task owns its options and rules (TASK_SPECS), and the whole stays one flat object on the command line, in
metrics.json and in checkpoints."""

from __future__ import annotations

import dataclasses

import pytest

from clusterformer.train import TASK_SPECS, TASKS, DataConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig


def test_every_part_checks_its_own_fields_alone():
    with pytest.raises(ValueError, match="dim must be >= 1"):
        ModelConfig(dim=0).check_model()
    with pytest.raises(ValueError, match="tied is the tied connection"):
        ModelConfig(tied=True).check_model()
    with pytest.raises(ValueError, match="unknown option"):
        ModelConfig(attention="lsh", attention_options={"num_clusterz": 3}).check_model()
    with pytest.raises(ValueError, match="give --epochs or --max-steps"):
        OptimConfig().check_optim(fine_tuning=False)
    optim = OptimConfig(max_steps=3)
    optim.check_optim(fine_tuning=True)
    assert optim.lr == 5e-5  # fine-tuning's default learning rate
    with pytest.raises(ValueError, match="task must be one of"):
        DataConfig(task="sst2").check_data()
    with pytest.raises(ValueError, match="beam must be >= 1"):
        DataConfig(task="multi30k", beam=0).check_data()
    with pytest.raises(ValueError, match="amp must be one of"):
        RunConfig(out="x", amp="fp8").check_run()
    # the parts hold disjoint fields, and the whole holds every one of them and nothing else
    parts = [{f.name for f in dataclasses.fields(part)} for part in (ModelConfig, OptimConfig, DataConfig, RunConfig)]
    assert sum(map(len, parts)) == len(set().union(*parts)) == len(dataclasses.fields(TrainConfig))


def test_the_task_owns_its_options_and_rules():
    assert set(TASK_SPECS) == set(TASKS)
    with pytest.raises(ValueError, match="task 'listops' takes no task_options"):
        TrainConfig(task="listops", out="x", max_steps=1, task_options={"form": "causal"})
    with pytest.raises(ValueError, match="unknown task option 'pairs'"):
        TrainConfig(task="mqar", out="x", max_steps=1, task_options={"pairs": 4})
    with pytest.raises(ValueError, match="multi30k builds an encoder-decoder"):  # the translation task's rule
        TrainConfig(task="multi30k", out="x", max_steps=1, reversible=True)
    with pytest.raises(ValueError, match="--decoder-attention is for the translation task"):
        TrainConfig(task="mr", out="x", max_steps=1, decoder_attention="full")
    # causal or not is the task's answer: the recall tasks' causal form refuses a mechanism that cannot be causal
    TrainConfig(task="mqar", out="x", max_steps=1, attention="clustered", task_options={"form": "bidirectional"})
    with pytest.raises(ValueError, match="cannot be causal"):
        TrainConfig(task="mqar", out="x", max_steps=1, attention="clustered", task_options={"form": "causal"})
    assert TASK_SPECS["imdb"].tokenizer == "bytes" and TASK_SPECS["mr"].tokenizer == "word"


def test_the_whole_is_flat_and_round_trips():
    config = TrainConfig(task="mr", out="runs/x", attention="neural-clustering", dim=32, lr=3e-4, max_steps=5,
                         layer_attention={"-1": ["sliding-window", {"window": 8, "stride": 4}]})
    flat = dataclasses.asdict(config)  # what metrics.json and checkpoints hold
    assert flat["dim"] == 32 and flat["lr"] == 3e-4 and flat["layer_attention"] == {1: ["sliding-window",
                                                                                        {"window": 8, "stride": 4}]}
    assert TrainConfig(**flat) == config
    with pytest.raises(TypeError):  # keywords only: the parts' fields have no order to rely on
        TrainConfig("mr", "runs/x")
