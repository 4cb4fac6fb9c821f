"""RULER-style long-context tasks, generated offline and seeded: needles in a haystack of real text.

The haystack is WikiText-2 (``../shared/data/wikitext-2/wiki.valid.tokens``; the test split is kept for
perplexity), detokenised into plain sentences. Three tasks after RULER (Hsieh et al. 2024):

* ``passkey``: one needle, "The pass key is 71432. Remember it. 71432 is the pass key.", at a random depth;
  the question asks for the pass key (5 digits).
* ``niah-multikey``: four needles "One of the special magic numbers for <word> is: <7 digits>." with different
  words at random depths; the question asks for one word's number, the other three are distractors.
* ``variable-tracking``: a chain "VAR ABCDE = 52741." then "VAR FGHIJ = VAR ABCDE." ... (4 variables) and a
  distractor chain with another value, statements in order at random depths; the question asks for every
  variable that holds the chain's value.

A sample is (context, question, answers): the context is the haystack with its needles, sized in tokens by a
caller-supplied counter (the model's tokenizer), so prompts have the requested length. Scoring
(:func:`score`) is RULER's string match: the fraction of expected answers found in the model's output.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

from .._checks import check_choice, check_int

__all__ = ["TASKS", "LongContextSample", "detokenize_wikitext", "haystack_sentences", "make_sample", "score"]

TASKS = ("passkey", "niah-multikey", "variable-tracking")

INSTRUCTION = {
    "passkey": "There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
               "memorize it. I will quiz you about it.",
    "niah-multikey": "Some special magic numbers are hidden inside the following text. Make sure to memorize them. "
                     "I will quiz you about the numbers afterwards.",
    "variable-tracking": "Memorize and track the chain of variable assignments hidden in the following text.",
}

WORDS = ("apple", "river", "candle", "tiger", "garden", "violin", "planet", "mirror", "pencil", "harbor",
         "falcon", "meadow", "lantern", "compass", "orchid", "glacier", "velvet", "anchor", "thunder", "saddle",
         "copper", "willow", "marble", "canyon", "pepper", "oyster", "ribbon", "summit", "quartz", "walnut")


@dataclass(frozen=True)
class LongContextSample:
    """task, context (haystack + needles), question, expected answers (strings to find), needle depths (0..1)."""

    task: str
    context: str
    question: str
    answers: tuple[str, ...]
    depths: tuple[float, ...]


def detokenize_wikitext(text: str) -> str:
    """WikiText's tokenised form back to plain text: " @-@ " -> "-", " , " -> ", ", headings dropped."""
    text = re.sub(r"^ ?=+ .* =+ ?$", "", text, flags=re.MULTILINE)
    for token, plain in ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."), (" , ", ", "), (" . ", ". "),
                         (" ; ", "; "), (" : ", ": "), (" 's", "'s"), ("( ", "("), (" )", ")"), (" n't", "n't")):
        text = text.replace(token, plain)
    return text.replace("<unk>", "thing")


def haystack_sentences(path: str | Path) -> list[str]:
    """The sentences of a WikiText file (detokenised), in order."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"haystack file {path} does not exist (expected WikiText-2's wiki.valid.tokens; see "
                         f"../shared/data/README.md)")
    text = detokenize_wikitext(path.read_text(encoding="utf-8"))
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text.replace("\n", " "))]
    return [s for s in sentences if len(s) > 20]


def _needles(task: str, rng: random.Random) -> tuple[list[str], str, tuple[str, ...]]:
    """(needle statements in order, question, answers)."""
    if task == "passkey":
        key = str(rng.randrange(10_000, 100_000))
        return ([f"The pass key is {key}. Remember it. {key} is the pass key."], "What is the pass key? Answer "
                "with the number only.", (key,))
    if task == "niah-multikey":
        words = rng.sample(WORDS, 4)
        numbers = [str(rng.randrange(1_000_000, 10_000_000)) for _ in words]
        needles = [f"One of the special magic numbers for {w} is: {n}." for w, n in zip(words, numbers, strict=True)]
        asked = rng.randrange(len(words))
        return needles, (f"What is the special magic number for {words[asked]} mentioned in the text? Answer with "
                         f"the number only."), (numbers[asked],)
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    names: set[str] = set()
    while len(names) < 8:
        names.add("".join(rng.choice(letters) for _ in range(5)))
    chain, distractor = sorted(names)[:4], sorted(names)[4:]
    rng.shuffle(chain)
    rng.shuffle(distractor)
    value, other = rng.sample(range(10_000, 100_000), 2)
    statements = []
    for names_, val in ((chain, value), (distractor, other)):
        statements.append([f"VAR {names_[0]} = {val}."] + [f"VAR {b} = VAR {a}." for a, b in pairwise(names_)])
    merged = [s for pair in zip(*statements, strict=True) for s in pair]  # the two chains interleaved, in order
    return merged, (f"Which variables are assigned the value {value}, directly or through other variables? List "
                    f"all of them."), tuple(chain)


def make_sample(task: str, length: int, sentences: Sequence[str], count_tokens: Callable[[str], int],
                seed: int) -> LongContextSample:
    """One sample of ``task`` whose context is about ``length`` tokens (by ``count_tokens``), from haystack
    ``sentences`` starting at a seeded offset; needles at seeded depths (sorted, so chains stay in order)."""
    check_choice("task", task, TASKS)
    check_int("length", length, minimum=64)
    if not sentences:
        raise ValueError("sentences must not be empty")
    rng = random.Random(f"{task}-{length}-{seed}")
    needles, question, answers = _needles(task, rng)
    budget = length - sum(count_tokens(n) for n in needles)
    start = rng.randrange(len(sentences))
    hay: list[str] = []
    used = 0
    while used < budget:
        sentence = sentences[(start + len(hay)) % len(sentences)]
        used += count_tokens(sentence)
        hay.append(sentence)
    depths = sorted(rng.uniform(0.05, 0.95) for _ in needles)
    slots = [min(len(hay), round(d * len(hay))) for d in depths]
    for offset, (slot, needle) in enumerate(zip(slots, needles, strict=True)):
        hay.insert(slot + offset, needle)
    return LongContextSample(task, " ".join(hay), question, answers, tuple(depths))


def score(output: str, answers: Sequence[str]) -> float:
    """RULER's string match: the fraction of ``answers`` that appear in ``output`` (case-insensitive)."""
    if not answers:
        raise ValueError("answers must not be empty")
    low = output.lower()
    return sum(a.lower() in low for a in answers) / len(answers)
