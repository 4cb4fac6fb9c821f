"""The recall and aggregation tasks of ``clusterformer train``: ``--task mqar``, ``--task passkey``, and the tasks whose
query needs many scattered tokens of one content, ``--task histogram``, ``--task multivalue`` (a key's majority
value) and ``--task maxvalue`` (its largest value) (:mod:`clusterformer.data.recall`).

A token-level task: the model (:class:`clusterformer.models.TokenClassifier`, causal or bidirectional by ``form``)
gives logits over the vocabulary at every position; the loss and the accuracy count query positions only.

Data. Training sequence i is sequence i of the "train" split of the data seed (:data:`DATA_SEED`, fixed, as
ListOps's data, so seeds compare models on one data set); an epoch is ``limit`` sequences (default
:data:`TRAIN_SEQUENCES`) in the order of a permutation drawn from ``seed + epoch``, generated as the batches need
them. The test set is the first ``test_sequences`` of the "test" split.

Evaluation reports, beside accuracy over all queries, the accuracy of queries nearer and farther than
``far`` tokens from the token that answers them (what a window of that size could and could not see), and the
**key recall** of :func:`clusterformer.attention.diagnostics.key_recall` on the first ``recall_sequences`` test
sequences: per layer, the fraction of (query, head) pairs whose needed token (:meth:`RecallTask.needed`: the answer's
token; in bidirectional MQAR, the answer or the key before it) is inside the attended set
(``key_recall``), the fraction of queries for which some head sees it (``key_recall_any_head``), the mean
attention weight on it (``key_weight``), and the fractions in which it weighs more than every other key of the head
(``key_argmax``, ``key_argmax_any_head``): a summary of many keys gives each member a small positive weight, so
recall alone cannot tell a key read as the answer from one averaged in. The histogram's query needs every occurrence
of its type: ``key_recall`` counts a (query, head) pair that sees one of them, and ``key_coverage`` is the mean share
of them it sees (``key_coverage_best_head``: the best head's, per query; ``key_coverage_all``: the share of (query,
head) pairs that see them all). (Some recorded
metrics hold ``key_top``, which counted a tie with the other members of a summary as the largest; it is not computed.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_choice, check_int, check_options
from ..attention.diagnostics import SourceWeights, key_recall
from ..data.recall import (
    AGGREGATES,
    IGNORE,
    RECALL_TASKS,
    HistogramSpec,
    MQARSpec,
    MultiValueSpec,
    PasskeySpec,
    RecallBatch,
    SpreadSpec,
    generate_recall,
)
from ..models import EncoderConfig, TokenClassifier
from .batch import Batch, Predict

__all__ = ["DATA_SEED", "FORMS", "TRAIN_SEQUENCES", "RecallOptions", "RecallTask", "prepare_recall"]

DATA_SEED = 0
TRAIN_SEQUENCES = 20_000
FORMS = ("causal", "bidirectional")


@dataclass(frozen=True)
class RecallOptions:
    """The options of the recall tasks (``train --task-options`` or the flags that fill it).

    Attributes:
        form: "causal" (the language-model form: a causal model) or "bidirectional" (an encoder).
        num_pairs, vocab_size, gap, power_a: MQAR's shape (:class:`clusterformer.data.recall.MQARSpec`);
            ``vocab_size`` is the other tasks' vocabulary too (None: 1,024 for MQAR and the histogram, 64 for the
            passkey).
        digits: the passkey's digits.
        max_count, num_queries, labels: the histogram's largest count, its queries and which positions are
            labelled (:class:`clusterformer.data.recall.HistogramSpec`; with labels="every" the causal form counts
            up to each position, the bidirectional form the whole sequence); ``max_count`` and ``num_queries`` are
            also the multi-value tasks' most pairs per key and queries, and ``labels`` which positions they label.
        values: the multi-value tasks' value tokens V (:class:`clusterformer.data.recall.MultiValueSpec`).
        fused: the multi-value tasks' pairs are one token ``(k, v)`` each, the one-hop form.
        min_gap: tokens between a needed token and the first query (MQAR: between the last pair and the query
            region; passkey: between the needle and the question).
        test_sequences: sequences of the test split evaluated.
        far: the distance that splits ``accuracy_near`` (<= far) from ``accuracy_far``.
        recall_sequences: test sequences on which the key recall is measured (0: not measured).
    """

    form: str = "causal"
    num_pairs: int = 32
    vocab_size: int | None = None
    gap: str = "uniform"
    power_a: float = 0.01
    digits: int = 5
    max_count: int = 8
    num_queries: int = 32
    labels: str = "queries"
    values: int = 8
    fused: bool = False
    min_gap: int = 0
    test_sequences: int = 1000
    far: int = 256
    recall_sequences: int = 64

    def __post_init__(self) -> None:
        check_choice("form", self.form, FORMS)
        check_int("test_sequences", self.test_sequences, minimum=1)
        check_int("far", self.far, minimum=0)
        check_int("recall_sequences", self.recall_sequences, minimum=0)

    def spec(self, task: str, length: int) -> MQARSpec | PasskeySpec | HistogramSpec | MultiValueSpec:
        if task in AGGREGATES:
            return MultiValueSpec(length=length, aggregate=AGGREGATES[task], max_count=self.max_count,
                                  num_queries=self.num_queries, values=self.values, vocab_size=self.vocab_size or 1024,
                                  labels=self.labels, prefix=self.labels == "every" and self.form == "causal",
                                  fused=self.fused)
        if task == "histogram":
            return HistogramSpec(length=length, max_count=self.max_count, num_queries=self.num_queries,
                                 vocab_size=self.vocab_size or 1024, labels=self.labels,
                                 prefix=self.labels == "every" and self.form == "causal")
        if task == "mqar":
            return MQARSpec(length=length, num_pairs=self.num_pairs, vocab_size=self.vocab_size or 1024, gap=self.gap,
                            power_a=self.power_a, min_gap=self.min_gap)
        return PasskeySpec(length=length, digits=self.digits, vocab_size=self.vocab_size or 64, min_gap=self.min_gap)


def recall_options(options: dict[str, Any]) -> RecallOptions:
    """Validate a task-options dict (unknown names are refused, naming the valid ones)."""
    return check_options(RecallOptions, options, "task option")


@dataclass
class RecallTask:
    """A :class:`clusterformer.train.tasks.Task` for the recall and aggregation tasks."""

    name: str
    spec: MQARSpec | PasskeySpec | HistogramSpec | MultiValueSpec
    options: RecallOptions
    train_sequences: int
    test: RecallBatch = field(repr=False)
    metric: str = "accuracy"
    info: dict[str, Any] = field(default_factory=dict)
    kind: str = "recall"
    tokenizer: str = "recall"

    @property
    def causal(self) -> bool:
        """The model is causal (the language-model form)."""
        return self.options.form == "causal"

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def num_classes(self) -> int:
        """The passkey and MQAR answer with a token; the histogram with a count 0..max_count (max_count + 1 with
        labels="every", where a queried type's own occurrence counts too); the multi-value tasks with one of their
        V values."""
        if isinstance(self.spec, HistogramSpec):
            return self.spec.needed + 1
        if isinstance(self.spec, MultiValueSpec):
            return self.spec.values
        return self.spec.vocab_size

    def build_model(self, encoder: EncoderConfig) -> nn.Module:
        return TokenClassifier(encoder, self.num_classes, causal=self.causal)

    def model_max_len(self, max_len: int) -> int:
        return max_len

    def steps_per_epoch(self, batch_size: int, world: int) -> int:
        steps = self.train_sequences // (batch_size * world)
        if steps == 0:
            raise ValueError(f"--limit {self.train_sequences} training sequences are fewer than batch_size * "
                             f"world_size = {batch_size * world}")
        return steps

    def batch(self, step: int, per_epoch: int, batch_size: int, rank: int, world: int, seed: int) -> Batch:
        """Epoch e visits the permutation of the training sequences drawn from ``seed + e``; rank r generates
        the r-th slice of ``batch_size`` of the step's run."""
        B = batch_size
        epoch, within = divmod(step, per_epoch)
        order = torch.randperm(self.train_sequences, generator=torch.Generator().manual_seed(seed + epoch))
        index = order[within * world * B:(within + 1) * world * B][rank * B:(rank + 1) * B].tolist()
        rows = [generate_recall(self.spec, DATA_SEED, "train", i, 1) for i in index]  # each from its own seed
        return Batch(torch.cat([r.ids for r in rows]), None, torch.cat([r.targets for r in rows]))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE)

    def evaluate(self, predict: Predict, batch_size: int) -> dict[str, float]:
        test = self.test
        correct = []
        for start in range(0, len(test.ids), batch_size):  # batches of sequences, not a hot path
            part = slice(start, start + batch_size)
            ids, queries, targets = test.ids[part], test.queries[part], test.targets[part]
            logits = predict(ids, None)
            rows = torch.arange(len(ids)).unsqueeze(1)
            correct.append(logits[rows, queries].argmax(-1) == targets[rows, queries])
        hit = torch.cat(correct)  # (n, Q)
        far = _distance(test) > self.options.far
        result = {"accuracy": hit.float().mean().item(), "test_sequences": len(test.ids),
                  "test_queries": hit.numel(), "far": self.options.far, "far_fraction": far.float().mean().item(),
                  "accuracy_far": _mean(hit[far]), "accuracy_near": _mean(hit[~far])}
        if isinstance(self.spec, SpreadSpec) and self.spec.labels == "every":  # the queries after the separator
            result["accuracy_end"] = _mean(hit[:, -self.spec.num_queries:])
        if self.options.recall_sequences:
            result["key_recall"] = self.key_recall(predict.model, predict.device)
        return result

    def needed(self, sources: torch.Tensor) -> torch.Tensor:
        """The positions a query may read its answer from, (n, Q, S): the answer's token, and in the bidirectional
        form of MQAR also the key before it (which sees its value in an encoder) -- any of them will do; the
        histogram's every occurrence of the query's type (all of them needed, padded: ``test.source_mask``)."""
        if sources.dim() == 3:
            return sources
        if self.name == "mqar" and not self.causal:
            return torch.stack([sources - 1, sources], dim=-1)
        return sources.unsqueeze(-1)

    def needed_key_weights(self, model: nn.Module, device: torch.device, sequences: int) -> dict[str, SourceWeights]:
        """:func:`~clusterformer.attention.diagnostics.key_recall` over the first ``sequences`` test sequences (as many
        as there are), a few at a time: {attention layer name: what each query puts on the keys it needs, (n, Q,
        H)}."""
        n = min(sequences, len(self.test.ids))
        parts: dict[str, list[SourceWeights]] = {}
        for start in range(0, n, 16):  # a few sequences per probe: the probe keeps each layer's graph
            end = min(n, start + 16)
            mask = None if self.test.source_mask is None else self.test.source_mask[start:end]
            found = key_recall(model, self.test.ids[start:end].to(device), self.test.queries[start:end],
                               self.needed(self.test.sources[start:end]), source_mask=mask)
            for name, part in found.items():
                parts.setdefault(name, []).append(part)
        return {name: SourceWeights(*(torch.cat(field) for field in zip(*layer, strict=True)))
                for name, layer in parts.items()}

    def key_recall(self, model: nn.Module, device: torch.device) -> dict[str, dict[str, float]]:
        """Per attention layer (first ``recall_sequences``): the share of (query, head) pairs whose needed token is
        in the attended set, the share of queries for which some head has it, the mean weight on it, and the shares
        of (query, head) pairs and of queries (any head) in which it weighs more than every other key."""
        summary = {}
        for name, found in self.needed_key_weights(model, device, self.options.recall_sequences).items():
            w, argmax = found.weight, found.argmax  # (n, Q, H)
            summary[name] = {"key_recall": (w > 0).double().mean().item(),
                             "key_recall_any_head": (w > 0).any(-1).double().mean().item(),
                             "key_weight": w.mean().item(),
                             "key_argmax": argmax.double().mean().item(),
                             "key_argmax_any_head": argmax.any(-1).double().mean().item()}
            if self.test.source_mask is not None:  # several keys needed: how many of them each query sees
                coverage = found.coverage  # (n, Q, H)
                summary[name].update(key_coverage=coverage.mean().item(),
                                     key_coverage_best_head=coverage.amax(-1).mean().item(),
                                     key_coverage_all=(coverage == 1).double().mean().item())
        return summary


def _distance(batch: RecallBatch) -> torch.Tensor:
    """(n, Q): how far each query is from what answers it -- from the farthest needed token when it needs several."""
    if batch.source_mask is None:
        return batch.queries - batch.sources
    first = batch.sources.masked_fill(~batch.source_mask, torch.iinfo(torch.long).max).amin(-1)
    return batch.queries - first


def _mean(t: torch.Tensor) -> float | None:
    return t.float().mean().item() if t.numel() else None


def prepare_recall(name: str, max_len: int, limit: int | None, options: dict[str, Any]) -> RecallTask:
    """The recall task ``name`` (one of :data:`RECALL_TASKS`) at sequence length ``max_len``; ``limit``
    training sequences per epoch (default :data:`TRAIN_SEQUENCES`)."""
    check_choice("task", name, RECALL_TASKS)
    opts = recall_options(options)
    spec = opts.spec(name, max_len)
    n_train = TRAIN_SEQUENCES if limit is None else check_int("limit", limit, minimum=1)
    test = generate_recall(spec, DATA_SEED, "test", 0, opts.test_sequences)
    distance = _distance(test).float()
    info = {"protocol": f"generated: {n_train} train sequences per epoch / {opts.test_sequences} test sequences "
                        f"(data seed {DATA_SEED}, one seed per sequence)",
            "form": opts.form, "spec": dataclasses.asdict(spec), "options": dataclasses.asdict(opts),
            "query_distance": {"mean": distance.mean().item(), "min": distance.min().item(),
                               "max": distance.max().item(),
                               f"share_over_{opts.far}": (distance > opts.far).float().mean().item()}}
    return RecallTask(name, spec, opts, n_train, test, info=info)
