"""Why a query of neural-clustering's query-key layer misses the key it needs: a run cut short, or another cluster.

A trained MQAR run (``train --task mqar``) whose attention is neural-clustering with ``cluster_on="query-key"`` is
evaluated three times, its weights unchanged, with the layer's reach:

* ``as trained``: the run's own options;
* ``fill``: ``reach_split="fill"`` (the reach water-filled over the query's clusters in place of reach // R each);
* ``whole clusters``: ``reach_split="fill"`` and ``causal_chunk_size`` = the sequence length, so that a query
  reads every earlier key of its R clusters (not a budget: the ceiling its assignment allows).

For each: the test accuracy (the whole test set, as the run's ``metrics.json`` records it) and, in the last
attention layer (``--layer``), the share of (query, head) pairs whose needed token the head reads
(:meth:`clusterformer.train.recall.RecallTask.needed_key_weights` over the first ``--sequences`` test
sequences). The pairs that miss it are then cut from a run (in the query's clusters: whole clusters less as
trained) or in another cluster (1 - whole clusters). Writes nothing unless ``--json PATH``.

    python docs/scripts/query_key_reach.py RUN_DIR [RUN_DIR ...] [--sequences 64] [--layer NAME] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from clusterformer.train import TrainConfig, load_trained
from clusterformer.train.loop import evaluate

SETTINGS = ("as trained", "fill", "whole clusters")


def _adjust(setting: str):
    def adjust(config: TrainConfig) -> None:
        if config.attention != "neural-clustering" or config.attention_options.get("cluster_on") != "query-key":
            raise ValueError(f"RUN_DIR must be a neural-clustering run with cluster_on='query-key'; got "
                             f"{config.attention!r} with {config.attention_options}")
        if setting != "as trained":
            config.attention_options = {**config.attention_options, "reach_split": "fill"}
        if setting == "whole clusters":
            config.attention_options["causal_chunk_size"] = config.max_len
    return adjust


def probe(run: str, sequences: int, layer: str | None) -> dict[str, Any]:
    if sequences < 1:
        raise ValueError(f"--sequences must be at least 1, got {sequences}")
    rows, options = {}, None
    for setting in SETTINGS:
        model, task, config, step = load_trained(run, adjust=_adjust(setting))
        options = options or dict(config.attention_options)  # the run's own, as trained
        if task.name != "mqar":
            raise ValueError(f"RUN_DIR {run!r} is a {task.name!r} run; this probe reads MQAR runs")
        n = min(sequences, len(task.test.ids))
        found = task.needed_key_weights(model, torch.device("cpu"), n)
        name = layer or list(found)[-1]
        if name not in found:
            raise ValueError(f"--layer {name!r} is not one of the model's attention layers {sorted(found)}")
        accuracy = evaluate(model, task, config, torch.device("cpu"))["accuracy"]
        key_read = (found[name].weight > 0).double().mean().item()  # over every (query, head) pair
        rows[setting] = {"accuracy": accuracy, "key_read": key_read}
    whole, trained = rows["whole clusters"]["key_read"], rows["as trained"]["key_read"]
    return {"run": run, "step": step, "layer": name, "sequences": n, "options": options,
            "settings": rows, "missed_cut_from_a_run": whole - trained, "missed_in_another_cluster": 1.0 - whole}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="train --task mqar run directories or checkpoints")
    parser.add_argument("--sequences", type=int, default=64, help="test sequences probed for the keys read (64)")
    parser.add_argument("--layer", default=None, help="the attention layer's module name (default: the last)")
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    args = parser.parse_args()
    results = []
    for run in args.runs:
        result = probe(run, args.sequences, args.layer)
        print(f"{result['run']} (step {result['step']}, {result['layer']}):")
        for setting, row in result["settings"].items():
            print(f"  {setting:>14}: accuracy {row['accuracy']:.4f}, (query, head) pairs reading the needed key "
                  f"{row['key_read']:.4f}")
        print(f"  missed as trained: {result['missed_cut_from_a_run']:.4f} cut from a run, "
              f"{result['missed_in_another_cluster']:.4f} in another cluster")
        results.append(result)
    if args.json:
        command = " ".join(["python docs/scripts/query_key_reach.py", *args.runs, "--sequences", str(args.sequences)]
                           + (["--layer", args.layer] if args.layer else []))
        args.json.write_text(json.dumps({"command": command, "runs": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
