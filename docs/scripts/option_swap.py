"""A trained run evaluated with other options of its mechanism, without training
(docs/recall-and-aggregation.md#what-earns-the-recall-the-ranking-not-content-clusters).

Rebuilds each run's model with its attention options updated by ``OPTIONS`` (``key=value,...``, read as the
``--attention`` specs read them), loads the trained weights into it, and evaluates it on the run's own test set.
It answers "what would this model score if it ranked, read or grouped its keys another way", e.g. a cluster-select
run trained with the summaries' ranking, evaluated with ``selection=bound``. Options that
add parameters or buffers the run does not have (``balance``) cannot be swapped in this way. Without OPTIONS
(``-``) it re-evaluates the run as trained, which must give the run's recorded accuracy.

    python docs/scripts/option_swap.py OPTIONS RUN_DIR [RUN_DIR ...]   # e.g. selection=bound results/compare/...
"""

from __future__ import annotations

import sys

import torch

from clusterformer._specs import parse_spec
from clusterformer.train.config import TrainConfig
from clusterformer.train.loop import evaluate, load_trained


def option_swap(run: str, options: dict) -> str:
    def swapped(config: TrainConfig) -> None:
        config.attention_options = {**config.attention_options, **options}

    model, task, config, step = load_trained(run, adjust=swapped)
    metrics = evaluate(model, task, config, torch.device("cpu"))
    score = {key: round(value, 4) for key, value in metrics.items() if isinstance(value, float)}
    return f"{run} (step {step}): {config.attention} {config.attention_options}: {score}"


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    swap = {} if sys.argv[1] == "-" else parse_spec("swap:" + sys.argv[1])[1]
    for path in sys.argv[2:]:
        print(option_swap(path, swap), flush=True)
