"""Tokenisers: word-level or WordPiece subwords (Hugging Face ``tokenizers``, trained on the training split) and
byte-level (the Long Range Arena text setting). Both reserve id 0 for padding; :meth:`encode` returns padded ids
and the key-padding mask the attention layers take (True = padding)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch

from .._checks import check_int

__all__ = ["ByteTokenizer", "MLMSpecials", "TrainedTokenizer", "WordTokenizer"]

PAD, UNK, SEP, MASK, CLS = "[PAD]", "[UNK]", "[SEP]", "[MASK]", "[CLS]"
T = TypeVar("T", bound="TrainedTokenizer")


@dataclass(frozen=True)
class MLMSpecials:
    """The special token ids masked-language-model pretraining uses, and the vocabulary size with them."""

    mask: int
    cls: int
    sep: int
    vocab_size: int


def _stream(rows: list[list[int]], sep: int) -> torch.Tensor:
    """Documents' ids joined into one stream, ``sep`` between them (a copy per document, not per token)."""
    parts: list[torch.Tensor] = []
    for row in rows:
        if parts:
            parts.append(torch.tensor([sep], dtype=torch.long))
        parts.append(torch.tensor(row, dtype=torch.long))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def _pad(rows: list[list[int]], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(1, min(max_len, max((len(r) for r in rows), default=1)))
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    for i, row in enumerate(rows):  # per example, not per token: a list -> tensor copy each
        row = row[:length]
        if row:
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return ids, ids == 0


def _reproducible_wordpiece(tok, texts: list[str], trainer, specials: list[str]):
    """WordPiece with ids that do not depend on the process. The trainer breaks ties between equally frequent
    merges in hash order (Rust's per-process random hasher): two processes gave the same pieces of the pretraining
    corpus different ids (234 of 8,000). So the ids are reassigned: the special tokens keep theirs (0..), the
    pieces follow in sorted order (WordPiece encodes by longest match on the vocabulary's strings, so ids are names
    only). The same hash order can also swap a piece at the vocabulary's cut: on MR at 8,000 pieces, 2 of 6
    processes held 2 pieces the others did not. That is left (the trainer exposes no counts to cut by); a run's
    checkpoint saves its tokenizer, so resuming and evaluating never retrain it."""
    import json

    from tokenizers import Tokenizer

    tok.train_from_iterator(texts, trainer=trainer)
    state = json.loads(tok.to_str())
    pieces = sorted(set(state["model"]["vocab"]) - set(specials))
    state["model"]["vocab"] = {token: i for i, token in enumerate(specials + pieces)}
    if [entry["id"] for entry in state["added_tokens"]] != list(range(len(specials))):
        raise RuntimeError("the special tokens were expected at ids 0..; the tokenizers library changed")
    return Tokenizer.from_str(json.dumps(state))


class TrainedTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer trained here (:class:`WordTokenizer`, the translation task's
    :class:`~clusterformer.data.translation.BPETokenizer`), kept in checkpoints as its JSON string."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer

    @classmethod
    def from_str(cls: type[T], text: str) -> T:
        """The tokenizer that :meth:`to_str` wrote (of the class it is called on)."""
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_str(text))

    def to_str(self) -> str:
        return self._tok.to_str()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()


class WordTokenizer(TrainedTokenizer):
    """A vocabulary trained on the training texts: lower-cased, split on whitespace and punctuation. Word-level
    (the default): words seen fewer than ``min_frequency`` times (or beyond ``vocab_size``) map to [UNK] (id 1).
    ``subword=True``: BERT's WordPiece -- a word outside the vocabulary is split into pieces that are in it
    (``##`` marks a continuation), so a text from another corpus keeps its rare words as pieces instead of [UNK]
    (what a pretrained vocabulary needs on a downstream task's sentences)."""

    @classmethod
    def train(cls, texts: list[str], vocab_size: int = 30000, min_frequency: int = 1,
              pairs: bool = False, masked: bool = False, subword: bool = False) -> WordTokenizer:
        """``pairs=True`` adds a [SEP] token (id 2) and encodes pairs as ``A [SEP] B`` (:meth:`encode_pairs`);
        ``masked=True`` (with pairs) adds [MASK] and [CLS] (ids 3, 4) for masked-language-model pretraining;
        ``subword=True`` trains WordPiece instead of whole words (``vocab_size`` counts the pieces)."""
        from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

        check_int("vocab_size", vocab_size, minimum=3)
        check_int("min_frequency", min_frequency, minimum=1)
        if not texts:
            raise ValueError("texts must not be empty: the vocabulary is trained on them")
        tok = Tokenizer(models.WordPiece(unk_token=UNK) if subword else models.WordLevel(unk_token=UNK))
        tok.normalizer = normalizers.Lowercase()
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        if masked and not pairs:
            raise ValueError("masked=True needs pairs=True: pretraining separates documents and segments by [SEP]")
        specials = [PAD, UNK, SEP, MASK, CLS] if masked else [PAD, UNK, SEP] if pairs else [PAD, UNK]
        if subword:
            trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                                special_tokens=specials, show_progress=False,
                                                continuing_subword_prefix="##")
            tok.decoder = decoders.WordPiece(prefix="##")
            tok = _reproducible_wordpiece(tok, texts, trainer, specials)
        else:
            trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                                special_tokens=specials, show_progress=False)
            tok.train_from_iterator(texts, trainer=trainer)
        if pairs:
            tok.post_processor = processors.TemplateProcessing(
                single="$A", pair=f"$A {SEP} $B:1", special_tokens=[(SEP, tok.token_to_id(SEP))])
        return cls(tok)

    @classmethod
    def train_kind(cls, kind: str, texts: list[str], vocab_size: int, **options: bool) -> WordTokenizer:
        """:meth:`train` by ``--tokenizer`` name: ``"word"``, or ``"wordpiece"`` (``subword=True``)."""
        if kind not in ("word", "wordpiece"):
            raise ValueError(f"tokenizer must be 'word' or 'wordpiece' to train a vocabulary here, got {kind!r}")
        return cls.train(texts, vocab_size=vocab_size, subword=kind == "wordpiece", **options)

    @property
    def kind(self) -> str:
        """``"wordpiece"`` or ``"word"``: what ``--tokenizer`` names this vocabulary."""
        return "wordpiece" if type(self._tok.model).__name__ == "WordPiece" else "word"

    def encode(self, texts: list[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> ids (B, N) long (0 = padding), padding mask (B, N) bool; N = min(max_len, longest)."""
        check_int("max_len", max_len, minimum=1)
        return _pad([e.ids for e in self._tok.encode_batch(texts)], max_len)

    def stream(self, texts: list[str], sep: int) -> torch.Tensor:
        """Every text's ids, untruncated, joined into one (T,) stream with ``sep`` between texts."""
        return _stream([e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)], sep)

    def mlm_specials(self) -> MLMSpecials:
        """The [MASK], [CLS] and [SEP] ids (a tokenizer trained with ``masked=True``)."""
        ids = [self._tok.token_to_id(t) for t in (MASK, CLS, SEP)]
        if None in ids:
            raise ValueError("this tokenizer was trained without masked=True: it has no [MASK] / [CLS] token, so "
                             "it cannot serve masked-language-model pretraining")
        return MLMSpecials(*ids, vocab_size=self.vocab_size)

    def encode_pairs(self, pairs: list[tuple[str, str]], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``A [SEP] B`` per pair (a tokenizer trained with ``pairs=True``), padded like :meth:`encode`."""
        check_int("max_len", max_len, minimum=1)
        if self._tok.token_to_id(SEP) is None:
            raise ValueError("this tokenizer was trained without pairs=True: it has no [SEP] token")
        return _pad([e.ids for e in self._tok.encode_batch(pairs)], max_len)


class ByteTokenizer:
    """UTF-8 bytes, id = byte + 1 (0 = padding): vocabulary 257, no training (LRA text: 4,000 bytes)."""

    vocab_size = 257

    def encode(self, texts: list[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        check_int("max_len", max_len, minimum=1)
        return _pad([[b + 1 for b in t.encode("utf-8")[:max_len]] for t in texts], max_len)

    def to_str(self) -> str:
        return "bytes"

    def stream(self, texts: list[str], sep: int) -> torch.Tensor:
        """Every text's bytes (ids byte + 1), joined into one (T,) stream with ``sep`` between texts."""
        return _stream([[b + 1 for b in t.encode("utf-8")] for t in texts], sep)

    @staticmethod
    def mlm_specials() -> MLMSpecials:
        """Pretraining adds [MASK] 257, [CLS] 258 and [SEP] 259 after the 256 byte ids: a vocabulary of 260."""
        return MLMSpecials(mask=257, cls=258, sep=259, vocab_size=260)


class PretrainedTokenizer:
    """The tokenizer shipped with a pretrained model of :mod:`clusterformer.hf` (``tokenizer.json``, read with
    HF ``tokenizers``: lower-casing, WordPiece, [CLS] ... [SEP]), truncated to ``max_len``; id 0 is [PAD]."""

    def __init__(self, name: str) -> None:
        from tokenizers import Tokenizer

        from .pretrained import pretrained_path

        self.name = name
        self._tok = Tokenizer.from_file(str(pretrained_path(name) / "tokenizer.json"))
        self._tok.no_padding()
        if self._tok.token_to_id("[PAD]") != 0:
            raise ValueError(f"pretrained tokenizer {name!r} does not use id 0 for [PAD]")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, texts: list[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        check_int("max_len", max_len, minimum=2)
        self._tok.enable_truncation(max_len)
        return _pad([e.ids for e in self._tok.encode_batch(texts)], max_len)

    def to_str(self) -> str:
        return f"pretrained:{self.name}"
