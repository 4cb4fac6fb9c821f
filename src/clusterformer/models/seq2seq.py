"""An encoder-decoder Transformer for translation (the ClusterFormer paper's Table 1), with cached decoding.

Read top to bottom: config -> cross-attention -> decoder block -> model -> greedy decoding -> beam search.

* Encoder: :class:`clusterformer.models.Encoder` over the source, any registered mechanism (no causal mask).
* Decoder: pre-norm blocks of causal self-attention (any mechanism with cached decoding: strictly causal, e.g.
  ``full`` or ``neural-clustering`` with ``causal_mode="strict"``), cross-attention to the encoder's output and a
  feed-forward layer, then LayerNorm and the output projection (tied to the target embedding, scaled by
  1 / sqrt(dim): :meth:`Seq2Seq.logits`).
* Cross-attention is full softmax attention (SDPA) over every source token: a target token needs all of the
  source, the source is short next to what clustering attention is for, and the keys/values are computed once
  per sentence and reused by every decoding step.

Token ids: 0 is padding, 1 begins a target (BOS), 2 ends it (EOS) (:mod:`clusterformer.data.translation`).
Training is teacher-forced: ``model(src, src_pad, tgt_in) -> logits (B, T, V)``, with ``tgt_in`` = BOS + target
and padding (id 0) after it; the loss is label-smoothed cross-entropy over the real target tokens
(:func:`label_smoothed_loss`).

Decoding: :func:`greedy_decode` and :func:`beam_search` (length penalty ((5 + L) / 6) ** alpha of GNMT), batched
over sentences (and beams), both with the decoder cache (``use_cache=True``: every step costs one token per
sequence) or by recomputing the decoder over the whole prefix (``use_cache=False``, the reference). Beam 1 is
greedy decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_bool, check_float, check_int, check_padding_mask, check_tensor
from ..attention import build, can_decode
from ..attention.registry import make_options
from ..ops.decode import DecodeCache
from .encoder import Encoder, EncoderConfig, sinusoidal_at

__all__ = [
    "BOS",
    "EOS",
    "PAD",
    "CrossAttention",
    "DecoderState",
    "Seq2Seq",
    "Seq2SeqConfig",
    "beam_search",
    "greedy_decode",
    "label_smoothed_loss",
]

PAD, BOS, EOS = 0, 1, 2


@dataclass
class Seq2SeqConfig:
    """Hyper-parameters of :class:`Seq2Seq`.

    Attributes:
        src_vocab_size, tgt_vocab_size: vocabularies (ids 0, 1, 2 are padding, BOS, EOS).
        dim, heads, ff_dim, dropout: as in :class:`clusterformer.models.EncoderConfig` (ff_dim None = 4 * dim).
        encoder_depth, decoder_depth: blocks.
        max_len: longest source and target (positions are sinusoidal; decoding stops there).
        encoder_attention, encoder_options: the source's self-attention (any registered mechanism).
        decoder_attention, decoder_options: the target's causal self-attention (one with cached decoding).
        share_embeddings: one embedding table for source and target (a joint vocabulary: the sizes must match).
    """

    src_vocab_size: int
    tgt_vocab_size: int
    dim: int = 256
    heads: int = 4
    encoder_depth: int = 3
    decoder_depth: int = 3
    ff_dim: int | None = None
    dropout: float = 0.1
    max_len: int = 256
    encoder_attention: str = "full"
    encoder_options: dict[str, Any] = field(default_factory=dict)
    decoder_attention: str = "full"
    decoder_options: dict[str, Any] = field(default_factory=dict)
    share_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("src_vocab_size", "tgt_vocab_size"):
            check_int(name, getattr(self, name), minimum=4)
        for name in ("dim", "heads", "encoder_depth", "decoder_depth", "max_len"):
            check_int(name, getattr(self, name), minimum=1)
        if self.dim % self.heads:
            raise ValueError(f"dim must be divisible by heads; got dim={self.dim}, heads={self.heads}")
        check_float("dropout", self.dropout, minimum=0.0, maximum=1.0, exclusive_maximum=True)
        make_options(self.encoder_attention, self.encoder_options)
        make_options(self.decoder_attention, self.decoder_options)
        if not can_decode(self.decoder_attention, self.decoder_options):
            raise ValueError(
                f"decoder_attention {self.decoder_attention!r} with these options has no cached decoding (it is not "
                "strictly causal); the decoder needs one of full, neural-clustering (causal_mode='strict'), lsh, "
                "routing, kmeans, sliding-window")
        check_bool("share_embeddings", self.share_embeddings)
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ValueError(f"share_embeddings needs one vocabulary; got src_vocab_size={self.src_vocab_size}, "
                             f"tgt_vocab_size={self.tgt_vocab_size}")

    def encoder_config(self) -> EncoderConfig:
        return EncoderConfig(vocab_size=self.src_vocab_size, dim=self.dim, depth=self.encoder_depth, heads=self.heads,
                             ff_dim=self.ff_dim, dropout=self.dropout, max_len=self.max_len,
                             attention=self.encoder_attention, attention_options=dict(self.encoder_options))


class CrossAttention(nn.Module):
    """Full multi-head attention from target positions to the encoder's output (SDPA)."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.dim, self.heads, self.head_dim, self.dropout = dim, heads, dim // heads, dropout
        self.to_q = nn.Linear(dim, dim)
        self.to_kv = nn.Linear(dim, 2 * dim)
        self.to_out = nn.Linear(dim, dim)

    def memory_kv(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """memory (B, S, dim) -> keys, values (B, H, S, D): computed once per sentence."""
        B, S, _ = memory.shape
        kv = self.to_kv(memory).view(B, S, 2, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return kv[0], kv[1]

    def forward(self, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], memory_pad: torch.Tensor | None
                ) -> torch.Tensor:
        """x (B, T, dim) -> (B, T, dim); memory_pad (B, S) True = padding (every sentence has a real token)."""
        B, T, _ = x.shape
        q = self.to_q(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        mask = None if memory_pad is None else ~memory_pad[:, None, None, :]
        out = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask,
                                             dropout_p=self.dropout if self.training else 0.0)
        return self.to_out(out.transpose(1, 2).reshape(B, T, self.dim))


class DecoderBlock(nn.Module):
    """x + Drop(SelfAttn(LN(x))) -> x + Drop(Cross(LN(x), memory)) -> x + Drop(FF(LN(x)))."""

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__()
        dim = config.dim
        self.norm_self = nn.LayerNorm(dim)
        self.self_attn = build(config.decoder_attention, dim=dim, heads=config.heads, **config.decoder_options)
        self.norm_cross = nn.LayerNorm(dim)
        self.cross = CrossAttention(dim, config.heads, config.dropout)
        self.norm_ff = nn.LayerNorm(dim)
        ff_dim = config.ff_dim or 4 * dim
        self.ff = nn.Sequential(nn.Linear(dim, ff_dim), nn.GELU(), nn.Dropout(config.dropout), nn.Linear(ff_dim, dim))
        self.drop = nn.Dropout(config.dropout)

    def _rest(self, x, kv, memory_pad):
        x = x + self.drop(self.cross(self.norm_cross(x), kv, memory_pad))
        return x + self.drop(self.ff(self.norm_ff(x)))

    def forward(self, x, tgt_pad, kv, memory_pad):
        x = x + self.drop(self.self_attn(self.norm_self(x), tgt_pad, causal=True))
        return self._rest(x, kv, memory_pad)

    def prefill(self, x, tgt_pad, kv, memory_pad):
        attended, cache = self.self_attn.prefill(self.norm_self(x), tgt_pad)
        return self._rest(x + self.drop(attended), kv, memory_pad), cache

    def step(self, x_t, cache, kv, memory_pad):
        """x_t (B, dim) -> (B, dim)."""
        attended, cache = self.self_attn.step(self.norm_self(x_t), cache)
        return self._rest((x_t + self.drop(attended)).unsqueeze(1), kv, memory_pad).squeeze(1), cache


@dataclass
class DecoderState:
    """What decoding carries between steps: each block's self-attention cache and cross-attention keys/values,
    the source padding, and ``lengths`` (B,) target tokens so far."""

    caches: list[DecodeCache]
    cross: list[tuple[torch.Tensor, torch.Tensor]]
    memory_pad: torch.Tensor | None
    lengths: torch.Tensor

    def select(self, index: torch.Tensor) -> DecoderState:
        """Sequence i of the result is sequence ``index[i]`` of this state (beam search)."""
        return DecoderState([c.select(index) for c in self.caches],
                            [(k.index_select(0, index), v.index_select(0, index)) for k, v in self.cross],
                            None if self.memory_pad is None else self.memory_pad.index_select(0, index),
                            self.lengths.index_select(0, index))


class Seq2Seq(nn.Module):
    """Encoder-decoder Transformer: ``forward(src (B, S), src_pad (B, S) | None, tgt_in (B, T)) -> (B, T, V)``."""

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(config.encoder_config())
        self.tgt_embed = (self.encoder.embed if config.share_embeddings
                          else nn.Embedding(config.tgt_vocab_size, config.dim, padding_idx=PAD))
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(DecoderBlock(config) for _ in range(config.decoder_depth))
        self.norm = nn.LayerNorm(config.dim)

    def encode(self, src: torch.Tensor, src_pad: torch.Tensor | None = None) -> torch.Tensor:
        """(B, S) source ids -> the encoder's output (B, S, dim)."""
        return self.encoder(src, src_pad)

    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        positions = sinusoidal_at(positions, self.config.dim).to(self.tgt_embed.weight.dtype)
        return self.drop(self.tgt_embed(tokens) + positions)

    def decode(self, tgt_in: torch.Tensor, memory: torch.Tensor, src_pad: torch.Tensor | None) -> torch.Tensor:
        """Teacher-forced decoder: tgt_in (B, T) (padding id 0 after the real tokens) -> logits (B, T, V)."""
        check_tensor("tgt_in", tgt_in, ndim=2)
        T = tgt_in.shape[1]
        if self.config.max_len < T:
            raise ValueError(f"tgt_in has length {T} > max_len={self.config.max_len}")
        tgt_pad = tgt_in == PAD
        x = self._embed(tgt_in, torch.arange(T, device=tgt_in.device))
        for block in self.blocks:
            x = block(x, tgt_pad if bool(tgt_pad.any()) else None, block.cross.memory_kv(memory), src_pad)
        return self.logits(self.norm(x))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output projection, tied to the target embedding E (entries ~ N(0, 1)): hidden E^T / sqrt(dim), so
        that logits start at unit scale (fairseq's embedding scale, written the other way round)."""
        return F.linear(hidden, self.tgt_embed.weight) * self.config.dim ** -0.5

    def forward(self, src: torch.Tensor, src_pad: torch.Tensor | None, tgt_in: torch.Tensor) -> torch.Tensor:
        check_tensor("src", src, ndim=2)
        src_pad = check_padding_mask(src_pad, src.shape[0], src.shape[1], device=src.device)
        if src.shape[1] > self.config.max_len:
            raise ValueError(f"src has length {src.shape[1]} > max_len={self.config.max_len}")
        return self.decode(tgt_in, self.encode(src, src_pad), src_pad)

    # cached decoding
    def start(self, memory: torch.Tensor, src_pad: torch.Tensor | None) -> tuple[torch.Tensor, DecoderState]:
        """Feed BOS to every sentence: (next-token logits (B, V), the decoding state)."""
        B = memory.shape[0]
        bos = torch.full((B, 1), BOS, dtype=torch.long, device=memory.device)
        x = self._embed(bos, torch.arange(1, device=memory.device))
        caches, cross = [], []
        for block in self.blocks:
            kv = block.cross.memory_kv(memory)
            x, cache = block.prefill(x, None, kv, src_pad)
            caches.append(cache)
            cross.append(kv)
        lengths = torch.ones(B, dtype=torch.long, device=memory.device)
        return self.logits(self.norm(x[:, 0])), DecoderState(caches, cross, src_pad, lengths)

    def step(self, tokens: torch.Tensor, state: DecoderState) -> tuple[torch.Tensor, DecoderState]:
        """tokens (B,), each sequence's next target token -> (next-token logits (B, V), state updated in place)."""
        x = self._embed(tokens, state.lengths)
        for i, block in enumerate(self.blocks):
            x, state.caches[i] = block.step(x, state.caches[i], state.cross[i], state.memory_pad)
        state.lengths = state.lengths + 1
        return self.logits(self.norm(x)), state


def label_smoothed_loss(logits: torch.Tensor, targets: torch.Tensor, smoothing: float = 0.1) -> torch.Tensor:
    """Cross-entropy with label smoothing over the real target tokens (targets == PAD are ignored), mean per token."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=PAD,
                           label_smoothing=smoothing)


# -------------------------------------------------------------------------------------------------- decoding
def _decode_limit(model: Seq2Seq, src_pad: torch.Tensor | None, src: torch.Tensor, max_new_tokens: int | None) -> int:
    if max_new_tokens is not None:
        check_int("max_new_tokens", max_new_tokens, minimum=1)
        return min(max_new_tokens, model.config.max_len - 1)
    longest = src.shape[1] if src_pad is None else int((~src_pad).sum(1).max())
    return min(int(1.5 * longest) + 10, model.config.max_len - 1)


def _banned(logp: torch.Tensor) -> torch.Tensor:
    """Padding and BOS are never generated."""
    logp[:, PAD] = float("-inf")
    logp[:, BOS] = float("-inf")
    return logp


class _Decoder:
    """Next-token log-probabilities for growing prefixes: from the cache, or by re-running the decoder."""

    def __init__(self, model: Seq2Seq, memory: torch.Tensor, src_pad: torch.Tensor | None, use_cache: bool) -> None:
        self.model, self.memory, self.src_pad, self.use_cache = model, memory, src_pad, use_cache
        B = memory.shape[0]
        self.prefix = torch.full((B, 1), BOS, dtype=torch.long, device=memory.device)
        self.state = None

    def first(self) -> torch.Tensor:
        if self.use_cache:
            logits, self.state = self.model.start(self.memory, self.src_pad)
            return _banned(logits.float().log_softmax(-1))
        return self._recompute()

    def next(self, tokens: torch.Tensor) -> torch.Tensor:
        self.prefix = torch.cat([self.prefix, tokens.unsqueeze(1)], dim=1)
        if self.use_cache:
            logits, self.state = self.model.step(tokens, self.state)
            return _banned(logits.float().log_softmax(-1))
        return self._recompute()

    def _recompute(self) -> torch.Tensor:
        # finished sequences continue with padding tokens, which the decoder masks as keys: fine for a reference
        logits = self.model.decode(self.prefix, self.memory, self.src_pad)[:, -1]
        return _banned(logits.float().log_softmax(-1))

    def reorder(self, index: torch.Tensor) -> None:
        self.prefix = self.prefix.index_select(0, index)
        self.memory = self.memory.index_select(0, index)
        self.src_pad = None if self.src_pad is None else self.src_pad.index_select(0, index)
        if self.state is not None:
            self.state = self.state.select(index)


def _check_source(model: Seq2Seq, src: torch.Tensor, src_pad: torch.Tensor | None) -> torch.Tensor | None:
    check_tensor("src", src, ndim=2)
    src_pad = check_padding_mask(src_pad, src.shape[0], src.shape[1], device=src.device)
    if src_pad is not None and bool(src_pad.all(1).any()):
        raise ValueError("every source sentence must hold at least one token")
    if model.training:
        raise ValueError("decoding needs eval mode (no dropout): call model.eval() first")
    return src_pad


@torch.no_grad()
def greedy_decode(model: Seq2Seq, src: torch.Tensor, src_pad: torch.Tensor | None = None, *,
                  max_new_tokens: int | None = None, use_cache: bool = True) -> list[list[int]]:
    """The most likely next token at every step, for a batch of sources; each output stops before EOS (or at
    ``max_new_tokens``, default 1.5 x the longest source + 10)."""
    src_pad = _check_source(model, src, src_pad)
    limit = _decode_limit(model, src_pad, src, max_new_tokens)
    decoder = _Decoder(model, model.encode(src, src_pad), src_pad, use_cache)
    B = src.shape[0]
    out = torch.full((B, limit), PAD, dtype=torch.long, device=src.device)
    done = torch.zeros(B, dtype=torch.bool, device=src.device)
    logp = decoder.first()
    for t in range(limit):  # one token per step: decoding is sequential by nature
        token = logp.argmax(-1).masked_fill(done, PAD)
        out[:, t] = token
        done |= token == EOS
        if bool(done.all()) or t + 1 == limit:
            break
        logp = decoder.next(token)
    return [_until_eos(row) for row in out.tolist()]


def _until_eos(ids: list[int]) -> list[int]:
    return ids[:ids.index(EOS)] if EOS in ids else [i for i in ids if i != PAD]


def _length_penalty(length: torch.Tensor, alpha: float) -> torch.Tensor:
    return ((5.0 + length.to(torch.float32)) / 6.0) ** alpha


@torch.no_grad()
def beam_search(model: Seq2Seq, src: torch.Tensor, src_pad: torch.Tensor | None = None, *, beam: int = 5,
                length_penalty: float = 1.0, max_new_tokens: int | None = None,
                use_cache: bool = True) -> list[list[int]]:
    """Beam search over a batch of sources (all beams of all sentences in one batch).

    Hypotheses are ranked by log-probability / ((5 + L) / 6) ** length_penalty (GNMT), L = tokens generated
    including EOS. A hypothesis that emitted EOS is finished: it keeps its score and continues with padding at no
    cost, competing with the live ones. Search stops when every beam is finished or at ``max_new_tokens``.
    ``beam=1`` is greedy decoding."""
    check_int("beam", beam, minimum=1)
    check_float("length_penalty", length_penalty, minimum=0.0)
    src_pad = _check_source(model, src, src_pad)
    limit = _decode_limit(model, src_pad, src, max_new_tokens)
    B, K, device = src.shape[0], beam, src.device
    rows = torch.arange(B, device=device).repeat_interleave(K)
    memory = model.encode(src, src_pad)
    decoder = _Decoder(model, memory.index_select(0, rows), None if src_pad is None else src_pad.index_select(0, rows),
                       use_cache)
    scores = torch.full((B, K), float("-inf"), device=device)
    scores[:, 0] = 0.0  # one live hypothesis per sentence at the start
    finished = torch.zeros(B, K, dtype=torch.bool, device=device)
    lengths = torch.zeros(B, K, dtype=torch.long, device=device)
    history = torch.zeros(B * K, 0, dtype=torch.long, device=device)
    logp = decoder.first()
    for t in range(limit):
        V = logp.shape[-1]
        logp = logp.view(B, K, V)
        continuation = torch.full_like(logp, float("-inf"))
        continuation[..., PAD] = 0.0  # a finished hypothesis continues with padding, score unchanged
        logp = torch.where(finished.unsqueeze(-1), continuation, logp)
        candidates = scores.unsqueeze(-1) + logp  # (B, K, V)
        new_length = torch.where(finished, lengths, t + 1).unsqueeze(-1).expand(B, K, V)
        ranked = (candidates / _length_penalty(new_length, length_penalty)).view(B, K * V)
        choice = ranked.topk(K, dim=-1).indices  # (B, K)
        origin, token = torch.div(choice, V, rounding_mode="floor"), choice % V
        scores = candidates.view(B, K * V).gather(1, choice)
        was_finished = finished.gather(1, origin)
        lengths = torch.where(was_finished, lengths.gather(1, origin), t + 1)
        finished = was_finished | (token == EOS)
        flat = (origin + torch.arange(B, device=device).unsqueeze(1) * K).view(-1)
        history = torch.cat([history.index_select(0, flat), token.view(-1, 1)], dim=1)
        if bool(finished.all()) or t + 1 == limit:
            break
        decoder.reorder(flat)
        logp = decoder.next(token.view(-1))
    best = (scores / _length_penalty(lengths, length_penalty)).argmax(-1)  # (B,)
    chosen = history.view(B, K, -1)[torch.arange(B, device=device), best]
    return [_until_eos(row) for row in chosen.tolist()]
