"""Whole-model prefill time of a pretrained decoder: dense SDPA vs sparse prefills
(docs/long-context-decoding.md#the-prefill).

A prompt of N tokens of real text (WikiText-2 *valid*, detokenised, through the model's tokenizer) is prefilled
into a fresh ``DynamicCache`` by the whole model, once per method and repeat, the methods interleaved within a
repeat so that every ratio comes from the same conditions:

* ``dense``: the model's own SDPA;
* each method of ``methods``: a cache reader of :mod:`clusterformer.attention.retrieval` given as
  ``NAME[:key=value,...]`` (``budget`` defaults to the run's), registered through
  :func:`clusterformer.hf.register_attention`; with ``prefill_block`` it reads the prompt sparsely (without it,
  a prefill is dense: a control for the interface's own overhead);
* ``no-attention`` (``floor=True``): attention replaced by zeros -- what the rest of the model costs, the floor
  under any sparse prefill. ``max_speedup`` = dense / floor is the most any attention, however sparse, can give.

Reported per (N, method): the median seconds over ``repeats`` and the speed-up over dense's median.
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._checks import check_int
from .._specs import parse_spec
from ..attention.registry import DENSE

__all__ = ["FLOOR", "PrefillBenchConfig", "prefill_table", "run_prefill_benchmark"]

FLOOR = "no-attention"


@dataclass
class PrefillBenchConfig:
    lengths: list[int]
    methods: list[str] = field(default_factory=lambda: ["cluster-retrieval:prefill_block=256",
                                                        "sink-window:prefill_block=256"])
    budget: float | int = 0.1
    model: str = "smollm2"
    repeats: int = 3
    floor: bool = True
    data_dir: str = "../shared/data"
    threads: int | None = None

    def __post_init__(self) -> None:
        check_int("repeats", self.repeats, minimum=1)
        if not self.lengths:
            raise ValueError("lengths must not be empty")
        for n in self.lengths:
            check_int("lengths entry", n, minimum=16)
        for spec in self.methods:
            name, _ = parse_spec(spec)
            if name in (DENSE, FLOOR):
                raise ValueError(f"methods: {name!r} is always timed; list the sparse methods only")


def _text_ids(tokenizer: Any, data_dir: str, lengths: list[int]) -> list[int]:
    """WikiText-2 valid, detokenised, as the model's token ids (enough for the longest of ``lengths``)."""
    from ..data.ruler import detokenize_wikitext

    path = Path(data_dir) / "wikitext-2" / "wiki.valid.tokens"
    if not path.is_file():
        raise ValueError(f"data_dir: {path} does not exist (WikiText-2, see ../shared/data/README.md)")
    ids = tokenizer(detokenize_wikitext(path.read_text(encoding="utf-8")), add_special_tokens=False)["input_ids"]
    if len(ids) < max(lengths):
        raise ValueError(f"lengths: WikiText-2 valid holds {len(ids)} tokens, fewer than {max(lengths)}")
    return ids


def _register_floor() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def no_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        B, _, Lq, _ = query.shape
        return query.new_zeros(B, Lq, query.shape[1], value.shape[-1]), None

    name = f"clusterformer-bench-{FLOOR}"
    AttentionInterface.register(name, no_attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def run_prefill_benchmark(config: PrefillBenchConfig, progress: Any = None) -> list[dict[str, Any]]:
    """Time every method's prefill at every length; returns one record per (length, method)."""
    import transformers

    from .. import hf

    if config.threads:
        torch.set_num_threads(config.threads)
    model, tokenizer = hf.load_pretrained(config.model)
    names = {"dense": "sdpa"}
    for index, spec in enumerate(config.methods):
        mechanism, options = parse_spec(spec)
        options.setdefault("budget", config.budget)
        names[spec] = hf.register_attention(mechanism, name=f"clusterformer-bench-prefill-{index}", **options)
    if config.floor:
        names[FLOOR] = _register_floor()
    text = _text_ids(tokenizer, config.data_dir, config.lengths)  # tokenised once, cut to each length
    records = []
    for length in config.lengths:
        ids = torch.tensor([text[:length]])
        times: dict[str, list[float]] = {label: [] for label in names}
        for repeat in range(config.repeats + 1):  # the first round warms up and is not counted
            for label, name in names.items():
                model.set_attn_implementation(name)
                cache = transformers.DynamicCache(config=model.config)
                start = time.perf_counter()
                with torch.no_grad():
                    model(input_ids=ids, cache=cache)
                if repeat:
                    times[label].append(time.perf_counter() - start)
            if progress and repeat:
                progress(f"[{length}] repeat {repeat}: " + ", ".join(f"{m} {t[-1]:.2f} s" for m, t in times.items()))
        dense = statistics.median(times["dense"])
        for label, seconds in times.items():
            median = statistics.median(seconds)
            records.append({"length": length, "method": label, "median_s": round(median, 4),
                            "speedup_vs_dense": round(dense / median, 3), "repeats": config.repeats,
                            "budget": config.budget, "threads": torch.get_num_threads(),
                            "machine": platform.processor() or platform.machine()})
    return records


def prefill_table(records: list[dict[str, Any]]) -> str:
    """Markdown: seconds and speed-up over dense per length and method."""
    methods = list(dict.fromkeys(r["method"] for r in records))
    lines = ["| tokens | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
    for length in sorted({r["length"] for r in records}):
        row = {r["method"]: r for r in records if r["length"] == length}
        lines.append(f"| {length} | " + " | ".join(
            f"{row[m]['median_s']:.2f} s ({row[m]['speedup_vs_dense']:.2f}x)" if m in row else "" for m in methods)
            + " |")
    return "\n".join(lines)
