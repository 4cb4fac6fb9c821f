"""Parallel text for translation: Multi30k De->En (the real-data substitute for IWSLT14 here) and BPE vocabularies.

Files: ``multi30k/{train,val,test_2016_flickr}.{de,en}.gz``, one sentence per line, detokenised (the raw text;
BLEU is computed on it with sacrebleu's own tokenisation). 29,000 / 1,014 / 1,000 pairs.

Tokenisation: byte-level BPE from Hugging Face ``tokenizers``, trained on the *training* split only, joint over
both languages (one shared vocabulary, ``shared=True``) or one per language. Byte-level pre-tokenisation makes
decoding exact: ``decode(encode(text)) == text`` for any text, so outputs are detokenised for BLEU by
construction. Ids 0, 1, 2 are padding, BOS and EOS (:mod:`clusterformer.models.seq2seq`).
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path

import torch

from .paths import resolve_data_dir
from .tokenize import TrainedTokenizer

__all__ = ["SPECIALS", "BPETokenizer", "ParallelText", "load_multi30k"]

SPECIALS = ("<pad>", "<bos>", "<eos>")  # ids 0, 1, 2
SPLITS = {"train": "train", "val": "val", "test": "test_2016_flickr"}


@dataclass
class ParallelText:
    source: list[str]
    target: list[str]


def load_multi30k(data_dir: str | Path | None, split: str, *, source: str = "de", target: str = "en",
                  limit: int | None = None) -> ParallelText:
    """The raw sentence pairs of one split ("train", "val" or "test")."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    root = resolve_data_dir(data_dir) / "multi30k"
    sides = []
    for lang in (source, target):
        path = root / f"{SPLITS[split]}.{lang}.gz"
        if not path.is_file():
            raise ValueError(f"expected the file {str(path)!r} (Multi30k; see ../shared/data/README.md)")
        with gzip.open(path, "rt", encoding="utf-8") as f:
            lines = f.read().split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        sides.append(lines)
    if len(sides[0]) != len(sides[1]):
        raise ValueError(f"{root}: {split} has {len(sides[0])} {source} lines but {len(sides[1])} {target} lines")
    if limit is not None:
        sides = [s[:limit] for s in sides]
    return ParallelText(*sides)


class BPETokenizer(TrainedTokenizer):
    """Byte-level BPE (Hugging Face ``tokenizers``) with padding, BOS and EOS as ids 0, 1, 2."""

    @classmethod
    def train(cls, texts: list[str], vocab_size: int) -> BPETokenizer:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        if vocab_size < 300:
            raise ValueError(f"vocab_size must be >= 300 for byte-level BPE (256 bytes + merges), got {vocab_size}")
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    def encode_ids(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts)]

    def decode_ids(self, ids: list[list[int]]) -> list[str]:
        return self._tok.decode_batch(ids, skip_special_tokens=True)


def pad_batch(rows: list[list[int]], max_len: int, *, bos: bool = False, eos: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists -> (ids (n, L), padding mask (n, L)), optionally with BOS / EOS, truncated to max_len."""
    rows = [([1] if bos else []) + r[:max_len - int(bos) - int(eos)] + ([2] if eos else []) for r in rows]
    width = max(1, max((len(r) for r in rows), default=1))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):  # once per data set, not in a hot path
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
    lengths = torch.tensor([len(r) for r in rows])
    return ids, torch.arange(width) >= lengths.unsqueeze(1)
