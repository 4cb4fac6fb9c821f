"""Recall tasks: a query must read one distant token chosen by its *content*, so no fixed window shorter than the
distance can answer it. Both are token-level tasks: a label at each query position, ``-100`` (ignored) elsewhere.

* **MQAR**, multi-query associative recall (Arora, Eyuboglu et al. 2023, "Zoology: Measuring and improving recall
  in efficient language models", §3 and its ``multiquery_ar`` generator). A context of ``num_pairs`` key-value
  pairs ``k_1 v_1 k_2 v_2 ...`` (distinct keys, distinct values), then a query region of noise in which every key
  appears once more, at an even offset; the label at a key's second occurrence is its value::

      position  0   1   2   3   4  ...  q        ...
      token     k1  v1  k2  v2  n  ...  k2   n   ...       label at q: v2

  Query slots are drawn without replacement from the query region's even offsets, uniformly (``gap="uniform"``)
  or with Zoology's power law ``p(s) ∝ a s^(a - 1)`` over slots s = 1, 2, ... (``gap="power"``, ``power_a``), which
  puts most queries near the context. ``min_gap`` leaves that many noise tokens between the last pair and the
  query region, so every query is at least ``min_gap + 1`` tokens from its value.
  One deviation from Zoology: noise tokens come from a range of their own (Zoology draws them from the whole
  vocabulary, so a noise token can repeat a key). Here the answer is unique by construction and an independent
  reader can re-derive it (the tests do): the value that follows the query token's first occurrence.
* **Passkey retrieval** (Mohtashami & Jaggi 2023, "Landmark Attention: Random-Access Infinite Context Length for
  Transformers", §4.2; RULER's passkey, Hsieh et al. 2024), trained from scratch. Noise, with a needle ``PASS d_1
  ... d_m`` (a marker and ``m`` random digits) at a uniformly drawn depth, and at the end the question ``ASK S_1
  ... S_m``: the label at slot token ``S_j`` is digit ``d_j``.
* **Histogram** (counting; the ``hist`` task of Weiss, Goldberg & Yahav 2021, "Thinking Like Transformers", §3,
  asked at the end of a long context as RULER's aggregation tasks ask for the most frequent words, Hsieh et al.
  2024): a context of token types, each appearing ``1..max_count`` times at positions scattered uniformly, then a
  separator and ``num_queries`` distinct types of the context; the label at a query is how many times its type
  appears in the context::

      position  0    1   2   3   4  ...  N-Q-1  N-Q  ...
      token     BOS  t7  t2  t7  t9 ...  SEP    t7   ...       label at N-Q: 2 (the count of t7 before SEP)

  The BOS token is the anchor of every counting construction (RASP's selector width reads 1 / (count + 1) off the
  weight on BOS).

  Unlike MQAR and the passkey, the answer is spread over every position of the query's type, chosen by content
  alone: a query needs all of them. No window shorter than the context can count them, and no set of contiguous
  pages smaller than the occurrences' spread holds them all; a group of the query's own type does.
  ``labels="every"`` is Weiss et al.'s task itself, with a label at every position: its token's count in the
  sequence (bidirectional), or up to itself (``prefix``, the causal form) -- a thousand labels per sequence instead
  of Q: full attention learned that form at N = 128 where the end queries alone stayed at chance at N = 256
  (docs/recall-and-aggregation.md#histogram-aggregation-over-scattered-positions).

* **Multi-value recall**, two aggregation tasks over key-value pairs (MQAR's pairs, with each key repeated): a
  context of pairs ``k v`` in which a key appears with ``1..max_count`` values, its pairs scattered uniformly over
  the context, then a separator and ``num_queries`` distinct keys of the context. Values are ``values`` ordered
  tokens ``0..V-1``. The label at a query depends on *every* value of its key:

  - ``multivalue``: the key's **majority value**. One value holds a strict majority of the key's pairs (``c // 2 +
    1`` of its ``c``), the others are drawn from the rest; the majority value is uniform over the V values, so
    chance is 1 / V, and a reader that sees only some of the key's pairs is right less often.
  - ``maxvalue``: the **largest value** among the key's pairs (a selection by the values' order inside a group
    chosen by content). The largest is uniform over the V values; the key's other values are uniform below or
    equal to it, so the query must find the one pair that holds it among the key's pairs.

  ::

      position  0    1   2   3   4  ...  N-Q-1  N-Q  ...
      token     BOS  k7  v2  k3  v0 ...  SEP    k7   ...       label at N-Q: f(values of k7's pairs)

  As in the histogram, a query's needed keys are spread over the sequence and share one content (its key), so
  contiguous pages need many pages to hold them and random groups mix them with other keys, while a group of the
  key's own pairs holds them all. ``sources`` are the positions of the key's value tokens.

  With ``fused=True`` each pair is **one token** ``(k, v)`` (a vocabulary of K x V pair tokens), so the answer is
  one hop away: the query gathers the tokens of its key, where the two-token form first has to carry each key onto
  its value (an induction step). The aggregation itself is unchanged; ``sources`` are the key's pair tokens.

Forms. The same sequences serve a **causal** model (the paper's language-model form: the label sits at the query
token, and nothing after it is needed) and a **bidirectional** encoder that predicts the label at each query
position. Accuracy counts query positions only.

Seeds. Sequence ``i`` of a split is generated from its own seed, ``numpy.random.SeedSequence((seed, split, i))``,
so any sequence of a test set can be regenerated alone, and the training stream does not depend on the batch size.

Vocabulary (token 0 is padding and never appears): histogram: BOS ``1`` (the first token, the anchor against which
a count is read), separator ``2``, types ``[3, vocab_size)``. MQAR keys ``[1, 1 + K)``,
values ``[1 + K, 1 + 2K)``, noise ``[1 + 2K, vocab_size)`` with ``K = (vocab_size - 1 - noise) // 2`` and ``noise =
vocab_size // 4``. Multi-value: BOS ``1``, separator ``2``, a filler ``3`` (one, when the context is odd),
values ``[4, 4 + V)``, keys ``[4 + V, vocab_size)``; fused, keys (the queries) ``[4 + V, 4 + V + K)`` and pair
``(k, v)`` ``4 + V + K + k V + v``, with ``K = (vocab_size - 4 - V) // (V + 1)``. Passkey: digits ``1..10``,
marker ``11``, question ``12``, slots ``13..12+m``, noise the rest.

Each generated batch also gives, for every query, the position of the token that holds its answer (``sources``:
MQAR's value, the passkey's digit; the histogram's every occurrence, ``source_mask`` marking the real ones), which
:mod:`clusterformer.train.recall` uses for its key-recall diagnostic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .._checks import check_bool, check_choice, check_float, check_int

__all__ = ["AGGREGATES", "GAPS", "HISTOGRAM_LABELS", "RECALL_TASKS", "SPLITS", "HistogramSpec", "MQARSpec",
           "MultiValueSpec", "PasskeySpec", "RecallBatch", "SpreadSpec", "generate_recall", "read_histogram",
           "read_mqar", "read_multivalue", "read_passkey"]

GAPS = ("uniform", "power")
SPLITS = {"train": 0, "test": 1}
RECALL_TASKS = ("mqar", "passkey", "histogram", "multivalue", "maxvalue")
AGGREGATES = {"multivalue": "majority", "maxvalue": "max"}  # a multi-value task's name -> how it aggregates
HISTOGRAM_LABELS = ("queries", "every")
IGNORE = -100


@dataclass(frozen=True)
class MQARSpec:
    """The shape of an MQAR sequence.

    Attributes:
        length: tokens per sequence N (even).
        num_pairs: key-value pairs D (and queries), with 4 D <= N - min_gap as in Zoology.
        vocab_size: tokens including padding 0; a quarter is noise, the rest keys and values (>= D each).
        gap: where queries go in the query region: "uniform" or "power" (Zoology's power law).
        power_a: the power law's a (Zoology's default 0.01); used with gap="power".
        min_gap: noise tokens between the last pair and the first query slot.
    """

    length: int = 1024
    num_pairs: int = 32
    vocab_size: int = 1024
    gap: str = "uniform"
    power_a: float = 0.01
    min_gap: int = 0

    def __post_init__(self) -> None:
        check_int("length", self.length, minimum=4)
        if self.length % 2:
            raise ValueError(f"length must be even for MQAR (queries sit at even offsets), got {self.length}")
        check_int("num_pairs", self.num_pairs, minimum=1)
        check_int("min_gap", self.min_gap, minimum=0)
        check_choice("gap", self.gap, GAPS)
        check_float("power_a", self.power_a, minimum=0.0, exclusive_minimum=True, maximum=1.0)
        if self.slots < self.num_pairs:
            raise ValueError(f"num_pairs={self.num_pairs} queries do not fit: length={self.length} leaves "
                             f"{self.slots} query slots after {2 * self.num_pairs} context tokens and "
                             f"min_gap={self.min_gap}")
        check_int("vocab_size", self.vocab_size, minimum=2)
        if self.num_keys < self.num_pairs or self.noise_vocab < 1:
            raise ValueError(f"vocab_size={self.vocab_size} is too small for num_pairs={self.num_pairs}: it needs "
                             f"at least {self.num_pairs} keys, as many values and a noise quarter; use "
                             f">= {4 * self.num_pairs + 2}")

    @property
    def noise_vocab(self) -> int:
        return self.vocab_size // 4

    @property
    def num_keys(self) -> int:
        return (self.vocab_size - 1 - self.noise_vocab) // 2

    @property
    def query_start(self) -> int:
        return 2 * self.num_pairs + self.min_gap

    @property
    def slots(self) -> int:
        return (self.length - self.query_start) // 2


@dataclass(frozen=True)
class PasskeySpec:
    """The shape of a passkey sequence.

    Attributes:
        length: tokens per sequence N.
        digits: digits of the passkey m.
        vocab_size: tokens including padding 0 (digits, marker, question and slots take 12 + m; the rest is noise).
        min_gap: the needle ends at least this many tokens before the question.
    """

    length: int = 1024
    digits: int = 5
    vocab_size: int = 64
    min_gap: int = 0

    def __post_init__(self) -> None:
        check_int("digits", self.digits, minimum=1)
        check_int("min_gap", self.min_gap, minimum=0)
        check_int("vocab_size", self.vocab_size, minimum=self.first_noise + 1)
        check_int("length", self.length, minimum=2 * (self.digits + 1) + self.min_gap)

    @property
    def first_noise(self) -> int:
        return 13 + self.digits

    MARKER = 11
    QUESTION = 12


@dataclass(frozen=True)
class SpreadSpec:
    """What the tasks whose query needs many scattered tokens share (:class:`HistogramSpec`,
    :class:`MultiValueSpec`): a BOS, a context, a separator and ``num_queries`` queries; each kind appears up to
    ``max_count`` times; ``labels`` "queries" (the end queries) or "every" (also the context's positions), counted
    up to each position when ``prefix`` (the causal form)."""

    length: int = 1024
    max_count: int = 8
    num_queries: int = 32
    vocab_size: int = 1024
    labels: str = "queries"
    prefix: bool = False

    BOS = 1
    SEPARATOR = 2

    def __post_init__(self) -> None:
        check_int("max_count", self.max_count, minimum=1)
        check_int("num_queries", self.num_queries, minimum=1)
        check_choice("labels", self.labels, HISTOGRAM_LABELS)
        if self.prefix and self.labels != "every":
            raise ValueError("prefix=True counts up to each position, for labels='every' only")


@dataclass(frozen=True)
class HistogramSpec(SpreadSpec):
    """The shape of a histogram sequence.

    Attributes:
        length: tokens per sequence N: BOS, a context of N - num_queries - 2 tokens, the separator, the queries.
        max_count: the largest count C; each type of the context appears 1..C times (uniformly, unless the
            vocabulary is so small that the counts must be raised to fill the context).
        num_queries: queries Q, distinct types of the context.
        vocab_size: tokens including padding, BOS and separator; types are ``[3, vocab_size)``, at least
            (N - Q - 2) / C of them, so that the context can be filled.
        labels: "queries" (the Q queries after the separator, each labelled with its type's count in the context)
            or "every" (Weiss et al.'s ``hist`` itself: every position but BOS and the separator is a query,
            labelled with its token's count in the sequence -- up to and including it when ``prefix``; counts reach
            C + 1, as a query type's own occurrence after the separator counts too).
        prefix: with labels="every", count only the occurrences up to the position (what a causal model sees).
    """

    FIRST_TYPE = 3

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("length", self.length, minimum=self.num_queries * self.max_count + self.num_queries + 2)
        check_int("vocab_size", self.vocab_size, minimum=self.FIRST_TYPE + max(self.num_queries,
                                                                              -(-self.context // self.max_count)))

    @property
    def needed(self) -> int:
        """S, the most keys a query needs: C in the context, and with labels="every" the query type's own."""
        return self.max_count + (self.labels == "every")

    @property
    def context(self) -> int:
        """Tokens between BOS and the separator."""
        return self.length - self.num_queries - 2

    @property
    def types(self) -> int:
        return self.vocab_size - self.FIRST_TYPE


@dataclass(frozen=True)
class MultiValueSpec(SpreadSpec):
    """The shape of a multi-value sequence (tasks ``multivalue`` and ``maxvalue``).

    Attributes:
        length: tokens per sequence N: BOS, a context of pairs (and a filler when it is odd), the separator, the
            queries.
        aggregate: "majority" (the key's majority value; task ``multivalue``) or "max" (its largest; ``maxvalue``).
        max_count: C, the most pairs a key has; each key of the context has 1..C (uniformly, unless the keys are
            too few to fill the context).
        num_queries: queries Q, distinct keys of the context.
        values: V, the value tokens; the answer is one of them (chance 1 / V).
        vocab_size: tokens including padding, BOS, separator and filler; keys are ``[4 + V, vocab_size)``, at least
            (pairs) / C of them, so that the context can be filled.
        labels: "queries" (the Q queries after the separator) or "every" (also every value token of the context,
            labelled with the aggregate of its key's values -- up to and including it when ``prefix``, the causal
            form; a running majority's ties go to the smallest value). As with the histogram, a model learns the
            dense form far sooner.
        prefix: with labels="every", aggregate only the pairs up to the position (what a causal model sees).
        fused: each pair is one token ``(k, v)`` instead of ``k`` then ``v`` (no filler; with labels="every" every
            pair token is labelled).
    """

    aggregate: str = "majority"
    values: int = 8
    fused: bool = False

    FILLER = 3
    FIRST_VALUE = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("aggregate", self.aggregate, tuple(AGGREGATES.values()))
        check_bool("fused", self.fused)
        check_int("values", self.values, minimum=2)
        width = 1 if self.fused else 2  # tokens per pair
        check_int("length", self.length, minimum=width * self.num_queries * self.max_count + self.num_queries + 2)
        keys_needed = max(self.num_queries, -(-self.pairs // self.max_count))
        check_int("vocab_size", self.vocab_size,
                  minimum=self.first_key + keys_needed * (self.values + 1 if self.fused else 1))

    @property
    def query_count(self) -> int:
        """Labelled positions per sequence: the Q end queries, and with labels="every" every pair's value too."""
        return self.num_queries + (self.pairs if self.labels == "every" else 0)

    @property
    def first_key(self) -> int:
        return self.FIRST_VALUE + self.values

    @property
    def pairs(self) -> int:
        """Key-value pairs in the context."""
        return (self.length - self.num_queries - 2) // (1 if self.fused else 2)

    @property
    def keys(self) -> int:
        """K, the key tokens (fused: each also has its V pair tokens)."""
        return (self.vocab_size - self.first_key) // (self.values + 1 if self.fused else 1)

    @property
    def first_pair(self) -> int:
        """The fused form's first pair token, ``(0, 0)``."""
        return self.first_key + self.keys

    def pair_positions(self, pair: np.ndarray) -> np.ndarray:
        """The position of the token that holds pair j's value: j's own token when fused, else its value token."""
        return 1 + pair if self.fused else 2 + 2 * pair


@dataclass
class RecallBatch:
    """Sequences of a recall task.

    Attributes:
        ids: (n, N) long tokens.
        targets: (n, N) long, the answer at each query position and -100 elsewhere.
        queries: (n, Q) long, the query positions.
        sources: (n, Q) long, for each query the position of the token that holds its answer; or (n, Q, S) when a
            query needs several (the histogram: every occurrence of its type, padded with its first).
        source_mask: None, or (n, Q, S) bool marking the real entries of a padded ``sources``.
    """

    ids: torch.Tensor
    targets: torch.Tensor
    queries: torch.Tensor
    sources: torch.Tensor
    source_mask: torch.Tensor | None = None


def _rng(seed: int, split: str, index: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence((seed, SPLITS[split], index)))


def _mqar_one(spec: MQARSpec, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    D, K = spec.num_pairs, spec.num_keys
    keys = 1 + rng.choice(K, size=D, replace=False)
    values = 1 + K + rng.choice(K, size=D, replace=False)
    tokens = 1 + 2 * K + rng.integers(0, spec.noise_vocab, size=spec.length)
    tokens[0 : 2 * D : 2], tokens[1 : 2 * D : 2] = keys, values
    if spec.gap == "power":  # Zoology: p(s) ∝ a s^(a-1) over slots s = 1..S
        p = spec.power_a * np.arange(1, spec.slots + 1) ** (spec.power_a - 1)
        slot = rng.choice(spec.slots, size=D, replace=False, p=p / p.sum())
    else:
        slot = rng.choice(spec.slots, size=D, replace=False)
    queries = spec.query_start + 2 * slot  # query of pair i
    tokens[queries] = keys
    return tokens, queries, values, 2 * np.arange(D) + 1


def _passkey_one(spec: PasskeySpec, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    m, N = spec.digits, spec.length
    tokens = spec.first_noise + rng.integers(0, spec.vocab_size - spec.first_noise, size=N)
    question = N - m - 1
    depth = int(rng.integers(0, question - spec.min_gap - m))  # needle at depth..depth + m, before the gap
    digits = 1 + rng.integers(0, 10, size=m)
    tokens[depth] = PasskeySpec.MARKER
    tokens[depth + 1 : depth + 1 + m] = digits
    tokens[question] = PasskeySpec.QUESTION
    queries = question + 1 + np.arange(m)
    tokens[queries] = 13 + np.arange(m)
    return tokens, queries, digits, depth + 1 + np.arange(m)


def _fill_counts(rng: np.random.Generator, kinds: int, most: int, total: int) -> tuple[np.ndarray, np.ndarray]:
    """Counts in 1..``most`` for kinds drawn in a random order until they sum to ``total`` (the last one cut to what
    is left, still >= 1); a shortfall when every kind is used is spread over the kinds' room below ``most``.
    Returns (the kinds used, in their drawn order; their counts)."""
    order = rng.permutation(kinds)
    counts = rng.integers(1, most + 1, size=kinds)
    ends = np.cumsum(counts)
    used = min(int(np.searchsorted(ends, total)) + 1, kinds)  # kinds needed to reach the total
    counts = counts[:used].copy()
    counts[-1] -= max(0, int(ends[used - 1]) - total)
    if counts.sum() < total:  # every kind used: raise counts, one unit of room at a time, without passing `most`
        room = np.repeat(np.arange(used), most - counts)
        counts += np.bincount(rng.choice(room, size=total - int(counts.sum()), replace=False), minlength=used)
    return order[:used], counts


def _multivalue_one(spec: MultiValueSpec, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    P, Q, C, V = spec.pairs, spec.num_queries, spec.max_count, spec.values
    keys, counts = _fill_counts(rng, spec.keys, C, P)
    answer = rng.integers(0, V, size=len(keys))  # each key's answer, uniform over the values
    owner = np.repeat(np.arange(len(keys)), counts)  # the key of each pair, grouped by key
    rank = np.arange(P) - np.repeat(np.cumsum(counts) - counts, counts)  # the pair's index within its key
    if spec.aggregate == "majority":  # the first c // 2 + 1 pairs of a key hold its answer, the rest another value
        other = (answer[owner] + rng.integers(1, V, size=P)) % V
        value = np.where(rank <= counts[owner] // 2, answer[owner], other)
    else:  # the first pair holds the largest, the rest are uniform in 0..largest
        value = np.where(rank == 0, answer[owner], np.floor(rng.random(P) * (answer[owner] + 1)).astype(np.int64))
    shuffle = rng.permutation(P)  # scatters each key's pairs uniformly over the context
    owner, value = owner[shuffle], value[shuffle]
    if spec.fused:
        context = spec.first_pair + keys[owner] * V + value
    else:
        context = np.empty(2 * P, dtype=np.int64)
        context[0::2], context[1::2] = spec.first_key + keys[owner], MultiValueSpec.FIRST_VALUE + value
    filler = [MultiValueSpec.FILLER] * (spec.length - Q - 2 - len(context))
    asked = rng.choice(len(keys), size=Q, replace=False)
    tokens = np.concatenate([[MultiValueSpec.BOS], context, filler, [MultiValueSpec.SEPARATOR],
                             spec.first_key + keys[asked]]).astype(np.int64)
    queries = spec.length - Q + np.arange(Q)
    # sources: the positions of each asked key's value tokens (1 + 2 j + 1 for pair j), padded with the first
    by_owner = np.argsort(owner, kind="stable")  # pairs grouped by key, in context order
    start = np.cumsum(np.bincount(owner, minlength=len(keys))) - counts
    seen = counts[asked]  # an end query sees every pair of its key
    answers, groups = answer[asked], asked
    if spec.labels == "every":  # every value token asks too, for its own key's values (so far, with prefix)
        rank = np.empty(P, dtype=np.int64)
        rank[by_owner] = np.arange(P) - start[owner[by_owner]]  # the pair's index among its key's, in context order
        so_far = np.cumsum(np.eye(V, dtype=np.int64)[value[by_owner]], axis=0)  # running value counts, grouped
        before = np.vstack([np.zeros((1, V), dtype=np.int64), so_far])[start]  # each key's counts before its first
        tally = np.empty_like(so_far)
        tally[by_owner] = so_far - before[owner[by_owner]]  # each pair: its key's value counts up to it
        if not spec.prefix:
            tally = (so_far[start + counts - 1] - before)[owner]  # each pair: all its key's value counts
        own = tally.argmax(-1) if spec.aggregate == "majority" else V - 1 - (tally[:, ::-1] > 0).argmax(-1)
        queries = np.concatenate([spec.pair_positions(np.arange(P)), queries])
        answers, groups = np.concatenate([own, answers]), np.concatenate([owner, groups])
        seen = np.concatenate([rank + 1 if spec.prefix else counts[owner], seen])
    valid = np.arange(C)[None, :] < seen[:, None]
    pair = by_owner[start[groups][:, None] + np.where(valid, np.arange(C)[None, :], 0)]
    return tokens, queries, answers, spec.pair_positions(pair), valid


def _histogram_one(spec: HistogramSpec, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    L, Q, C = spec.context, spec.num_queries, spec.max_count
    # Every type draws a count in 1..C until the context is full; shuffling the multiset scatters each type's
    # occurrences uniformly.
    types, counts = _fill_counts(rng, spec.types, C, L)
    context = rng.permutation(np.repeat(HistogramSpec.FIRST_TYPE + types, counts))
    asked = rng.choice(len(types), size=Q, replace=False)
    query_types = HistogramSpec.FIRST_TYPE + types[asked]
    tokens = np.concatenate([[HistogramSpec.BOS], context, [HistogramSpec.SEPARATOR], query_types])
    # Each type's positions, in order, from one stable sort: a query's needed keys are the first `answers` of its
    # type's run (O(N log N), where comparing every position with every other would be O(N^2) per sequence).
    by_type = np.argsort(tokens, kind="stable")
    start = np.searchsorted(tokens[by_type], tokens)  # where each position's type begins in `by_type`
    size = np.bincount(tokens)[tokens]
    rank = np.empty_like(by_type)
    rank[by_type] = np.arange(spec.length) - start[by_type]  # the occurrence's index within its type
    if spec.labels == "every":  # every position but BOS and the separator asks for its own token
        queries = np.delete(np.arange(1, spec.length), L)
        answers = rank[queries] + 1 if spec.prefix else size[queries]
    else:  # the end queries: their type's occurrences in the context, all before the query's own (the last)
        queries = L + 2 + np.arange(Q)
        answers = size[queries] - 1
    # sources: every needed occurrence of each query's type, padded with the first one
    valid = np.arange(spec.needed)[None, :] < answers[:, None]
    sources = by_type[start[queries][:, None] + np.where(valid, np.arange(spec.needed)[None, :], 0)]
    return tokens, queries, answers, sources, valid


def generate_recall(spec: MQARSpec | PasskeySpec | HistogramSpec | MultiValueSpec, seed: int, split: str,
                    start: int, count: int) -> RecallBatch:
    """Sequences ``start .. start + count - 1`` of ``split`` ("train" or "test"), each from its own seed."""
    check_choice("split", split, tuple(SPLITS))
    check_int("start", start, minimum=0)
    check_int("count", count, minimum=0)
    if isinstance(spec, SpreadSpec):
        return _spread_batch(spec, seed, split, start, count)
    one = _mqar_one if isinstance(spec, MQARSpec) else _passkey_one
    # One generator per sequence: data generation, a loop over the examples of a batch, not a hot path.
    rows = [one(spec, _rng(seed, split, start + i)) for i in range(count)]
    width = spec.num_pairs if isinstance(spec, MQARSpec) else spec.digits
    if not rows:
        empty = torch.zeros(0, width, dtype=torch.long)
        return RecallBatch(torch.zeros(0, spec.length, dtype=torch.long),
                           torch.zeros(0, spec.length, dtype=torch.long), empty, empty)
    ids = torch.from_numpy(np.stack([r[0] for r in rows])).long()
    queries = torch.from_numpy(np.stack([r[1] for r in rows])).long()
    answers = torch.from_numpy(np.stack([r[2] for r in rows])).long()
    sources = torch.from_numpy(np.stack([r[3] for r in rows])).long()
    targets = torch.full_like(ids, IGNORE).scatter_(1, queries, answers)
    return RecallBatch(ids, targets, queries, sources)


def _spread_batch(spec: SpreadSpec, seed: int, split: str, start: int, count: int
                  ) -> RecallBatch:
    """The tasks whose query needs several tokens (``sources`` (n, Q, S) with ``source_mask``)."""
    if isinstance(spec, MultiValueSpec):
        Q, C, one = spec.query_count, spec.max_count, _multivalue_one
    else:
        Q, C, one = spec.num_queries if spec.labels == "queries" else spec.length - 2, spec.needed, _histogram_one
    rows = [one(spec, _rng(seed, split, start + i)) for i in range(count)]  # data, not a hot path
    if not rows:
        return RecallBatch(torch.zeros(0, spec.length, dtype=torch.long), torch.zeros(0, spec.length, dtype=torch.long),
                           torch.zeros(0, Q, dtype=torch.long), torch.zeros(0, Q, C, dtype=torch.long),
                           torch.zeros(0, Q, C, dtype=torch.bool))
    ids, queries, answers, sources, valid = (torch.from_numpy(np.stack([r[k] for r in rows])) for k in range(5))
    targets = torch.full_like(ids, IGNORE).scatter_(1, queries, answers.long())
    return RecallBatch(ids.long(), targets, queries.long(), sources.long(), valid)


def read_histogram(tokens: list[int], labels: str = "queries", prefix: bool = False) -> dict[int, int]:
    """An independent reader: {query position: count}. labels="queries": a query is a token after the separator,
    its answer the number of times it appears before the separator; "every": every token but BOS and the
    separator is a query, its answer the number of times it appears in the sequence (up to itself when
    ``prefix``)."""
    separator = tokens.index(HistogramSpec.SEPARATOR)
    if labels == "queries":
        context = tokens[:separator]
        return {separator + 1 + i: context.count(token) for i, token in enumerate(tokens[separator + 1:])}
    return {position: (tokens[:position + 1] if prefix else tokens).count(token)
            for position, token in enumerate(tokens) if token not in (HistogramSpec.BOS, HistogramSpec.SEPARATOR)}


def read_multivalue(tokens: list[int], spec: MultiValueSpec) -> dict[int, int]:
    """An independent reader: {query position: answer}. A query is a token after the separator; its answer is the
    majority (``aggregate="majority"``) or the largest (``"max"``) of the values (token - 4) that follow its
    occurrences as a key in the context. With labels="every" each value token of the context is a query too, for its
    key's values (up to and including it when ``prefix``; a tie of the running majority goes to the smallest).
    Fused, pair token t is key ``first_key + (t - first_pair) // V`` with value ``(t - first_pair) % V``."""
    separator = tokens.index(MultiValueSpec.SEPARATOR)
    V = spec.values
    if spec.fused:  # (position of the pair's value, its key token, its value)
        pairs = [(p, spec.first_key + (tokens[p] - spec.first_pair) // V, (tokens[p] - spec.first_pair) % V)
                 for p in range(1, separator)]
    else:  # pairs sit at 1, 3, 5, ...: the key, then its value
        pairs = [(p + 1, tokens[p], tokens[p + 1] - MultiValueSpec.FIRST_VALUE) for p in range(1, separator - 1, 2)
                 if tokens[p] != MultiValueSpec.FILLER]
    found: dict[int, list[int]] = {}
    for _, key, value in pairs:
        found.setdefault(key, []).append(value)

    def aggregate(values: list[int]) -> int:
        if spec.aggregate == "max":
            return max(values)
        return max(sorted(set(values)), key=values.count)  # the most frequent; among ties the smallest

    answers = {}
    if spec.labels == "every":
        so_far: dict[int, list[int]] = {}
        for position, key, value in pairs:
            so_far.setdefault(key, []).append(value)
            answers[position] = aggregate(so_far[key] if spec.prefix else found[key])
    for position in range(separator + 1, len(tokens)):
        answers[position] = aggregate(found[tokens[position]])
    return answers


def read_mqar(tokens: list[int], spec: MQARSpec) -> dict[int, int]:
    """An independent reader: {query position: answer} from the tokens alone. A query is a key token (< 1 + K)
    seen for the second time; its answer is the token after the key's first occurrence."""
    first: dict[int, int] = {}
    answers = {}
    for position, token in enumerate(tokens):
        if 1 <= token < 1 + spec.num_keys:
            if token in first:
                answers[position] = tokens[first[token] + 1]
            else:
                first[token] = position
    return answers


def read_passkey(tokens: list[int], spec: PasskeySpec) -> dict[int, int]:
    """An independent reader: {slot position: digit} -- the j-th slot token after the question asks for the j-th
    token after the marker."""
    marker = tokens.index(PasskeySpec.MARKER)
    return {position: tokens[marker + 1 + (token - 13)] for position, token in enumerate(tokens)
            if 13 <= token < 13 + spec.digits}
