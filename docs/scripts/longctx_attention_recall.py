"""Recall of dense attention mass by cluster retrieval's selected keys, per layer, for the question queries of one
8k multi-key NIAH prompt (SmolLM2). Run from the checkout: python docs/scripts/longctx_attention_recall.py (about 3 min)."""
import copy, torch, transformers, sys
from transformers import AttentionInterface
from clusterformer import hf
from clusterformer.apps.longctx import _chat_ids
from clusterformer.data.ruler import INSTRUCTION, haystack_sentences, make_sample
from clusterformer.ops.retrieval import RetrievalOptions, build_index
torch.set_num_threads(1)
model, tok = hf.load_pretrained("smollm2")
sent = haystack_sentences("../shared/data/wikitext-2/wiki.valid.tokens")
count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])
sample = make_sample("niah-multikey", 7900, sent, count, seed=1)
ctx, qn = _chat_ids(tok, INSTRUCTION["niah-multikey"], sample.context, sample.question)
print("tokens", len(ctx) + len(qn), "answer", sample.answers)
needle_tok = set()
# needle positions: tokens of the asked number in the context
ans = tok(" " + sample.answers[0], add_special_tokens=False)["input_ids"]
ids = ctx
for i in range(len(ids) - len(ans) + 1):
    if ids[i:i + len(ans)] == ans:
        needle_tok.update(range(i, i + len(ans)))
print("needle token positions", sorted(needle_tok)[:3], len(needle_tok))
cache = transformers.DynamicCache(config=model.config)
with torch.no_grad():
    model(input_ids=torch.tensor([ctx]), past_key_values=cache)
results = {}
budgets = [0.1, 0.2]
def diag(module, q, k, v, mask, dropout=0.0, scaling=None, **kw):
    B, H, Lq, D = q.shape; Hkv, n = k.shape[1], k.shape[2]; rep = H // Hkv
    allowed = torch.ones(Lq, n, dtype=torch.bool).tril(n - Lq)
    s = (q @ k.repeat_interleave(rep, 1).transpose(-1, -2)) * scaling
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)  # (1, H, Lq, n)
    out = p @ v.repeat_interleave(rep, 1)
    for budget in budgets:
        opts = RetrievalOptions(budget=budget)
        end = n - max(opts.window, Lq)
        idx = build_index(k, v, None, end, opts)
        C = idx.counts.shape[1]
        allowed_n = opts.keys_allowed_count(n); R = max(0, allowed_n - opts.sink - (n - end))
        for mode in ("group", "head", "oracle"):
            sel = torch.zeros(1, H, Lq, n, dtype=torch.bool)
            sel[..., :opts.sink] = True; sel[..., end:] = True
            if mode == "oracle":  # the R keys of highest dense probability before the window
                top = p[..., opts.sink:end].topk(R, -1).indices + opts.sink
                sel.scatter_(-1, top, True)
            else:
                hs = (q * scaling).view(1, Hkv, rep, Lq, D) @ idx.centroids_t.view(1, Hkv, 1, D, C)
                sc = hs.amax(2, keepdim=True).expand_as(hs) if mode == "group" else hs
                perm = sc.sort(dim=-1, descending=True, stable=True).indices
                sizes = idx.counts.view(1, Hkv, 1, 1, C).expand_as(perm).gather(-1, perm)
                take = (sizes.cumsum(-1) - sizes) < R  # whole clusters while room (last partially: count whole)
                chosen = torch.zeros_like(take).scatter_(-1, perm, take)  # (1,Hkv,rep,Lq,C)
                members = idx.members  # (G, C, cap)
                assign = torch.full((Hkv, n), -1)
                for g in range(Hkv):
                    for c in range(C):
                        cnt = int(idx.counts[g, c]); assign[g, members[g, c, :cnt]] = c
                a = assign.view(1, Hkv, 1, 1, n).expand(1, Hkv, rep, Lq, n)
                inidx = (a >= 0) & chosen.gather(-1, a.clamp(min=0))
                sel |= inidx.reshape(1, H, Lq, n)
            mass = (p * sel).sum(-1).mean().item()
            needle = p[..., sorted(needle_tok)].sum(-1)
            needle_cap = (p[..., sorted(needle_tok)] * sel[..., sorted(needle_tok)]).sum(-1)
            frac = (needle_cap.sum() / needle.sum().clamp(min=1e-12)).item()
            results.setdefault((budget, mode), []).append((module.layer_idx, mass, frac, needle.mean().item()))
    return out.transpose(1, 2).contiguous(), None
AttentionInterface.register("diag", diag)
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
AttentionMaskInterface.register("diag", sdpa_mask)
model.set_attn_implementation("diag")
with torch.no_grad():
    model(input_ids=torch.tensor([qn]), past_key_values=copy.deepcopy(cache))
for key, rows in results.items():
    m = sum(r[1] for r in rows) / len(rows); f = sum(r[2] for r in rows) / len(rows)
    print(key, "mean recall of attention mass %.3f" % m, "needle mass captured %.3f" % f,
          "worst layers", sorted(rows, key=lambda r: r[1])[:3])
