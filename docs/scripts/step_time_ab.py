"""Training-step time of trained runs' whole models, interleaved in one process
(docs/speed-and-memory.md#cluster-select-its-kernels-and-its-training-step).

Each run's model (its checkpoint, config and task: ``load_trained``) takes the same training steps as in ``train``
-- the task's own batches, forward with the auxiliary losses, the task loss, backward; no optimiser step, so every
repeat times the same weights -- one run after the other, a few times after a warm-up. The medians' ratios to the
first run hold on a shared machine where absolute times do not (``compare``'s seconds per epoch come from runs
that shared the cores with different neighbours).

    OMP_NUM_THREADS=1 python docs/scripts/step_time_ab.py RUN_DIR[@key=value,...] [RUN_DIR ...] [--repeats 5]
        [--json RECORD]

``RUN_DIR@key=value,...`` times the run's model with those attention options swapped in (as
``docs/scripts/option_swap.py`` evaluates it), e.g. ``RUN@members=score``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from clusterformer._specs import parse_spec
from clusterformer.attention import collect_aux_losses
from clusterformer.train.config import TrainConfig
from clusterformer.train.loop import keys_per_query, load_trained


def timed_step(model: torch.nn.Module, task: Any, config: TrainConfig, repeat: int) -> float:
    """Seconds of one training step of ``model`` on its task's batch ``repeat`` (no optimiser step)."""
    model.train()
    ids, pad, targets, extra = task.batch(repeat, task.steps_per_epoch(config.batch_size, 1), config.batch_size, 0, 1,
                                          config.seed)
    start = time.perf_counter()
    with collect_aux_losses() as aux:
        logits = model(ids, pad) if extra is None else model(ids, pad, extra)  # as train's loop calls it
    loss = task.loss(logits, targets) + sum(aux.values(), torch.zeros(()))
    loss.backward()
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return elapsed


def interleaved_times(models: list[tuple[torch.nn.Module, Any, TrainConfig]], repeats: int) -> list[list[float]]:
    """Each (model, task, config)'s step times over ``repeats``, the models taking turns, after a warm-up."""
    for model, task, config in models:
        timed_step(model, task, config, 0)
    times: list[list[float]] = [[] for _ in models]
    for repeat in range(1, repeats + 1):
        for index, (model, task, config) in enumerate(models):
            times[index].append(timed_step(model, task, config, repeat))
    return times


def interleaved_medians(models: list[tuple[torch.nn.Module, Any, TrainConfig]], repeats: int) -> list[float]:
    """Each (model, task, config)'s median step time over ``repeats``, the models taking turns, after a warm-up."""
    return [sorted(t)[len(t) // 2] for t in interleaved_times(models, repeats)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run directories (RUN@key=value,...: with options swapped in); the "
                        "first is the reference")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the record here: each run's entry (compare's label, or the directory's "
                        "name), times, median, ratio to the first, keys read and mixed per query")
    args = parser.parse_args()

    def load(run: str):
        path, _, options = run.partition("@")
        swap = parse_spec("swap:" + options)[1] if options else {}

        def swapped(config: TrainConfig) -> None:
            config.attention_options = {**config.attention_options, **swap}

        return load_trained(path, adjust=swapped)

    loaded = [load(run) for run in args.runs]
    times = interleaved_times([(model, task, config) for model, task, config, _ in loaded], args.repeats)
    medians = [sorted(t)[len(t) // 2] for t in times]
    print(f"training step (forward with auxiliary losses, backward), median of {args.repeats}, "
          f"threads={torch.get_num_threads()}:")
    rows = []
    for run, (model, _, config, _), median, seconds in zip(args.runs, loaded, medians, times, strict=True):
        print(f"  {median:7.3f} s  {median / medians[0]:5.2f}x  {config.attention} {config.attention_options}  ({run})")
        rows.append({"run": run, "entry": entry_label(run), "attention": config.attention,
                     "attention_options": config.attention_options,
                     "keys_read": keys_per_query(model, config.max_len, config.causal()),
                     "keys_mixed": keys_per_query(model, config.max_len, config.causal(), "keys_mixed"),
                     "max_len": config.max_len,
                     "batch_size": config.batch_size, "dim": config.dim, "depth": config.depth, "heads": config.heads,
                     "causal": config.causal(),
                     "seconds": seconds, "median_s": median, "ratio_to_first": median / medians[0]})
    if args.json:
        record = {"command": "OMP_NUM_THREADS=" + os.environ.get("OMP_NUM_THREADS", "") + " python "
                  + " ".join(sys.argv), "what": "training step (forward with auxiliary losses, backward; no optimiser "
                  "step), the runs taking turns after one warm-up step each", "repeats": args.repeats,
                  "threads": torch.get_num_threads(), "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
                  "torch": torch.__version__, "runs": rows}
        with open(args.json, "w") as handle:
            json.dump(record, handle, indent=1)
            handle.write("\n")


def entry_label(run: str) -> str:
    """The entry a run directory holds: compare's OUT/TASK/LABEL/seedS gives LABEL, any other directory its name."""
    path = Path(run.partition("@")[0])
    return path.parent.name if path.name.startswith("seed") else path.name


if __name__ == "__main__":
    main()
