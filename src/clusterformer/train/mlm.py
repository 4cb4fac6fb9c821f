"""Masked-language-model pretraining: ``clusterformer train --task mlm`` (docs/pretraining.md).

The main paper pretrains a ClusterFormer with masked language modelling and next-sentence prediction at BERT-small
size before fine-tuning it (its appendix F, Table 8); the k-means paper compares mechanisms by masked-LM perplexity
on held-out text (its Table 1). This task does both for any registered mechanism.

Corpus. The *training* splits in ``../shared/data`` only, never a test split a downstream task evaluates on: IMDB's
train reviews, 20NEWS's train documents and the first 90% of tinyshakespeare (what ``shakespeare-char`` trains on);
``corpus`` picks among them. Their documents are tokenised and joined into one stream, a [SEP] between documents.
The tokenizer is fitted on that stream (``--tokenizer word``: a word-level vocabulary of ``--vocab-size`` with
[PAD] [UNK] [SEP] [MASK] [CLS] as ids 0-4, saved with the checkpoint, so a model fine-tuned from it reads its
downstream task with the same vocabulary; ``--tokenizer bytes``: UTF-8 bytes, ids 1-256, with [MASK] 257, [CLS] 258
and [SEP] 259 -- the 4,096-byte regime of IMDB-4K).

Sequences. A training sequence is [CLS] followed by ``max_len - 1`` tokens from a random start of the stream
(documents are not respected: a window may cross a [SEP], as in RoBERTa's FULL-SENTENCES packing). With ``nsp``,
it is [CLS] A [SEP] B with A and B of ``(max_len - 2) // 2`` tokens: B follows A in the stream (label 1) or starts
anywhere else (label 0), half of the time each -- segments of text standing for BERT's sentences, whose boundaries
this corpus does not mark. Starts, the NSP coin and the masks are drawn from a generator seeded with (seed, step),
so a resumed run continues exactly and every rank draws its own slice of the step's batch.

Masking (BERT): each token other than [CLS] / [SEP] is selected with probability ``mask_prob`` (0.15); a selected
token becomes [MASK] with probability 0.8, a random token of the vocabulary with 0.1, and stays itself with 0.1.
The loss is the cross-entropy at the selected positions (targets elsewhere are ignored), plus the NSP cross-entropy.
In training the model's token head runs on the selected positions alone (a batch's ``extra`` input: about 15% of
the rows, :class:`clusterformer.models.MaskedLanguageModel`'s ``positions``).
Under DDP each rank averages over its own selected tokens, as BERT's implementations do: the gradient equals a single
process's with the whole batch in expectation, not bit for bit (the ranks select different numbers of tokens).

Evaluation (held out: IMDB's test reviews, which no pretraining step reads, and WikiText-2's test split when it is
in the data directory): ``eval_windows`` non-overlapping windows of each held-out stream, masked with a fixed seed
(the same positions for every model and mechanism); the masked-token perplexity (exp of the mean cross-entropy) and
accuracy. ``perplexity`` / ``accuracy`` are IMDB's, ``wikitext2_perplexity`` / ``wikitext2_accuracy`` WikiText-2's.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_bool, check_float, check_int, check_options
from ..data import ByteTokenizer, WordTokenizer, load_classification_task
from ..data.classification import ClassificationData
from ..data.paths import resolve_data_dir
from ..data.recall import IGNORE
from ..data.tokenize import MLMSpecials
from ..models import EncoderConfig, MaskedLanguageModel
from .batch import Batch, Predict

__all__ = ["CORPORA", "EVAL_SEED", "MLMOptions", "MaskedLMTask", "mask_tokens", "mlm_options", "prepare_mlm"]

CORPORA = ("imdb", "20news", "shakespeare")
EVAL_SEED = 1234  # the held-out windows' masks: the same for every model


@dataclass(frozen=True)
class MLMOptions:
    """The options of ``--task mlm`` (``train --task-options``).

    Attributes:
        corpus: the training splits to pretrain on, among :data:`CORPORA`.
        mask_prob: the share of tokens selected for prediction (BERT: 0.15).
        nsp: sentence-pair next-sentence prediction beside the masked tokens (the main paper's MLM+NSP).
        eval_windows: held-out windows evaluated per held-out set.
    """

    corpus: tuple[str, ...] = CORPORA
    mask_prob: float = 0.15
    nsp: bool = False
    eval_windows: int = 256

    def __post_init__(self) -> None:
        corpus = (self.corpus,) if isinstance(self.corpus, str) else tuple(self.corpus)
        if not corpus or any(name not in CORPORA for name in corpus) or len(set(corpus)) != len(corpus):
            raise ValueError(f"corpus must be distinct names among {', '.join(CORPORA)}; got {self.corpus!r}")
        object.__setattr__(self, "corpus", corpus)
        check_float("mask_prob", self.mask_prob, minimum=0.0, maximum=1.0, exclusive_minimum=True)
        check_bool("nsp", self.nsp)
        check_int("eval_windows", self.eval_windows, minimum=1)


def mlm_options(options: dict[str, Any]) -> MLMOptions:
    """Validate a task-options dict (unknown names are refused, naming the valid ones)."""
    return check_options(MLMOptions, options, "mlm task option")


def mask_tokens(ids: torch.Tensor, specials: MLMSpecials, mask_prob: float, generator: torch.Generator,
                protected: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking of ids (B, L): returns (inputs, targets), targets IGNORE where nothing is predicted.
    Never selected: padding (id 0), [CLS], [SEP] and ``protected`` positions. One draw of three uniform numbers
    per position from ``generator``, whatever the outcome, so the masks are a function of the seed alone."""
    draws = torch.rand((3, *ids.shape), generator=generator)
    selectable = (ids != 0) & (ids != specials.cls) & (ids != specials.sep)
    if protected is not None:
        selectable &= ~protected
    selected = selectable & (draws[0] < mask_prob)
    targets = torch.where(selected, ids, torch.full_like(ids, IGNORE))
    as_mask = selected & (draws[1] < 0.8)
    as_random = selected & ~as_mask & (draws[2] < 0.5)  # half of the other 20%: 10% of the selected
    # random tokens among the ordinary ones (never [PAD] or a special token): ids are drawn from the uniform draw
    ordinary = _ordinary_ids(specials)
    random_ids = ordinary[(draws[2] * 2 % 1 * len(ordinary)).long().clamp(max=len(ordinary) - 1)]
    inputs = torch.where(as_mask, torch.full_like(ids, specials.mask), ids)
    inputs = torch.where(as_random, random_ids, inputs)
    return inputs, targets


def _ordinary_ids(specials: MLMSpecials) -> torch.Tensor:
    ids = torch.arange(1, specials.vocab_size)
    return ids[(ids != specials.mask) & (ids != specials.cls) & (ids != specials.sep)]


@dataclass
class MaskedLMTask:
    """A :class:`clusterformer.train.tasks.Task` for masked-language-model pretraining (see the module docstring).

    Targets of a batch: (B, L) token ids at the selected positions, IGNORE elsewhere; with NSP, ``targets[:, 0]``
    (the [CLS] position, never selected) holds the next-sentence label."""

    name: str
    train_stream: torch.Tensor = field(repr=False)
    held_out: dict[str, torch.Tensor] = field(repr=False)
    specials: MLMSpecials
    options: MLMOptions
    tokenizer: str
    max_len: int
    metric: str = "perplexity"
    info: dict[str, Any] = field(default_factory=dict)
    kind: str = "mlm"

    @property
    def vocab_size(self) -> int:
        return self.specials.vocab_size

    @property
    def num_classes(self) -> int:
        return self.specials.vocab_size

    def build_model(self, encoder: EncoderConfig) -> nn.Module:
        return MaskedLanguageModel(encoder, nsp=self.options.nsp)

    def model_max_len(self, max_len: int) -> int:
        return max_len

    def steps_per_epoch(self, batch_size: int, world: int) -> int:
        return max(1, len(self.train_stream) // (self.max_len * batch_size * world))

    def batch(self, step: int, per_epoch: int, batch_size: int, rank: int, world: int, seed: int) -> Batch:
        """``batch_size * world`` sequences per step, drawn (with their masks) from a generator seeded with (seed,
        step); rank r takes the r-th slice of ``batch_size``."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        ids, labels = self._sequences(batch_size * world, g)
        inputs, targets = mask_tokens(ids, self.specials, self.options.mask_prob, g)
        predicted = targets != IGNORE  # the model's head runs on these positions alone
        if labels is not None:
            targets[:, 0] = labels  # [CLS] is never masked: its target is the next-sentence label
        part = slice(rank * batch_size, (rank + 1) * batch_size)
        return Batch(inputs[part], None, targets[part], predicted[part])

    def _sequences(self, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        """n sequences (n, max_len) from random starts, and with NSP their labels (n,)."""
        stream, L, s = self.train_stream, self.max_len, self.specials
        cls = torch.full((n, 1), s.cls, dtype=torch.long)
        if not self.options.nsp:
            starts = torch.randint(len(stream) - L + 2, (n,), generator=g)
            return torch.cat([cls, stream[starts.unsqueeze(1) + torch.arange(L - 1)]], 1), None
        half = (L - 2) // 2
        first = torch.randint(len(stream) - 2 * half + 1, (n,), generator=g)
        other = torch.randint(len(stream) - half + 1, (n,), generator=g)
        follows = torch.rand(n, generator=g) < 0.5
        second = torch.where(follows, first + half, other)
        a = stream[first.unsqueeze(1) + torch.arange(half)]
        b = stream[second.unsqueeze(1) + torch.arange(half)]
        sep = torch.full((n, 1), s.sep, dtype=torch.long)
        return torch.cat([cls, a, sep, b], 1), follows.long()

    def loss(self, output: tuple[torch.Tensor, torch.Tensor | None], targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy at the selected positions, plus the next-sentence cross-entropy with ``nsp``. The token
        logits are (B, L, vocab), or (M, vocab) at the selected positions alone in row-major order (the model
        called with the batch's positions)."""
        logits, nsp_logits = output
        tokens = targets
        if nsp_logits is not None:
            tokens = targets.clone()
            tokens[:, 0] = IGNORE
        if logits.dim() == 2:  # the head ran on the selected positions alone
            wanted = tokens[tokens != IGNORE]
            if logits.shape[0] != wanted.shape[0]:
                raise ValueError(f"{logits.shape[0]} rows of token logits for {wanted.shape[0]} selected positions")
            loss = F.cross_entropy(logits.float(), wanted)
        else:
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens.reshape(-1),
                                   ignore_index=IGNORE)
        if nsp_logits is not None:
            loss = loss + F.cross_entropy(nsp_logits.float(), targets[:, 0])
        return loss

    def evaluate(self, predict: Predict, batch_size: int) -> dict[str, float]:
        """Masked-token perplexity and accuracy on each held-out stream (``eval_windows`` windows, fixed masks)."""
        result: dict[str, float] = {}
        for name, stream in self.held_out.items():
            windows = self._held_out_windows(stream)
            g = torch.Generator().manual_seed(EVAL_SEED)
            inputs, targets = mask_tokens(windows, self.specials, self.options.mask_prob, g)
            total, correct, count = 0.0, 0, 0
            for start in range(0, len(windows), batch_size):  # batches of windows, not a hot path
                part = slice(start, start + batch_size)
                logits, _ = predict(inputs[part], None)
                logits, wanted = logits.float(), targets[part]
                chosen = wanted != IGNORE
                total += F.cross_entropy(logits[chosen], wanted[chosen], reduction="sum").item()
                correct += int((logits[chosen].argmax(-1) == wanted[chosen]).sum())
                count += int(chosen.sum())
            prefix = "" if name == "imdb" else f"{name}_"
            result.update({f"{prefix}perplexity": math.exp(total / max(count, 1)),
                           f"{prefix}accuracy": correct / max(count, 1), f"{prefix}masked_tokens": count,
                           f"{prefix}windows": len(windows)})
        return result

    def _held_out_windows(self, stream: torch.Tensor) -> torch.Tensor:
        """The first ``eval_windows`` non-overlapping windows of a held-out stream, each [CLS] + max_len - 1
        tokens (fewer windows when the stream is shorter)."""
        width = self.max_len - 1
        n = min(self.options.eval_windows, len(stream) // width)
        if n == 0:
            raise ValueError(f"the held-out text ({len(stream)} tokens) is shorter than max_len - 1 = {width}")
        body = stream[:n * width].view(n, width)
        return torch.cat([torch.full((n, 1), self.specials.cls, dtype=torch.long), body], 1)


def _corpus_texts(name: str, data_dir: Any, limit: int | None, imdb: ClassificationData) -> list[str]:
    """The training split of a pretraining corpus (``limit``: documents per class, or characters of
    tinyshakespeare)."""
    if name == "imdb":
        return imdb.train_texts
    if name == "20news":
        return load_classification_task(name, data_dir, limit).train_texts
    path = resolve_data_dir(data_dir) / "tinyshakespeare" / "input.txt"
    if not path.is_file():
        raise ValueError(f"expected the file {str(path)!r}")
    text = path.read_text(encoding="utf-8")
    text = text[:int(len(text) * 0.9)]  # shakespeare-char's training part; its last 10% is its test set
    return [text[:limit] if limit is not None else text]


def _held_out_texts(data_dir: Any, limit: int | None, imdb: ClassificationData) -> dict[str, list[str]]:
    """IMDB's test reviews, and WikiText-2's test split when the data directory has it."""
    texts = {"imdb": imdb.test_texts}
    wiki = resolve_data_dir(data_dir) / "wikitext-2" / "wiki.test.tokens"
    if wiki.is_file():
        lines = [line for line in wiki.read_text(encoding="utf-8").split("\n") if line.strip()]
        texts["wikitext2"] = lines[:limit] if limit is not None else lines
    return texts


def prepare_mlm(data_dir: Any, max_len: int, tokenizer: str, vocab_size: int, limit: int | None,
                state: str | None, options: dict[str, Any]) -> MaskedLMTask:
    """The MLM task over the chosen training corpora; ``state``: a saved tokenizer (resume, evaluation)."""
    opts = mlm_options(options)
    check_int("max_len", max_len, minimum=8 if opts.nsp else 4)
    imdb = load_classification_task("imdb", data_dir, limit)  # one read of the archive: train and test reviews
    train = [text for name in opts.corpus for text in _corpus_texts(name, data_dir, limit, imdb)]
    held_out = _held_out_texts(data_dir, limit, imdb)
    if tokenizer == "bytes" or state == "bytes":
        tok: ByteTokenizer | WordTokenizer = ByteTokenizer()
    elif state is not None:
        tok = WordTokenizer.from_str(state)
    else:
        tok = WordTokenizer.train_kind(tokenizer, train, vocab_size, pairs=True, masked=True)
    specials = tok.mlm_specials()
    streams = {name: tok.stream(texts, specials.sep) for name, texts in held_out.items()}
    train_stream = tok.stream(train, specials.sep)
    if len(train_stream) < 2 * max_len:
        raise ValueError(f"the pretraining corpus holds {len(train_stream)} tokens, fewer than 2 * max_len = "
                         f"{2 * max_len}; raise --limit or lower --max-len")
    info = {"protocol": f"pretraining on the training splits of {', '.join(opts.corpus)}; held out: "
                        f"{', '.join(streams)} test", "options": dataclasses.asdict(opts),
            "train_tokens": len(train_stream), "held_out_tokens": {k: len(v) for k, v in streams.items()}}
    return MaskedLMTask("mlm", train_stream, streams, specials, opts, tok.to_str(), max_len, info=info)
