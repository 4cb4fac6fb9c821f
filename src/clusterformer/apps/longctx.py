"""``clusterformer longctx``: long-context inference of a pretrained decoder LLM with clustered key retrieval.

For every (task, length, sample) the prompt is split where the haystack ends: the context is prefilled once with
dense SDPA into the model's ``DynamicCache``; then, for every method, a copy of that cache receives the
question (through the chat template, one chunk of tokens) and the answer is decoded greedily -- both through
the method's attention. So the methods differ exactly where a long-context cache is read: the question's and
the answer's attention over the cached context (the setting of ClusterKV and Squeezed Attention; the prefill
itself stays dense). ``dense`` is the same path with SDPA, so every accuracy has its dense reference in the
same run, on the same prompts. A method with the option ``prefill_block`` (the sparse prefill) prefills the
context itself, through its own attention, into its own cache; its record then holds its own prefill time.

Perplexity (``--ppl-lengths``): windows of WikiText-2 *test* of each length; the first ``length - scored`` tokens
are prefilled densely, the last ``scored`` are fed in chunks of ``chunk`` tokens through each method, which
predicts them (the first from the dense prefill is not counted).

Methods are ``NAME[:key=value,...]`` with NAME ``dense`` or one of :func:`clusterformer.hf.interface_mechanisms`;
``--budget`` is given to every method that takes one unless its spec sets it. Results go to ``--json`` after
every sample (a rerun with the same arguments skips what is there).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._checks import check_int
from .._io import read_json, write_json
from .._specs import parse_spec
from ..attention.registry import DENSE, get, names
from ..data.ruler import INSTRUCTION, TASKS, detokenize_wikitext, haystack_sentences, make_sample, score

__all__ = ["LongContextConfig", "parse_method", "run_longctx", "summarize"]

MAX_NEW_TOKENS = {"passkey": 16, "niah-multikey": 24, "variable-tracking": 48}


def parse_method(spec: str, budget: float | int | None) -> tuple[str, str, dict[str, Any]]:
    """"NAME[:key=value,...]" -> (label, mechanism, options); the mechanisms that read a cache at a budget (the
    registry's kind ``"cache"``: cluster-retrieval, sink-window, oracle, quest) default to ``budget``."""
    mechanism, options = parse_spec(spec)
    if mechanism in names() and get(mechanism).kind == "cache" and budget is not None:
        options.setdefault("budget", budget)
    return spec.strip(), mechanism, options


@dataclass
class LongContextConfig:
    """What ``clusterformer longctx`` runs (see the module docstring)."""

    model: str = "smollm2"
    methods: list[str] = field(default_factory=lambda: [DENSE, "sink-window", "cluster-retrieval",
                                                        "cluster-retrieval:estimate_remainder=true"])
    budget: float | int | None = 0.1
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    samples: int = 3
    seed: int = 0
    ppl_lengths: list[int] = field(default_factory=list)
    ppl_windows: int = 2
    scored: int = 256
    chunk: int = 32
    data_dir: str = "../shared/data"
    json: str | None = None
    threads: int | None = None

    def __post_init__(self) -> None:
        decoders = ("smollm2",)  # the pretrained decoders clusterformer.hf.load_pretrained knows
        if self.model not in decoders:
            raise ValueError(f"model must be a pretrained decoder: one of {', '.join(decoders)}; got {self.model!r}")
        check_int("samples", self.samples, minimum=1)
        check_int("ppl_windows", self.ppl_windows, minimum=1)
        check_int("scored", self.scored, minimum=2)
        check_int("chunk", self.chunk, minimum=1)
        for length in [*self.lengths, *self.ppl_lengths]:
            check_int("lengths", length, minimum=128)
        for task in self.tasks:
            if task not in TASKS:
                raise ValueError(f"tasks must be among {', '.join(TASKS)}; got {task!r}")
        if not self.methods:
            raise ValueError("methods must not be empty")
        for length in self.ppl_lengths:
            if length <= self.scored:
                raise ValueError(f"ppl lengths must exceed scored={self.scored}; got {length}")


class _Methods:
    """Registers each method's attention function once; label -> attn_implementation name."""

    def __init__(self, config: LongContextConfig) -> None:
        from .. import hf

        self.names: dict[str, str] = {}
        self.own_prefill: set[str] = set()  # methods with a sparse prefill: they prefill the context themselves
        for index, spec in enumerate(config.methods):
            label, mechanism, options = parse_method(spec, config.budget)
            if options.get("prefill_block"):
                self.own_prefill.add(label)
            if mechanism == DENSE:
                if options:
                    raise ValueError("the dense method takes no options")
                self.names[label] = "sdpa"
                continue
            if mechanism not in hf.interface_mechanisms():
                raise ValueError(f"method {spec!r}: NAME must be dense or one of "
                                 f"{', '.join(hf.interface_mechanisms())}")
            if get(mechanism).interface_mode == "sequence":  # it cannot be causal: causal calls run dense
                options.setdefault("causal", "dense")
            self.names[label] = hf.register_attention(mechanism, name=f"clusterformer-longctx-{index}", **options)

    def use(self, model: torch.nn.Module, label: str) -> None:
        model.set_attn_implementation(self.names[label])  # each prompt has its own cache, hence its own index


def _chat_ids(tokenizer: Any, instruction: str, context: str, question: str) -> tuple[list[int], list[int]]:
    """(context ids, question ids): the chat-template prompt cut where the haystack ends."""
    marker = "\u2063QUESTION\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": f"{instruction}\n\n{context}\n\n{marker}"}],
                                         tokenize=False, add_generation_prompt=True)
    head, tail = text.split(marker)
    encode = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    return encode(head), encode(question + tail)


@torch.no_grad()
def _answer(model: torch.nn.Module, cache: Any, question: list[int], max_new_tokens: int,
            stop: set[int]) -> tuple[list[int], float]:
    """Greedy answer after feeding the question to a cache; (tokens, seconds per generated token)."""
    ids = torch.tensor([question])
    logits = model(input_ids=ids, cache=cache).logits[:, -1]
    out: list[int] = []
    start = time.perf_counter()
    for _ in range(max_new_tokens):
        token = int(logits.argmax(-1))
        if token in stop:
            break
        out.append(token)
        logits = model(input_ids=torch.tensor([[token]]), cache=cache).logits[:, -1]
    return out, (time.perf_counter() - start) / max(1, len(out))


def run_longctx(config: LongContextConfig, progress: bool = True) -> dict[str, Any]:
    """Run every task x length x sample x method (and the perplexity windows); returns the results dict
    (also written to ``config.json`` after every sample)."""
    import transformers

    from .. import hf

    if config.threads:
        torch.set_num_threads(config.threads)
    data = Path(config.data_dir) / "wikitext-2"
    sentences = haystack_sentences(data / "wiki.valid.tokens")
    methods = _Methods(config)
    model, tokenizer = hf.load_pretrained(config.model)
    out_path = Path(config.json) if config.json else None
    results = read_json(out_path, "") if out_path and out_path.is_file() else {}
    if results.get("config", {}).get("methods") not in (None, config.methods):
        raise ValueError(f"{out_path} holds results for other methods: {results['config']['methods']}")
    results["config"] = asdict(config)
    results.setdefault("samples", {})
    results.setdefault("perplexity", {})
    stop = {tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])}
    count = lambda s: len(tokenizer(s, add_special_tokens=False)["input_ids"])  # noqa: E731

    def save() -> None:
        if out_path:
            write_json(out_path, results)

    jobs = [(t, n, s) for n in config.lengths for t in config.tasks for s in range(config.samples)]
    for done, (task, length, s) in enumerate(jobs, 1):
        key = f"{task}/{length}/{s}"
        if key in results["samples"]:
            continue
        sample = make_sample(task, length, sentences, count, seed=config.seed * 1000 + s)
        context_ids, question_ids = _chat_ids(tokenizer, INSTRUCTION[task], sample.context, sample.question)
        overhead = len(context_ids) + len(question_ids) - length  # instruction, question, chat template
        if overhead > 0:  # the whole prompt, not just the haystack, has the requested length (same needles)
            sample = make_sample(task, max(64, length - overhead), sentences, count, seed=config.seed * 1000 + s)
            context_ids, question_ids = _chat_ids(tokenizer, INSTRUCTION[task], sample.context, sample.question)
        model.set_attn_implementation("sdpa")
        cache = transformers.DynamicCache(config=model.config)
        start = time.perf_counter()
        with torch.no_grad():
            model(input_ids=torch.tensor([context_ids]), cache=cache)
        record: dict[str, Any] = {"tokens": len(context_ids) + len(question_ids), "answers": list(sample.answers),
                                  "prefill_s": round(time.perf_counter() - start, 3), "methods": {}}
        for label in methods.names:
            methods.use(model, label)
            own: dict[str, float] = {}
            if label in methods.own_prefill:
                method_cache = transformers.DynamicCache(config=model.config)
                start = time.perf_counter()
                with torch.no_grad():
                    model(input_ids=torch.tensor([context_ids]), cache=method_cache)
                own["prefill_s"] = round(time.perf_counter() - start, 3)
            else:
                method_cache = copy.deepcopy(cache)
            tokens, per_token = _answer(model, method_cache, question_ids, MAX_NEW_TOKENS[task], stop)
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            record["methods"][label] = {"output": text, "score": score(text, sample.answers),
                                        "s_per_token": round(per_token, 5), **own}
        results["samples"][key] = record
        save()
        if progress:
            scores = " ".join(f"{m}={r['score']:.2f}" for m, r in record["methods"].items())
            print(f"[{done}/{len(jobs)}] {key} ({record['tokens']} tokens, prefill {record['prefill_s']:.1f} s): "
                  f"{scores}", flush=True)

    if config.ppl_lengths:
        text = detokenize_wikitext((data / "wiki.test.tokens").read_text(encoding="utf-8"))
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
        for length in config.ppl_lengths:
            for w in range(config.ppl_windows):
                key = f"{length}/{w}"
                if key in results["perplexity"] or (w + 1) * length > len(ids):
                    continue
                window = ids[w * length:(w + 1) * length].unsqueeze(0)
                results["perplexity"][key] = _window_nll(model, methods, window, config)
                save()
                if progress:
                    nll = " ".join(f"{m}={math.exp(v):.2f}" for m, v in results["perplexity"][key].items())
                    print(f"[ppl] {key}: {nll}", flush=True)
    results["summary"] = summarize(results)
    save()
    return results


@torch.no_grad()
def _window_nll(model: torch.nn.Module, methods: _Methods, window: torch.Tensor,
                config: LongContextConfig) -> dict[str, float]:
    """Mean next-token NLL of the last ``scored - 1`` tokens of ``window`` (1, length), per method."""
    import transformers

    split = window.shape[1] - config.scored
    model.set_attn_implementation("sdpa")
    cache = transformers.DynamicCache(config=model.config)
    model(input_ids=window[:, :split], cache=cache)
    out = {}
    for label in methods.names:
        methods.use(model, label)
        c = copy.deepcopy(cache)
        logits = [model(input_ids=window[:, i:i + config.chunk], cache=c).logits
                  for i in range(split, window.shape[1], config.chunk)]
        logits = torch.cat(logits, 1)[:, :-1]
        out[label] = float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                             window[0, split + 1:]))
    return out


def wilson_interval(correct: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval of a proportion correct / n (95% by default); (0, 1) without samples."""
    if n == 0:
        return 0.0, 1.0
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar_exact_p(lost: int, gained: int) -> float:
    """Two-sided exact McNemar test (a sign test on the discordant pairs): the probability, under "the method and
    dense are equally likely to be the one right", of a split of lost + gained at least as uneven as this one."""
    n = lost + gained
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(lost, gained) + 1)) / 2**n
    return min(1.0, 2 * tail)


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Per task / length / method: the mean score, the samples answered exactly (score 1: every answer found) with
    their 95% Wilson interval, and -- beside dense, sample by sample -- how many of dense's exact answers the method
    kept, how many it gained where dense missed, and the exact McNemar p-value of the difference. Also perplexity
    per length / method, the mean decoding time per generated token, and the mean prefill time (dense's shared
    prefill, and each sparse prefill's own)."""
    table: dict[str, dict[str, dict[str, dict[str, float]]]] = {}  # task -> length -> method -> sample -> score
    timing: dict[str, dict[str, list[float]]] = {}
    prefill: dict[str, dict[str, list[float]]] = {}  # length -> method -> seconds (dense's: the shared prefill)
    for key, record in results.get("samples", {}).items():
        task, length, sample = key.split("/")
        for label, r in record["methods"].items():
            table.setdefault(task, {}).setdefault(length, {}).setdefault(label, {})[sample] = r["score"]
            timing.setdefault(length, {}).setdefault(label, []).append(r["s_per_token"])
            seconds = record.get("prefill_s") if label == DENSE else r.get("prefill_s")
            if seconds is not None:
                prefill.setdefault(length, {}).setdefault(label, []).append(seconds)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    accuracy: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    for task, by_length in table.items():
        for length, by_method in by_length.items():
            dense = {s for s, v in by_method.get(DENSE, {}).items() if v == 1.0}
            for label, scores in by_method.items():
                exact = {s for s, v in scores.items() if v == 1.0}
                row: dict[str, Any] = {"mean": mean(list(scores.values())), "n": len(scores),
                                       "correct": len(exact), "wilson": wilson_interval(len(exact), len(scores))}
                if label != DENSE and DENSE in by_method:
                    shared = set(scores) & set(by_method[DENSE])  # samples both ran
                    kept, dense_here = exact & dense & shared, dense & shared
                    gained = (exact - dense) & shared
                    row.update({"dense_correct": len(dense_here), "kept": len(kept), "gained": len(gained),
                                "mcnemar_p": mcnemar_exact_p(len(dense_here) - len(kept), len(gained))})
                accuracy.setdefault(task, {}).setdefault(length, {})[label] = row
    ppl: dict[str, dict[str, float]] = {}
    nll: dict[str, dict[str, list[float]]] = {}
    for key, per_method in results.get("perplexity", {}).items():
        length = key.split("/")[0]
        for label, value in per_method.items():
            nll.setdefault(length, {}).setdefault(label, []).append(value)
    for length, ms in nll.items():
        ppl[length] = {m: math.exp(mean(v)) for m, v in ms.items()}
    return {"accuracy": accuracy, "perplexity": ppl,
            "s_per_token": {n: {m: mean(v) for m, v in ms.items()} for n, ms in timing.items()},
            "prefill_s": {n: {m: mean(v) for m, v in ms.items()} for n, ms in prefill.items()}}


def markdown(summary: dict[str, Any], methods: Sequence[str]) -> str:
    """The summary as markdown tables: mean score (%) per task and length; samples answered exactly with their 95%
    Wilson interval, and dense's exact answers each method kept (McNemar p against dense); perplexity per length."""
    lines = ["| task | tokens | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
    for task, by_length in summary["accuracy"].items():
        for length in sorted(by_length, key=int):
            row = by_length[length]
            cells = [f"{100 * row[m]['mean']:.0f}" if m in row else "" for m in methods]
            n = max(r["n"] for r in row.values())
            lines.append(f"| {task} (n={n}) | {length} | " + " | ".join(cells) + " |")
    lines += ["", "| exact answers (95% Wilson); of dense's, kept (McNemar p) | tokens | " + " | ".join(methods) + " |",
              "|---|---|" + "---|" * len(methods)]
    for task, by_length in summary["accuracy"].items():
        for length in sorted(by_length, key=int):
            row = by_length[length]
            cells = []
            for m in methods:
                r = row.get(m)
                if r is None or "correct" not in r:
                    cells.append("")
                    continue
                lo, hi = r["wilson"]
                cell = f"{r['correct']}/{r['n']} ({100 * lo:.0f}-{100 * hi:.0f}%)"
                if "kept" in r:
                    cell += f"; {r['kept']} of {r['dense_correct']}" + (f" +{r['gained']}" if r["gained"] else "")
                    cell += f" (p {r['mcnemar_p']:.2g})"
                cells.append(cell)
            lines.append(f"| {task} | {length} | " + " | ".join(cells) + " |")
    if summary["perplexity"]:
        lines += ["", "| perplexity | tokens | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
        for length in sorted(summary["perplexity"], key=int):
            row = summary["perplexity"][length]
            lines.append(f"| wikitext-2 test | {length} | " + " | ".join(f"{row[m]:.2f}" if m in row else ""
                                                                         for m in methods) + " |")
    if any(len(row) > 1 for row in summary.get("prefill_s", {}).values()):  # a sparse prefill beside dense's
        lines += ["", "| prefill, s (mean) | tokens | " + " | ".join(methods) + " |",
                  "|---|---|" + "---|" * len(methods)]
        for length in sorted(summary["prefill_s"], key=int):
            row = summary["prefill_s"][length]
            lines.append(f"| context | {length} | " + " | ".join(f"{row[m]:.2f}" if m in row else "--"
                                                                 for m in methods) + " |")
    return "\n".join(lines)


def plot(results: dict[str, Any], methods: Sequence[str], path: str | Path) -> None:
    """Accuracy (%) vs context length, one panel per task, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    accuracy = results["summary"]["accuracy"]
    fig, axes = plt.subplots(1, max(1, len(accuracy)), figsize=(4.2 * max(1, len(accuracy)), 3.4), squeeze=False)
    for ax, (task, by_length) in zip(axes[0], accuracy.items(), strict=False):
        lengths = sorted(by_length, key=int)
        for method in methods:
            ys = [100 * by_length[n][method]["mean"] for n in lengths if method in by_length[n]]
            ax.plot([int(n) for n in lengths if method in by_length[n]], ys, marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_title(task)
        ax.set_xlabel("context tokens")
        ax.set_ylabel("accuracy (%)")
        ax.set_ylim(-5, 105)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
