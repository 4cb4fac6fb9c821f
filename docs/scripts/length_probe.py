"""A trained MQAR model evaluated at another length, without training there (N = 4,096 on a
CPU: docs/recall-and-aggregation.md#mqar-at-4096-tokens).

Rebuilds each run's model and loads its weights (a cluster-select run's centroids included), then evaluates it on
a fresh MQAR test set of ``LENGTH`` tokens whose every query lies at least ``MIN_GAP`` tokens after its value, the
other task options (pairs, vocabulary) as the run trained with. The options of the mechanism are the run's: the
keys per query stay what they were (window, selected clusters, summaries), so the share of the sequence each query
reads falls as the length grows. Sinusoidal positions have no table to outgrow; a learned table is refused.

    python docs/scripts/length_probe.py LENGTH MIN_GAP RUN_DIR [RUN_DIR ...]   # e.g. 4096 1024 results/compare/...
"""

from __future__ import annotations

import sys

import torch

from clusterformer.train.config import TrainConfig
from clusterformer.train.loop import evaluate, load_trained

TEST_SEQUENCES = 64


def length_probe(run: str, length: int, min_gap: int) -> str:
    def at_length(config: TrainConfig) -> None:
        if config.task != "mqar":
            raise ValueError(f"{run}: a run of task {config.task!r}; this probe evaluates MQAR runs")
        config.max_len = length
        config.task_options = {**config.task_options, "min_gap": min_gap, "test_sequences": TEST_SEQUENCES,
                               "recall_sequences": 8}

    model, task, config, _ = load_trained(run, adjust=at_length)
    metrics = evaluate(model, task, config, torch.device("cpu"))
    recall = metrics.get("key_recall", {})
    argmax = " / ".join(f"{layer['key_argmax']:.2f}" for layer in recall.values())
    return (f"{run}: {config.attention} {config.attention_options} at N = {length}, min_gap {min_gap}: accuracy "
            f"{metrics['accuracy']:.4f} on {metrics['test_queries']} queries (value the largest weight, per layer: "
            f"{argmax})")


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    for path in sys.argv[3:]:
        print(length_probe(path, int(sys.argv[1]), int(sys.argv[2])), flush=True)
