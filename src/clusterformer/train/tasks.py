"""The training tasks: data, tokenisation, model head, batches, loss and metric for each ``--task``.

Each task is a :class:`Task`: :class:`ClassificationTask` (single texts, text pairs, ranking) or
:class:`LanguageModelTask`; the training loop calls only the protocol's methods (a translation task is one
more implementation).

| task | data | protocol | metric |
|---|---|---|---|
| mr, cr, subj, mpqa | ``label text`` lines | 10-fold CV (``--fold``/``--cv``) or a seeded 90/10 split | accuracy |
| 20news | by-date archive | train / test | accuracy |
| imdb | aclImdb archive | train / test; bytes, 4,000 (LRA text) by default | accuracy |
| text-classification | ``--train-file`` / ``--test-file`` (label text or TSV) | as given | accuracy |
| wikiqa | question/answer pairs | train / filtered test (questions with a correct answer) | MAP, MRR |
| listops | generated (``data.listops``, LRA rules), lengths max_len/4..max_len | fixed seeded train / test | accuracy |
| shakespeare-char | one text file | first 90% / last 10% | bits per character |
| multi30k | De->En sentence pairs (:mod:`clusterformer.train.translation`) | train / test_2016_flickr | BLEU |
| mqar, passkey, histogram, multivalue, maxvalue | generated (:mod:`.recall`) | seeded stream / test | query accuracy |
| mlm | training splits of IMDB, 20NEWS, tinyshakespeare | IMDB test, WikiText-2 test (held out) | masked perplexity |
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.registry import can_decode
from ..data import ByteTokenizer, WordTokenizer, kfold_indices, load_classification_task, load_labeled_file
from ..data.listops import LISTOPS_VOCAB, encode_listops, generate_listops
from ..data.paths import resolve_data_dir
from ..data.tokenize import PretrainedTokenizer
from ..masks import real_lengths
from ..models import EncoderConfig, SequenceClassifier
from ..models.lm import LanguageModel
from .batch import Batch, Predict
from .mlm import mlm_options, prepare_mlm
from .recall import RECALL_TASKS, prepare_recall, recall_options

__all__ = ["TASKS", "TASK_SPECS", "Batch", "ClassificationTask", "Examples", "LanguageModelTask", "Task",
           "TaskRequest", "TaskSpec", "prepare_task", "ranking_metrics"]

LISTOPS_TRAIN = 20_000  # training expressions by default (LRA uses 96,000: --limit 96000); the test set has 2,000


class Task(Protocol):
    """What the training loop needs from a task: its model, its batches, its loss and its evaluation.

    ``kind`` ("classification", "lm", "translation", "recall" or "mlm") and the other attributes are saved in
    checkpoints."""

    name: str
    kind: str
    vocab_size: int
    num_classes: int
    tokenizer: str  # serialised tokenizer (checkpointed, reused by eval)
    metric: str
    info: dict[str, Any]

    def build_model(self, encoder: EncoderConfig) -> nn.Module: ...

    def model_max_len(self, max_len: int) -> int: ...

    def steps_per_epoch(self, batch_size: int, world: int) -> int: ...

    def batch(self, step: int, per_epoch: int, batch_size: int, rank: int, world: int, seed: int) -> Batch: ...

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...

    def evaluate(self, predict: Predict, batch_size: int) -> dict[str, float]: ...


@dataclass
class Examples:
    """Tokenised examples: ids (n, L), pad (n, L) True = padding, labels (n,), and for ranking the question
    each pair belongs to, groups (n,)."""

    ids: torch.Tensor
    pad: torch.Tensor
    labels: torch.Tensor
    groups: torch.Tensor | None = None


@dataclass
class ClassificationTask:
    """Single texts or text pairs -> a label; ``metric`` "accuracy", or "map_mrr" (ranking: the score of a pair is
    its probability of the last class, ranked per question)."""

    name: str
    train: Examples
    test: Examples
    vocab_size: int
    num_classes: int
    tokenizer: str
    metric: str = "accuracy"
    info: dict[str, Any] = field(default_factory=dict)
    kind: str = "classification"

    def build_model(self, encoder: EncoderConfig) -> nn.Module:
        return SequenceClassifier(encoder, self.num_classes)

    def model_max_len(self, max_len: int) -> int:
        return max_len

    def steps_per_epoch(self, batch_size: int, world: int) -> int:
        n = len(self.train.labels)
        steps = n // (batch_size * world)
        if steps == 0:
            raise ValueError(f"the training set has {n} examples, fewer than batch_size * world_size = "
                             f"{batch_size * world}; lower --batch-size")
        return steps

    def batch(self, step: int, per_epoch: int, batch_size: int, rank: int, world: int, seed: int) -> Batch:
        """Epoch e visits the permutation drawn from ``seed + e``; step s of it takes the s-th run of
        ``batch_size * world`` examples and rank r the r-th slice of ``batch_size``."""
        B = batch_size
        epoch, within = divmod(step, per_epoch)
        order = torch.randperm(len(self.train.labels), generator=torch.Generator().manual_seed(seed + epoch))
        global_index = order[within * world * B:(within + 1) * world * B]
        # Trim to the longest example of the *global* batch, so every rank (and a single process with the whole
        # batch) sees the same padded length. (Every mechanism's outputs are independent of the padding amount;
        # equal shapes keep the float reduction order, and so the last bits, equal too.)
        keep = int((~self.train.pad[global_index]).sum(1).max().clamp(min=1))
        index = global_index[rank * B:(rank + 1) * B]
        return Batch(self.train.ids[index, :keep], self.train.pad[index, :keep], self.train.labels[index])

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), targets)

    def evaluate(self, predict: Predict, batch_size: int) -> dict[str, float]:
        test = self.test
        scores, predictions = [], []
        for start in range(0, len(test.labels), batch_size):  # batches of examples, not a hot path
            ids, pad = test.ids[start:start + batch_size], test.pad[start:start + batch_size]
            keep = int(real_lengths(pad, *pad.shape, pad.device).max().clamp(min=1))
            logits = predict(ids[:, :keep], pad[:, :keep]).float()
            predictions.append(logits.argmax(-1))
            scores.append(logits.softmax(-1)[:, -1])
        predicted, score = torch.cat(predictions), torch.cat(scores)
        result = {"accuracy": (predicted == test.labels).float().mean().item(), "test_examples": len(test.labels)}
        if self.metric == "map_mrr":
            result.update(ranking_metrics(score, test.labels, test.groups))
        return result


@dataclass
class LanguageModelTask:
    """Next-token prediction on a token stream, in windows of ``max_len`` tokens; metric bits per character."""

    name: str
    train_stream: torch.Tensor
    test_stream: torch.Tensor
    vocab_size: int
    tokenizer: str
    max_len: int
    metric: str = "bpc"
    info: dict[str, Any] = field(default_factory=dict)
    kind: str = "lm"

    @property
    def num_classes(self) -> int:
        return self.vocab_size

    def build_model(self, encoder: EncoderConfig) -> nn.Module:
        return LanguageModel(encoder)

    def model_max_len(self, max_len: int) -> int:
        return max_len + 1

    def steps_per_epoch(self, batch_size: int, world: int) -> int:
        span = self.max_len + 1
        return max(1, (len(self.train_stream) - span) // (span * batch_size * world))

    def batch(self, step: int, per_epoch: int, batch_size: int, rank: int, world: int, seed: int) -> Batch:
        """``batch_size * world`` random windows per step from a generator seeded with (seed, step)."""
        B, span = batch_size, self.max_len + 1
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(len(self.train_stream) - span + 1, (B * world,), generator=g)[rank * B:(rank + 1) * B]
        windows = self.train_stream[starts.unsqueeze(1) + torch.arange(span)]
        return Batch(windows[:, :-1], None, windows[:, 1:])

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def evaluate(self, predict: Predict, batch_size: int) -> dict[str, float]:
        """Bits per character over non-overlapping windows of the held-out stream."""
        stream, span = self.test_stream, self.max_len + 1
        n = (len(stream) - 1) // self.max_len
        if n == 0:
            raise ValueError(f"the held-out text ({len(stream)} tokens) is shorter than max_len + 1 = {span}")
        total, count = 0.0, 0
        for start in range(0, n, batch_size):  # batches of windows
            rows = torch.arange(start, min(n, start + batch_size)).unsqueeze(1) * self.max_len
            windows = stream[rows + torch.arange(span)]
            logits = predict(windows[:, :-1], None).float()
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1),
                                     reduction="sum").item()
            count += windows[:, 1:].numel()
        return {"bpc": total / count / math.log(2), "test_tokens": count}


def _tokenizer(kind: str, texts: list[str], vocab_size: int, state: str | None, pairs: bool = False):
    if kind == "bytes" or state == "bytes":
        return ByteTokenizer()
    pretrained = state if state and state.startswith("pretrained:") else kind
    if pretrained.startswith("pretrained:"):
        return PretrainedTokenizer(pretrained.split(":", 1)[1])
    if state is not None:
        return WordTokenizer.from_str(state)
    return WordTokenizer.train_kind(kind, texts, vocab_size, pairs=pairs)


def _encode(tok, texts, labels, max_len) -> Examples:
    ids, pad = tok.encode(texts, max_len)
    return Examples(ids, pad, torch.tensor(labels, dtype=torch.long))


@dataclass(frozen=True)
class TaskRequest:
    """What preparing a task reads: the data settings of the run (:class:`clusterformer.train.config.DataConfig`)
    and, when a checkpoint is evaluated or resumed, its saved tokenizer."""

    data_dir: str | Path | None
    max_len: int
    tokenizer: str  # "auto" resolved: "word", "wordpiece", "bytes" or "pretrained:NAME"
    vocab_size: int
    seed: int
    fold: int | None
    folds: int
    limit: int | None
    train_file: str | None
    test_file: str | None
    tokenizer_state: str | None
    translation: dict[str, Any]
    task_options: dict[str, Any]


def _never(options: dict[str, Any]) -> bool:
    return False


def _no_task_rules(config: Any) -> None:
    return None


@dataclass(frozen=True)
class TaskSpec:
    """What a task owns: how it is prepared (``prepare``), which options it takes (``options``: the parser of
    ``task_options``, or None for none), the rules on the run's fields that only it reads or constrains
    (``rules``, given the whole configuration), whether the model it trains is causal, and its defaults.

    ``kind`` is the :class:`Task`'s; ``text``: it reads text, so a pretrained encoder can be fine-tuned on it
    (``train --init``); ``tokenizer``: what ``--tokenizer auto`` means for it."""

    prepare: Callable[[str, TaskRequest], Task]
    kind: str
    options: Callable[[dict[str, Any]], Any] | None = None
    rules: Callable[[Any], None] = _no_task_rules
    causal: Callable[[dict[str, Any]], bool] = _never
    text: bool = False
    tokenizer: str = "word"

    def check(self, config: Any) -> None:
        """This task's rules on a configuration: its options, then ``rules``."""
        if self.options is not None:
            self.options(config.task_options)
        elif config.task_options:
            takers = ", ".join(name for name, spec in TASK_SPECS.items() if spec.options is not None)
            raise ValueError(f"task {config.task!r} takes no task_options (they are for {takers}); got "
                             f"{sorted(config.task_options)}")
        if self.kind != "translation" and (config.decoder_attention is not None or config.decoder_attention_options):
            raise ValueError("--decoder-attention is for the translation task (multi30k)")
        self.rules(config)


def prepare_task(
    name: str, *, data_dir: str | Path | None, max_len: int, tokenizer: str = "auto", vocab_size: int = 20000,
    seed: int = 0, fold: int | None = None, folds: int = 10, limit: int | None = None,
    train_file: str | None = None, test_file: str | None = None, tokenizer_state: str | None = None,
    translation: dict[str, Any] | None = None, task_options: dict[str, Any] | None = None,
) -> Task:
    """Load, split and tokenise task ``name`` (its :class:`TaskSpec`'s ``prepare``). ``limit`` keeps a small slice
    (examples, or documents per class for 20news/imdb, or pairs for wikiqa, or characters for shakespeare-char)
    for tests and quick runs. ``tokenizer_state`` reuses a saved tokenizer (evaluation of a checkpoint).
    ``translation``: the keyword arguments of :func:`clusterformer.train.translation.prepare_multi30k` (decoder
    attention, label smoothing, beam, shared vocabulary). ``task_options``: the options of the tasks that take
    them (:class:`clusterformer.train.recall.RecallOptions`, :class:`clusterformer.train.mlm.MLMOptions`)."""
    if name not in TASK_SPECS:
        raise ValueError(f"unknown task {name!r}; expected one of {', '.join(TASKS)}")
    spec = TASK_SPECS[name]
    if task_options and spec.options is None:
        raise ValueError(f"task {name!r} takes no task options (they are for {', '.join(OPTION_TASKS)}); got "
                         f"{sorted(task_options)}")
    request = TaskRequest(data_dir, max_len, spec.tokenizer if tokenizer == "auto" else tokenizer, vocab_size, seed,
                          fold, folds, limit, train_file, test_file, tokenizer_state, dict(translation or {}),
                          dict(task_options or {}))
    return spec.prepare(name, request)


def _text_classification(name: str, r: TaskRequest) -> ClassificationTask:
    """``--train-file`` / ``--test-file``: label text or TSV lines; the test labels must be training labels."""
    if not r.train_file or not r.test_file:
        raise ValueError("task 'text-classification' needs --train-file and --test-file")
    tr_x, tr_y, names = load_labeled_file(r.train_file, r.limit)
    te_x, te_y, te_names = load_labeled_file(r.test_file, r.limit)
    if te_names != names and not set(te_names) <= set(names):
        raise ValueError(f"{r.test_file} has labels {te_names} not in the training labels {names}")
    if te_names != names:  # names, remapped to the training indices
        index = {n: i for i, n in enumerate(names)}
        te_y = [index[te_names[y]] for y in te_y]
    return _classification_task(name, r, tr_x, tr_y, te_x, te_y, names, {"protocol": "given train/test files"})


def _classification(name: str, r: TaskRequest) -> ClassificationTask:
    """The papers' classification sets: their official split, or for the sentence tasks a fold of k-fold CV (or
    a seeded 90/10 split)."""
    data = load_classification_task(name, r.data_dir, r.limit)
    if data.test_texts:
        return _classification_task(name, r, data.train_texts, data.train_labels, data.test_texts, data.test_labels,
                                    data.label_names, {"protocol": "official train/test split"})
    k = r.folds if r.fold is not None else 10
    index = 0 if r.fold is None else r.fold
    if not 0 <= index < k:
        raise ValueError(f"fold must be in [0, {k}), got {index}")
    train_idx, test_idx = kfold_indices(len(data.train_texts), k, r.seed)[index]
    texts, labels = data.train_texts, data.train_labels
    info = {"protocol": f"fold {index} of {k}-fold CV (seed {r.seed})" if r.fold is not None
            else f"seeded 90/10 split (seed {r.seed})"}
    return _classification_task(name, r, [texts[i] for i in train_idx], [labels[i] for i in train_idx],
                                [texts[i] for i in test_idx], [labels[i] for i in test_idx], data.label_names, info)


def _classification_task(name: str, r: TaskRequest, tr_x: list[str], tr_y: list[int], te_x: list[str],
                         te_y: list[int], names: list[str], info: dict[str, Any]) -> ClassificationTask:
    tok = _tokenizer(r.tokenizer, tr_x, r.vocab_size, r.tokenizer_state)
    return ClassificationTask(name, _encode(tok, tr_x, tr_y, r.max_len), _encode(tok, te_x, te_y, r.max_len),
                              tok.vocab_size, len(names), tok.to_str(), "accuracy", {**info, "labels": names})


def _read_lines(path: Path) -> list[str]:
    if not path.is_file():
        raise ValueError(f"expected the file {str(path)!r}")
    return path.read_text(encoding="utf-8").split("\n")


def _wikiqa(name: str, r: TaskRequest) -> ClassificationTask:
    """Question/answer pairs; the test set keeps the questions with a correct answer."""
    max_len, vocab_size, limit, state = r.max_len, r.vocab_size, r.limit, r.tokenizer_state
    root = resolve_data_dir(r.data_dir) / "wikiqa"
    splits = {}
    for split in ("train", "test"):
        a, b = _read_lines(root / split / "a.toks"), _read_lines(root / split / "b.toks")
        ids, sim = _read_lines(root / split / "id.txt"), _read_lines(root / split / "sim.txt")
        n = len([x for x in sim if x.strip()])
        if not (len(a) >= n and len(b) >= n and len(ids) >= n):
            raise ValueError(f"{root / split}: a.toks, b.toks, id.txt and sim.txt must have one line per pair")
        rows = [(a[i], b[i], ids[i].strip(), int(sim[i])) for i in range(n)]
        if limit is not None:
            rows = rows[:limit]
        splits[split] = rows
    test = splits["test"]
    positives = {q for _, _, q, y in test if y == 1}
    test = [r for r in test if r[2] in positives]  # the filtered test set: questions with a correct answer
    tr = splits["train"]
    tok = WordTokenizer.from_str(state) if state else WordTokenizer.train_kind(
        r.tokenizer, [q for q, _, _, _ in tr] + [a for _, a, _, _ in tr], vocab_size, pairs=True)

    def encode(rows):
        ids, pad = tok.encode_pairs([(q, a) for q, a, _, _ in rows], max_len)
        qids = {q: i for i, q in enumerate(dict.fromkeys(r[2] for r in rows))}
        return Examples(ids, pad, torch.tensor([r[3] for r in rows], dtype=torch.long),
                        torch.tensor([qids[r[2]] for r in rows], dtype=torch.long))

    return ClassificationTask("wikiqa", encode(tr), encode(test), tok.vocab_size, 2, tok.to_str(), "map_mrr",
                              {"protocol": "train / filtered test", "test_questions": len(positives)})


def _listops(name: str, r: TaskRequest) -> ClassificationTask:
    """ListOps with lengths between max_len / 4 and max_len (LRA: 500..2,000 at max_len 2,000). The data do not
    depend on the training seed (train drawn from seed 0, test from seed 1), so seeds compare models on one set."""
    max_len, limit = r.max_len, r.limit
    n_train = LISTOPS_TRAIN if limit is None else limit
    n_test = min(2000, n_train)
    shape = {"min_length": max(3, max_len // 4), "max_length": max_len}
    train_x, train_y = generate_listops(n_train, seed=0, **shape)
    test_x, test_y = generate_listops(n_test, seed=1, **shape)

    def examples(texts: list[str], labels: list[int]) -> Examples:
        ids, pad = encode_listops(texts, max_len)
        return Examples(ids, pad, torch.tensor(labels, dtype=torch.long))

    return ClassificationTask("listops", examples(train_x, train_y), examples(test_x, test_y), len(LISTOPS_VOCAB),
                              10, "listops", "accuracy",
                              {"protocol": f"generated: {n_train} train / {n_test} test expressions of "
                                           f"{shape['min_length']}..{max_len} tokens (seeds 0 / 1)",
                               "labels": [str(d) for d in range(10)]})


def _shakespeare(name: str, r: TaskRequest) -> LanguageModelTask:
    """Characters of tinyshakespeare: the first 90% to train on, the last 10% held out."""
    max_len, limit, state = r.max_len, r.limit, r.tokenizer_state
    path = resolve_data_dir(r.data_dir) / "tinyshakespeare" / "input.txt"
    if not path.is_file():
        raise ValueError(f"expected the file {str(path)!r}")
    text = path.read_text(encoding="utf-8")
    if limit is not None:
        text = text[:limit]
    chars = state.split("\x00") if state else sorted(set(text))
    index = {c: i + 1 for i, c in enumerate(chars)}  # id 0 is the embedding's padding index: no character
    unknown = set(text) - set(index)
    if unknown:
        raise ValueError(f"{path} holds characters the saved vocabulary lacks: {sorted(unknown)[:10]}")
    stream = torch.tensor([index[c] for c in text], dtype=torch.long)
    cut = int(len(stream) * 0.9)
    vocab = len(chars) + 1  # id 0 (padding) is never a target: the head learns to give it no mass
    return LanguageModelTask("shakespeare-char", stream[:cut], stream[cut:], vocab, "\x00".join(chars), max_len,
                             info={"protocol": "first 90% / last 10% of characters"})


def _recall(name: str, r: TaskRequest) -> Task:
    return prepare_recall(name, r.max_len, r.limit, r.task_options)


def _mlm(name: str, r: TaskRequest) -> Task:
    return prepare_mlm(r.data_dir, r.max_len, r.tokenizer, r.vocab_size, r.limit, r.tokenizer_state, r.task_options)


def _multi30k(name: str, r: TaskRequest) -> Task:
    from .translation import prepare_multi30k

    return prepare_multi30k(r.data_dir, r.max_len, r.vocab_size, r.limit, r.tokenizer_state, **r.translation)


def _translation_rules(config: Any) -> None:
    """multi30k builds an encoder-decoder whose decoder decodes with a cache."""
    if config.reversible or config.cluster_layers is not None:
        raise ValueError("task multi30k builds an encoder-decoder; --reversible and --cluster-layers are not "
                         "available for it")
    if config.decoder_attention is not None and not can_decode(config.decoder_attention,
                                                               config.decoder_attention_options):
        raise ValueError(f"decoder_attention {config.decoder_attention!r} is not strictly causal with cached "
                         "decoding; the decoder needs one of full, neural-clustering (causal_mode='strict'), lsh, "
                         "routing, kmeans, sliding-window")


def _recall_causal(options: dict[str, Any]) -> bool:
    return recall_options(options).form == "causal"


_SENTENCES = TaskSpec(_classification, "classification", text=True)
TASK_SPECS: dict[str, TaskSpec] = {
    "mr": _SENTENCES, "cr": _SENTENCES, "subj": _SENTENCES, "mpqa": _SENTENCES, "20news": _SENTENCES,
    "imdb": TaskSpec(_classification, "classification", text=True, tokenizer="bytes"),
    "wikiqa": TaskSpec(_wikiqa, "classification", text=True),
    "listops": TaskSpec(_listops, "classification"),
    "shakespeare-char": TaskSpec(_shakespeare, "lm", causal=lambda options: True),
    "multi30k": TaskSpec(_multi30k, "translation", rules=_translation_rules),
    "text-classification": TaskSpec(_text_classification, "classification", text=True),
    **{name: TaskSpec(_recall, "recall", options=recall_options, causal=_recall_causal) for name in RECALL_TASKS},
    "mlm": TaskSpec(_mlm, "mlm", options=mlm_options),
}
TASKS = tuple(TASK_SPECS)
OPTION_TASKS = tuple(name for name, spec in TASK_SPECS.items() if spec.options is not None)  # take --task-options


def ranking_metrics(scores: torch.Tensor, labels: torch.Tensor, groups: torch.Tensor) -> dict[str, float]:
    """MAP and MRR over groups (questions) that hold at least one positive."""
    aps, rrs = [], []
    for g in torch.unique(groups).tolist():  # per question, once per evaluation (not a hot path)
        mask = groups == g
        order = torch.argsort(scores[mask], descending=True, stable=True)
        rel = labels[mask][order].tolist()
        if not any(rel):
            continue
        hits, precisions = 0, []
        for rank, r in enumerate(rel, start=1):
            if r:
                hits += 1
                precisions.append(hits / rank)
        aps.append(sum(precisions) / hits)
        rrs.append(1.0 / (rel.index(1) + 1))
    if not aps:
        return {"map": math.nan, "mrr": math.nan}
    return {"map": sum(aps) / len(aps), "mrr": sum(rrs) / len(rrs)}
