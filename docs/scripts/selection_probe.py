"""What a trained ``cluster-select`` MQAR model's layers do with a query's value (issue #31, §3).

For each cluster-select layer of a trained ``train --task mqar --attention cluster-select`` run, on the first test
sequences: the share of the keys in each head's largest clusters, how often the query *selects* the cluster that
holds the value it needs, and how often it then reads the value alone (causal: the value is among the cluster's
``cluster_keys`` most recent members outside the query's window; otherwise it is only inside the cluster's summary).
A random choice of ``select`` clusters of C gives select / C.

    python docs/scripts/selection_probe.py RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import sys

import torch

from clusterformer.attention import ClusterSelectAttention, record_groups
from clusterformer.train import load_trained

SEQUENCES = 64


def selection_probe(run: str) -> list[str]:
    model, task, _, _ = load_trained(run)
    test = task.test
    ids, queries, sources = test.ids[:SEQUENCES], test.queries[:SEQUENCES], test.sources[:SEQUENCES]
    selections = {}
    for module in model.modules():
        if isinstance(module, ClusterSelectAttention):
            def keep(*args, module=module, original=module._choose):
                selections[module] = original(*args)
                return selections[module]
            module._choose = keep
    with torch.no_grad(), record_groups() as groups:
        model(ids)
    rows = torch.arange(ids.shape[0]).unsqueeze(1)
    lines = []
    for layer, (module, g) in enumerate(groups.items()):  # g: (B, H, N) key groups (the clusters, or their spans)
        C, S = module.options.num_groups, module.options.select  # groups: the clusters, split with position_splits
        shares = [torch.bincount(g[:, h].reshape(-1), minlength=C).sort(descending=True).values[:3] / g[:, h].numel()
                  for h in range(g.shape[1])]
        value_cluster = g.permute(0, 2, 1)[rows, sources]  # (B, Q, H)
        chosen = selections[module].permute(0, 2, 1, 3)[rows, queries]  # (B, Q, H, S)
        selected = (chosen == value_cluster.unsqueeze(-1)).any(-1)  # (B, Q, H)
        hit = selected.float().mean()
        # members of the value's cluster after the value and outside the query's window (positions s < j <= t - w)
        positions = torch.arange(g.shape[-1])
        later = (positions.view(1, 1, -1) > sources.unsqueeze(-1)) \
            & (positions.view(1, 1, -1) <= (queries - module.options.window).unsqueeze(-1))  # (B, Q, N)
        same = g.permute(0, 2, 1).unsqueeze(1) == value_cluster.unsqueeze(2)  # (B, Q, N, H)
        newer = (same & later.unsqueeze(-1)).sum(2)  # (B, Q, H)
        alone = (selected & (newer < module.options.cluster_keys)).float().mean()
        lines.append(f"layer {layer}: largest key clusters per head "
                     + ", ".join("/".join(f"{float(x):.2f}" for x in s) for s in shares)
                     + f"; the query selects its value's cluster {float(hit):.2f} (random: {S / C:.2f}) and reads "
                     f"the value alone {float(alone):.2f}")
    return lines


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for path in sys.argv[1:]:
        print(path)
        for line in selection_probe(path):
            print("  " + line)
