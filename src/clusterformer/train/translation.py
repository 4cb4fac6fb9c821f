"""The translation task (``--task multi30k``): De->En on Multi30k, BLEU by sacrebleu on the detokenised test set.

A :class:`clusterformer.train.tasks.Task` like the others: the training loop sees batches whose ``extra``
input carries the teacher-forced target input (BOS + target), a label-smoothed loss, and an evaluation that translates
the test sources with the model (greedy and beam search, both with the decoder cache) and scores them with
``sacrebleu.corpus_bleu`` against the raw references; the metrics carry sacrebleu's signature.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..data.translation import BPETokenizer, load_multi30k, pad_batch
from ..models import EncoderConfig
from ..models.seq2seq import Seq2Seq, Seq2SeqConfig, beam_search, greedy_decode, label_smoothed_loss
from .batch import Batch

__all__ = ["TranslationTask", "Translator", "prepare_multi30k", "tokenizers_from_state", "translation_model_config"]


@dataclass
class Translator:
    """A trained :class:`Seq2Seq` with its tokenizers: ``translate(lines) -> lines`` in batches."""

    model: Seq2Seq
    source: BPETokenizer
    target: BPETokenizer
    max_len: int

    def translate(self, lines: list[str], *, beam: int = 5, length_penalty: float = 1.0, batch_size: int = 64,
                  use_cache: bool = True) -> list[str]:
        """Translate sentences (sorted by length into batches, returned in the input order)."""
        for i, line in enumerate(lines, start=1):
            if not line.strip():
                raise ValueError(f"line {i} of the input is empty; give one sentence per line")
        ids = self.source.encode_ids(lines)
        order = sorted(range(len(lines)), key=lambda i: len(ids[i]))
        out: list[str] = [""] * len(lines)
        device = next(self.model.parameters()).device
        for start in range(0, len(order), batch_size):  # batches of sentences, not a hot path
            chunk = order[start:start + batch_size]
            src, pad = pad_batch([ids[i] for i in chunk], self.max_len)
            src, pad = src.to(device), pad.to(device)
            pad = pad if bool(pad.any()) else None
            if beam == 1:
                hyps = greedy_decode(self.model, src, pad, use_cache=use_cache)
            else:
                hyps = beam_search(self.model, src, pad, beam=beam, length_penalty=length_penalty, use_cache=use_cache)
            for i, text in zip(chunk, self.target.decode_ids(hyps), strict=True):
                out[i] = text
        return out


@dataclass
class TranslationTask:
    """Sentence pairs -> a translation model; metric BLEU (beam search) and greedy BLEU beside it."""

    name: str
    train_src: torch.Tensor  # (n, S) ids
    train_src_pad: torch.Tensor
    train_tgt: torch.Tensor  # (n, T) BOS + target + EOS, padding 0
    test_sources: list[str]
    test_references: list[str]
    source: BPETokenizer
    target: BPETokenizer
    max_len: int
    decoder_attention: str | None = None  # None: the encoder's mechanism if it can decode, else full
    decoder_options: dict[str, Any] | None = None
    label_smoothing: float = 0.1
    beam: int = 5
    info: dict[str, Any] = field(default_factory=dict)
    metric: str = "bleu"
    kind: str = "translation"

    @property
    def vocab_size(self) -> int:
        return self.source.vocab_size

    @property
    def num_classes(self) -> int:
        return self.target.vocab_size

    @property
    def tokenizer(self) -> str:
        shared = self.source is self.target
        return json.dumps({"shared": shared, "source": self.source.to_str(),
                           "target": None if shared else self.target.to_str()})

    def build_model(self, encoder: EncoderConfig) -> nn.Module:
        return Seq2Seq(translation_model_config(encoder, self.source, self.target, self.decoder_attention,
                                                self.decoder_options))

    def model_max_len(self, max_len: int) -> int:
        return max_len + 2  # BOS and EOS around a target of max_len tokens

    def steps_per_epoch(self, batch_size: int, world: int) -> int:
        n = len(self.train_src)
        steps = n // (batch_size * world)
        if steps == 0:
            raise ValueError(f"the training set has {n} pairs, fewer than batch_size * world_size = "
                             f"{batch_size * world}; lower --batch-size")
        return steps

    def batch(self, step: int, per_epoch: int, batch_size: int, rank: int, world: int, seed: int):
        """As the classification tasks: epoch e visits the permutation drawn from ``seed + e``."""
        B = batch_size
        epoch, within = divmod(step, per_epoch)
        order = torch.randperm(len(self.train_src), generator=torch.Generator().manual_seed(seed + epoch))
        global_index = order[within * world * B:(within + 1) * world * B]
        keep_src = int((~self.train_src_pad[global_index]).sum(1).max().clamp(min=1))
        keep_tgt = int((self.train_tgt[global_index] != 0).sum(1).max())
        index = global_index[rank * B:(rank + 1) * B]
        tgt = self.train_tgt[index, :keep_tgt]
        return Batch(self.train_src[index, :keep_src], self.train_src_pad[index, :keep_src], tgt[:, 1:], tgt[:, :-1])

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return label_smoothed_loss(logits, targets, self.label_smoothing)

    def evaluate(self, predict, batch_size: int) -> dict[str, Any]:
        """BLEU of beam search (``beam``) and of greedy decoding on the test set (``predict.model`` decodes)."""
        import sacrebleu

        translator = Translator(predict.model, self.source, self.target, self.max_len)
        result: dict[str, Any] = {}
        for key, beam in (("bleu", self.beam), ("bleu_greedy", 1)):
            hyps = translator.translate(self.test_sources, beam=beam, batch_size=max(batch_size, 32))
            bleu = sacrebleu.metrics.BLEU()
            score = bleu.corpus_score(hyps, [self.test_references])
            result[key] = score.score
            if key == "bleu":
                result["sacrebleu"] = str(bleu.get_signature())
                result["samples"] = [{"source": s, "reference": r, "hypothesis": h} for s, r, h in
                                     zip(self.test_sources[:3], self.test_references[:3], hyps[:3], strict=True)]
        result.update(beam=self.beam, test_sentences=len(self.test_sources))
        return result


def translation_model_config(encoder: EncoderConfig, source: BPETokenizer, target: BPETokenizer,
                             decoder_attention: str | None, decoder_options: dict[str, Any] | None) -> Seq2SeqConfig:
    """The encoder-decoder of ``--task multi30k``: encoder and decoder of the encoder config's width and depth;
    the decoder's self-attention is ``decoder_attention``, or by default the encoder's mechanism where it has cached
    decoding (strictly causal), else full."""
    from ..attention import can_decode

    name, options = decoder_attention, decoder_options
    if name is None:
        name, options = ((encoder.attention, encoder.attention_options)
                         if can_decode(encoder.attention, encoder.attention_options) else ("full", {}))
    return Seq2SeqConfig(
        src_vocab_size=source.vocab_size, tgt_vocab_size=target.vocab_size, dim=encoder.dim, heads=encoder.heads,
        encoder_depth=encoder.depth, decoder_depth=encoder.depth, ff_dim=encoder.ff_dim, dropout=encoder.dropout,
        max_len=encoder.max_len, encoder_attention=encoder.attention, encoder_options=dict(encoder.attention_options),
        decoder_attention=name, decoder_options=dict(options or {}), share_embeddings=source is target)


def tokenizers_from_state(state: str) -> tuple[BPETokenizer, BPETokenizer]:
    saved = json.loads(state)
    source = BPETokenizer.from_str(saved["source"])
    return source, source if saved["shared"] else BPETokenizer.from_str(saved["target"])


def prepare_multi30k(data_dir, max_len: int, vocab_size: int, limit: int | None, state: str | None, *,
                     shared_vocab: bool = True, decoder_attention: str | None = None,
                     decoder_options: dict[str, Any] | None = None, label_smoothing: float = 0.1,
                     beam: int = 5) -> TranslationTask:
    """Multi30k De->En: BPE trained on the training split only (joint, or one per language), test_2016_flickr
    for BLEU. ``limit`` keeps the first pairs of each split."""
    train = load_multi30k(data_dir, "train", limit=limit)
    test = load_multi30k(data_dir, "test", limit=limit)
    if state is not None:
        source, target = tokenizers_from_state(state)
    elif shared_vocab:
        source = target = BPETokenizer.train(train.source + train.target, vocab_size)
    else:
        source, target = BPETokenizer.train(train.source, vocab_size), BPETokenizer.train(train.target, vocab_size)
    src, src_pad = pad_batch(source.encode_ids(train.source), max_len)
    tgt, _ = pad_batch(target.encode_ids(train.target), max_len + 2, bos=True, eos=True)
    return TranslationTask(
        "multi30k", src, src_pad, tgt, test.source, test.target, source, target, max_len, decoder_attention,
        decoder_options, label_smoothing, beam,
        info={"protocol": f"Multi30k De->En: train {len(train.source)} pairs / test_2016_flickr "
                          f"{len(test.source)}; byte-level BPE {'joint' if source is target else 'per language'} "
                          f"({source.vocab_size} tokens) from the training split; BLEU by sacrebleu, detokenised"})
