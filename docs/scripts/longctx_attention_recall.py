"""How much of dense attention's mass cluster retrieval's selected keys hold, per layer
(docs/long-context-decoding.md#where-the-attention-mass-goes).

One multi-key NIAH prompt for SmolLM2 (about 8k tokens, or the length given): the context is prefilled densely into
a cache, then the ~25 question tokens run through a registered attention function that computes dense attention
and, beside it, the key set each selection rule would choose at 10 % and 20 % budgets: clusters ranked per
key/value group (the default), per query head, an oracle that keeps the keys of highest dense weight, and Quest
(pages of 16 ranked by their min/max bound, :func:`clusterformer.ops.topk_cache.quest_attention`, whose read set is
recovered exactly by giving it one-hot values in float64), and a page oracle (the same pages of 16 ranked by their
true dense mass: the best any page-granular selection at the budget can do). Printed per (budget, rule): the dense
mass on the chosen keys and the share of the answer's needle tokens' mass kept, averaged over layers, heads and
question tokens.

Also the rules of cluster retrieval's ``rerank=4`` (the ranked clusters fill 4 x the retrieved slots with
candidates, of which the ones of highest exact q . k are kept: by the best over the group's query heads, or per
query head), and ``--budgets`` sweeps the budget (the recall-against-budget curve of
docs/long-context-decoding.md), ``--samples`` averages over that many prompts (seeds 1, 2, ...), ``--json`` /
``--plot`` keep the numbers and draw them.

Run from the checkout (about 3 minutes on one thread at 8k for the two default budgets):
``python docs/scripts/longctx_attention_recall.py [LENGTH] [--budgets 0.01,0.02,0.05,0.1,0.2,0.3] [--samples 3]
[--json out.json] [--plot out.png]``.
"""
import argparse
import copy
import json
from pathlib import Path

import torch
import transformers
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from clusterformer import hf
from clusterformer.apps.longctx import _chat_ids
from clusterformer.attention.retrieval import ClusterRetrievalOptions
from clusterformer.data.ruler import INSTRUCTION, haystack_sentences, make_sample
from clusterformer.masks import AttentionMask
from clusterformer.ops.retrieval import KeyClusterIndex, build_index, keys_allowed_count
from clusterformer.ops.topk_cache import quest_attention

BUDGETS = (0.1, 0.2)
RULES = ("group", "head", "group-rerank", "head-rerank", "oracle", "quest", "page-oracle")
RERANK = 4
QUEST_PAGE = 16


def cluster_of_each_key(index: KeyClusterIndex, n: int) -> torch.Tensor:
    """(G, n) cluster id of every indexed key, -1 for keys outside the index (sink and window)."""
    groups, _, cap = index.members.shape
    filled = torch.arange(cap) < index.counts.unsqueeze(-1)  # (G, C, cap): which member slots hold a key
    g, c, slot = filled.nonzero(as_tuple=True)
    assign = torch.full((groups, n), -1, dtype=torch.long)
    assign[g, index.members[g, c, slot]] = c
    return assign


def quest_read(q: torch.Tensor, k: torch.Tensor, budget: float) -> torch.Tensor:
    """(1, H, Lq, n) keys Quest's queries read: its output for one-hot values is each query's weight on each key,
    nonzero exactly where it reads (float64: no weight underflows)."""
    kv_groups, n = k.shape[1], k.shape[2]
    one_hot = torch.eye(n, dtype=torch.float64).expand(1, kv_groups, n, n)
    weights = quest_attention(q.double(), k.double(), one_hot, AttentionMask(causal=True), budget, QUEST_PAGE, 1.0)
    return weights > 0


def page_oracle(probs: torch.Tensor, allowed: int) -> torch.Tensor:
    """(1, H, Lq, n): the allowed // 16 pages of 16 keys (cut from position 0) holding the most dense mass."""
    n = probs.shape[-1]
    pages = -(-n // QUEST_PAGE)
    mass = torch.nn.functional.pad(probs, (0, pages * QUEST_PAGE - n)).unflatten(-1, (pages, QUEST_PAGE)).sum(-1)
    top = mass.topk(min(pages, allowed // QUEST_PAGE), -1).indices
    taken = torch.zeros_like(mass, dtype=torch.bool).scatter_(-1, top, True)
    return taken.repeat_interleave(QUEST_PAGE, -1)[..., :n]


def selected_keys(rule: str, q: torch.Tensor, k: torch.Tensor, probs: torch.Tensor, index: KeyClusterIndex,
                  opts: ClusterRetrievalOptions, end: int, scaling: float, scores_qk: torch.Tensor) -> torch.Tensor:
    """(1, H, Lq, n) keys each query sees under ``rule``: sink, window, and retrieved keys up to the budget (Quest:
    its own page and whole pages up to the budget)."""
    if rule == "quest":
        return quest_read(q, k, opts.budget)
    if rule == "page-oracle":
        return page_oracle(probs, keys_allowed_count(opts.budget, probs.shape[-1]))
    _, heads, lq, dim = q.shape
    n = probs.shape[-1]
    kv_groups, clusters = index.counts.shape
    rep = heads // kv_groups
    retrieved = max(0, keys_allowed_count(opts.budget, n) - opts.sink - (n - end))
    chosen = torch.zeros(1, heads, lq, n, dtype=torch.bool)
    chosen[..., :opts.sink] = True
    chosen[..., end:] = True
    if rule == "oracle":  # the `retrieved` keys of highest dense probability between sink and window
        top = probs[..., opts.sink:end].topk(retrieved, -1).indices + opts.sink
        return chosen.scatter_(-1, top, True)
    scores = (q * scaling).view(1, kv_groups, rep, lq, dim) @ index.centroids_t.view(1, kv_groups, 1, dim, clusters)
    grouped = rule.startswith("group")
    if grouped:  # one ranking per key/value group: the best score over its query heads
        scores = scores.amax(2, keepdim=True).expand_as(scores)
    slots = retrieved * (RERANK if rule.endswith("rerank") else 1)
    order = scores.sort(dim=-1, descending=True, stable=True).indices
    sizes = index.counts.view(1, kv_groups, 1, 1, clusters).expand_as(order).gather(-1, order)
    take = (sizes.cumsum(-1) - sizes) < slots  # whole clusters while there is room (the last one counted whole)
    cluster_taken = torch.zeros_like(take).scatter_(-1, order, take)  # (1, G, rep, Lq, C)
    assign = cluster_of_each_key(index, n).view(1, kv_groups, 1, 1, n).expand(1, kv_groups, rep, lq, n)
    in_taken = ((assign >= 0) & cluster_taken.gather(-1, assign.clamp(min=0))).reshape(1, heads, lq, n)
    if rule.endswith("rerank"):  # the candidates of highest exact q . k (best over the group, or per head)
        exact = scores_qk.view(1, kv_groups, rep, lq, n)
        if grouped:
            exact = exact.amax(2, keepdim=True).expand_as(exact)
        exact = exact.reshape(1, heads, lq, n).masked_fill(~in_taken, float("-inf"))
        top = exact.topk(min(retrieved, n), -1).indices
        in_taken = torch.zeros_like(in_taken).scatter_(-1, top, True) & in_taken
    return chosen | in_taken


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("length", nargs="?", type=int, default=7900)
    parser.add_argument("--budgets", default=",".join(str(b) for b in BUDGETS))
    parser.add_argument("--samples", type=int, default=1, help="prompts (seeds 1, 2, ...), averaged")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    budgets = [float(b) for b in args.budgets.split(",")]
    torch.set_num_threads(1)
    model, tok = hf.load_pretrained("smollm2")
    sentences = haystack_sentences("../shared/data/wikitext-2/wiki.valid.tokens")

    def count(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    # (budget, rule) -> rows of (sample, layer, mass kept, needle mass kept, keys read per query)
    results: dict[tuple[float, str], list[tuple[int, int, float, float, float]]] = {}
    for seed in range(1, args.samples + 1):
        sample = make_sample("niah-multikey", args.length, sentences, count, seed=seed)
        context, question = _chat_ids(tok, INSTRUCTION["niah-multikey"], sample.context, sample.question)
        answer = tok(" " + sample.answers[0], add_special_tokens=False)["input_ids"]
        needle = sorted({i + j for i in range(len(context) - len(answer) + 1)
                         if context[i:i + len(answer)] == answer for j in range(len(answer))})
        print(f"sample {seed}: tokens {len(context) + len(question)}, answer {sample.answers}, needle tokens "
              f"{len(needle)}", flush=True)
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=torch.tensor([context]), cache=cache)

        def diagnostic_attention(module, q, k, v, mask, dropout=0.0, scaling=None, needle=needle, seed=seed,
                                 **kwargs):
            heads, lq = q.shape[1], q.shape[2]
            kv_groups, n = k.shape[1], k.shape[2]
            rep = heads // kv_groups
            allowed = torch.ones(lq, n, dtype=torch.bool).tril(n - lq)
            scores = (q @ k.repeat_interleave(rep, 1).transpose(-1, -2)) * scaling
            scores = scores.masked_fill(~allowed, float("-inf"))
            probs = torch.softmax(scores, -1)  # (1, H, Lq, n)
            needle_mass = probs[..., needle].sum(-1)
            indexes = {}
            for budget in budgets:
                # the window: at most 64 (the default), and a quarter of the budget at small budgets
                window = min(64, max(1, keys_allowed_count(budget, n) // 4))
                opts = ClusterRetrievalOptions(budget=budget, window=window)
                end = n - max(opts.window, lq)
                if end not in indexes:
                    indexes[end] = build_index(k, v, None, end, opts)
                for rule in RULES:
                    chosen = selected_keys(rule, q, k, probs, indexes[end], opts, end, scaling, scores)
                    mass = (probs * chosen).sum(-1).mean().item()
                    kept = (probs[..., needle] * chosen[..., needle]).sum(-1)
                    share = (kept.sum() / needle_mass.sum().clamp(min=1e-12)).item()
                    keys = chosen.sum(-1).double().mean().item()
                    results.setdefault((budget, rule), []).append((seed, module.layer_idx, mass, share, keys))
            out = probs @ v.repeat_interleave(rep, 1)
            return out.transpose(1, 2).contiguous(), None

        AttentionInterface.register("diag", diagnostic_attention)
        AttentionMaskInterface.register("diag", sdpa_mask)
        model.set_attn_implementation("diag")
        with torch.no_grad():
            model(input_ids=torch.tensor([question]), cache=copy.deepcopy(cache))
        model.set_attn_implementation("sdpa")
    summary = {}
    for (budget, rule), rows in results.items():
        mass = sum(r[2] for r in rows) / len(rows)
        share = sum(r[3] for r in rows) / len(rows)
        keys = sum(r[4] for r in rows) / len(rows)
        summary.setdefault(rule, {})[budget] = {"mass": mass, "needle": share, "keys": keys}
        print(f"budget {budget:.0%} {rule}: mean recall of attention mass {mass:.3f}, needle mass captured "
              f"{share:.3f}, keys read per query {keys:.0f}; worst layers "
              f"{[(r[1], round(r[2], 3)) for r in sorted(rows, key=lambda r: r[2])[:3]]}")
    if args.json:
        Path(args.json).write_text(json.dumps({"length": args.length, "samples": args.samples, "summary": {
            rule: {str(b): v for b, v in by.items()} for rule, by in summary.items()}}, indent=1))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
        for rule, by in summary.items():
            xs = sorted(by)
            for ax, what in zip(axes, ("needle", "mass"), strict=True):
                ax.plot([100 * x for x in xs], [100 * by[x][what] for x in xs], marker="o", label=rule,
                        linestyle="--" if "oracle" in rule else "-")
        for ax, title in zip(axes, ("needle's dense attention mass kept (%)", "dense attention mass kept (%)"),
                             strict=True):
            ax.set_xscale("log")
            ax.set_xlabel("budget (% of the cached keys)")
            ax.set_title(title, fontsize=9)
            ax.grid(alpha=0.3)
        axes[1].legend(fontsize=7)
        fig.suptitle(f"SmolLM2-135M, multi-key NIAH at {args.length} tokens, {args.samples} prompt(s)", fontsize=9)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
