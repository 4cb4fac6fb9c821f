"""What a trained ``cluster-select`` recall model's layers do with the keys a query needs
(docs/recall-and-aggregation.md#passkey, #histogram-aggregation-over-scattered-positions).

For each cluster-select layer of a trained ``train --task mqar|passkey|histogram --attention cluster-select`` run,
on the first test sequences: the share of the keys in each head's largest groups, how often the query *selects*
the group that holds a key it needs, and how often it then reads that key alone (causal: the key is among the
group's ``cluster_keys`` most recent members outside the query's window -- with ``members="score"``, among those
its scores chose; otherwise it is at most inside the group's summary). A random choice of ``select`` groups of C
gives select / C. Only the needed keys outside the query's window are counted (the window reads the others whatever
the groups).

A query that needs several keys (the histogram: every earlier occurrence of its type) adds two lines: how many
distinct groups hold its needed keys outside the window (it can read at most ``select``), the share of queries
whose keys lie in at most ``select`` groups, and the share of its needed keys in the group of its *own* key (a
grouping by content puts the occurrences of one type together; pages and random groups do not). And for every
run: how often position 0 (BOS: the anchor a count reads its share off) is read by the queries beyond the window.

    python docs/scripts/selection_probe.py RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from clusterformer.attention import ClusterSelectAttention, cluster_select, record_groups
from clusterformer.ops.selected_ranking import scored_members
from clusterformer.train import load_trained

SEQUENCES = 64
MULTI_SEQUENCES = 16  # a query with several needed keys: (B, Q, S) sources over every position


def _needed(test, sequences: int) -> tuple[torch.Tensor, ...]:
    """ids (B, N), queries (B, Q), sources (B, Q, S) and their mask (B, Q, S) of the first test sequences."""
    sources, mask = test.sources[:sequences], test.source_mask
    if sources.dim() == 2:
        sources = sources.unsqueeze(-1)
        mask = torch.ones_like(sources, dtype=torch.bool)
    else:
        mask = mask[:sequences]
    return test.ids[:sequences], test.queries[:sequences], sources, mask


def selection_probe(run: str) -> list[str]:
    model, task, _, _ = load_trained(run)
    multi = task.test.sources.dim() == 3
    ids, queries, sources, mask = _needed(task.test, MULTI_SEQUENCES if multi else SEQUENCES)
    selections = {}
    for module in model.modules():
        if isinstance(module, ClusterSelectAttention):
            def keep(*args, module=module, original=module._forced):  # the groups read: ranked, then forced
                selections[module] = original(*args)
                return selections[module]
            module._forced = keep
    scored = []  # members="score": the keys each query reads from its groups, (B, H, N, M), in the layers' order

    def recording(*args, **kwargs):
        scored.append(scored_members(*args, **kwargs))
        return scored[-1]

    cluster_select.scored_members = recording
    try:
        with torch.no_grad(), record_groups() as groups:
            model(ids)
    finally:
        cluster_select.scored_members = scored_members
    B, Q, S = sources.shape
    b = torch.arange(B).view(B, 1, 1)
    lines = []
    for layer, (module, g) in enumerate(groups.items()):  # g: (B, H, N) key groups (the clusters, or their spans)
        o = module.options
        C, H = o.attended_groups, g.shape[1]  # with a sink: one more group, which every query reads
        shares = [torch.bincount(g[:, h].reshape(-1), minlength=C).sort(descending=True).values[:3] / g[:, h].numel()
                  for h in range(H)]
        by_position = g.permute(0, 2, 1)  # (B, N, H)
        needed_group = by_position[b, sources]  # (B, Q, S, H)
        chosen = selections[module].permute(0, 2, 1, 3)[b[..., 0], queries]  # (B, Q, H, select)
        selected = (chosen.unsqueeze(2) == needed_group.unsqueeze(-1)).any(-1)  # (B, Q, S, H)
        # the needed keys outside the window (causal: at positions <= t - window), each counted once
        last = queries - o.window  # (B, Q)
        outside = mask & (sources <= last.unsqueeze(-1))
        first = torch.ones_like(outside)
        first[..., 1:] = sources[..., 1:] != sources[..., :1]  # sources are padded by repeating the first
        outside = (outside & (first | (torch.arange(S) == 0))).unsqueeze(-1).expand(B, Q, S, H)
        # members of the key's group after it and outside the window: running counts per group, (B, H, N, C)
        counts = F.one_hot(g, C).cumsum(2)
        heads = torch.arange(H).view(1, 1, 1, H)
        at_last = counts[b.unsqueeze(-1), heads, last.clamp(min=0).view(B, Q, 1, 1), needed_group]
        at_key = counts[b.unsqueeze(-1), heads, sources.unsqueeze(-1), needed_group]
        if o.members == "score":  # read alone: among the members the query's scores chose
            members = scored.pop(0).permute(0, 2, 1, 3)[b[..., 0], queries]  # (B, Q, H, M)
            alone = (members.unsqueeze(2) == sources.view(B, Q, S, 1, 1)).any(-1)
        else:  # read alone: among the group's cluster_keys most recent members outside the window
            alone = selected & (at_last - at_key < o.cluster_keys)
        total = outside.sum().clamp(min=1)
        hit, read = (selected & outside).sum() / total, (alone & outside).sum() / total
        lines.append(f"layer {layer}: largest groups per head "
                     + ", ".join("/".join(f"{float(x):.2f}" for x in s) for s in shares)
                     + f"; a needed key outside the window is in a selected group {float(hit):.2f} "
                     f"(random: {o.select / C:.2f}) and read alone {float(read):.2f} "
                     f"({int(outside.sum())} (key, query, head) triples)")
        # position 0 (BOS, the count's anchor): is its group selected, and is it among the group's read members?
        beyond = queries >= o.window  # (B, Q): position 0 is outside the window
        first_group = by_position[:, 0]  # (B, H)
        first_selected = (chosen == first_group[:, None, :, None]).any(-1)  # (B, Q, H)
        newer_than_first = counts[b, torch.arange(H).view(1, 1, H), last.clamp(min=0).view(B, Q, 1),
                                  first_group[:, None, :].expand(B, Q, H)] - 1
        first_read = first_selected & (newer_than_first < o.cluster_keys)  # (the nearest members' rule)
        lines.append(f"  position 0's group selected by {float(first_selected[beyond].float().mean()):.2f} of the "
                     f"(query, head) pairs beyond the window, position 0 read by "
                     f"{float(first_read[beyond].float().mean()):.2f}")
        if multi:
            spanned = (F.one_hot(needed_group, C) * outside.unsqueeze(-1)).amax(2).sum(-1)  # (B, Q, H)
            has = outside.any(2)
            own = by_position[b[..., 0], queries]  # (B, Q, H): the group of the query's own key
            together = ((needed_group == own.unsqueeze(2)) & outside).sum() / total
            lines.append(f"  queries with a needed key outside the window: {float(has.float().mean()):.2f}; their "
                         f"keys lie in {float(spanned[has].float().mean()):.2f} groups on the mean, in at most "
                         f"{o.select} for {float((spanned[has] <= o.select).float().mean()):.2f}; "
                         f"share in the group of the query's own key {float(together):.2f}")
    return lines


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for path in sys.argv[1:]:
        print(path)
        for line in selection_probe(path):
            print("  " + line)
