"""Which answers a sparse MQAR model gets right, by how many heads see the key it needs.

A query of a trained MQAR model (``train --task mqar``) is answered right or wrong, and in each attention layer
some of its heads have the needed token (the value after its key's earlier occurrence) in their attended set and
some do not (:meth:`clusterformer.train.recall.RecallTask.needed_key_weights`, the probe behind the runs'
``key_recall``).
This script splits the first ``--sequences`` test sequences' queries of ``RUN_DIR`` by the number of heads of one
layer (``--layer``, default the last) that see the needed token, and gives for each count the share of queries
and their accuracy: where a sparse layer loses accuracy, among queries it gives the key to no head, or also among
those it gives to some heads only. Several runs give one row each. Writes nothing unless ``--json PATH``.

    python docs/scripts/recall_by_heads.py RUN_DIR [RUN_DIR ...] [--sequences 64] [--layer NAME] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from clusterformer.train import load_trained


def probe(run: str, sequences: int, layer: str | None) -> dict[str, Any]:
    model, task, config, step = load_trained(run)
    if task.name != "mqar":
        raise ValueError(f"RUN_DIR {run!r} is a {task.name!r} run; this probe reads MQAR runs")
    test = task.test
    if sequences < 1:
        raise ValueError(f"--sequences must be at least 1, got {sequences}")
    n = min(sequences, len(test.ids))
    found = task.needed_key_weights(model, torch.device("cpu"), n)
    name = layer or list(found)[-1]
    if name not in found:
        raise ValueError(f"--layer {name!r} is not one of the model's attention layers {sorted(found)}")
    heads = (found[name].weight > 0).sum(-1)  # (n, Q): heads that see the needed token
    with torch.no_grad():
        logits = torch.cat([model(test.ids[start:start + 16], None) for start in range(0, n, 16)])
    rows, queries = torch.arange(n).unsqueeze(1), test.queries[:n]
    hit = logits[rows, queries].argmax(-1) == test.targets[:n][rows, queries]
    by_heads = {}
    for count in range(int(heads.max()) + 1):
        chosen = heads == count
        by_heads[str(count)] = {"share": chosen.double().mean().item(),
                                "accuracy": hit[chosen].double().mean().item() if chosen.any() else None}
    return {"run": run, "step": step, "attention": config.attention, "layer": name, "sequences": n,
            "queries": hit.numel(), "accuracy": hit.double().mean().item(), "by_heads_seeing_the_key": by_heads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="train --task mqar run directories or checkpoints")
    parser.add_argument("--sequences", type=int, default=64, help="test sequences probed (default 64)")
    parser.add_argument("--layer", default=None, help="the attention layer's module name (default: the last)")
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    args = parser.parse_args()
    results = []
    for run in args.runs:
        result = probe(run, args.sequences, args.layer)
        print(f"{result['run']} (step {result['step']}, {result['queries']} queries, {result['layer']}): "
              f"accuracy {result['accuracy']:.4f}")
        for count, row in result["by_heads_seeing_the_key"].items():
            accuracy = "-" if row["accuracy"] is None else f"{row['accuracy']:.4f}"
            print(f"  {count} heads see the key: {row['share']:.4f} of queries, accuracy {accuracy}")
        results.append(result)
    if args.json:
        command = " ".join(["python docs/scripts/recall_by_heads.py", *args.runs, "--sequences", str(args.sequences)]
                           + (["--layer", args.layer] if args.layer else []))
        args.json.write_text(json.dumps({"command": command, "runs": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
