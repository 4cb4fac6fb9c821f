"""A pre-norm Transformer encoder over any registered attention, and a sequence classifier on top.

Read top to bottom: config dataclass -> positional encodings -> block -> encoder -> classifier.
Auxiliary losses of the attention layers are collected around a forward with
:func:`clusterformer.attention.collect_aux_losses` (see :mod:`clusterformer.attention.aux`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import (
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_padding_mask,
    check_tensor,
)
from ..attention import AttentionLayer, build, describe
from ..attention.base import LAYER_SEED_STRIDE, layer_seed  # noqa: F401  (re-exported)
from ..attention.registry import get, make_options, names_where
from ..masks import real_tokens
from ..ops.decode import DecodeCache
from .reversible import ReversibleSequence

__all__ = ["Encoder", "EncoderCache", "EncoderConfig", "MaskedLanguageModel", "SequenceClassifier", "TokenClassifier",
           "cluster_former_config"]


@dataclass
class EncoderConfig:
    """Hyper-parameters of :class:`Encoder`.

    Attributes:
        vocab_size: token vocabulary size (token 0 is the padding index).
        dim: model width d_model.
        depth: number of blocks.
        heads: attention heads (dim must be divisible by heads).
        ff_dim: feed-forward hidden size; None means 4 * dim.
        dropout: dropout on embeddings, attention outputs and feed-forward.
        max_len: longest sequence (size of the learned positional table; sinusoidal has no limit).
        positional: "sinusoidal", "learned" or "none".
        attention: registered mechanism name.
        attention_options: options for that mechanism (validated by the registry).
        centroid_flow: neural-clustering only -- the paper's scheme, where layer 1 owns the centroids and
            layer l + 1 starts from layer l's updated centroids C_hat. False gives every layer its own.
        layer_attention: per-layer overrides, {layer index: (mechanism name, options)}; other layers use
            ``attention``. Cluster-Former stacks are built this way (:func:`cluster_former_config`).
        reversible: reversible residual blocks (RevNet / Reformer, :mod:`clusterformer.models.reversible`):
            activation memory flat in depth. The input is duplicated into (x1, x2) and the two streams
            averaged at the end.
        tied: with ``reversible``, add the tied connection H(x1, x2) of the k-means/reversible paper (§3.3).
        tied_lipschitz: H's contraction constant in x1, which keeps a tied block invertible as it trains
            (:class:`clusterformer.models.reversible.TiedConnection`); None: the paper's unconstrained H.
    """

    vocab_size: int
    dim: int = 256
    depth: int = 2
    heads: int = 4
    ff_dim: int | None = None
    dropout: float = 0.1
    max_len: int = 4096
    positional: str = "sinusoidal"
    attention: str = "full"
    attention_options: dict[str, Any] = field(default_factory=dict)
    centroid_flow: bool = False
    layer_attention: dict[int, tuple[str, dict[str, Any]]] = field(default_factory=dict)
    reversible: bool = False
    tied: bool = False
    tied_lipschitz: float | None = 0.5

    def __post_init__(self) -> None:
        check_int("vocab_size", self.vocab_size, minimum=2)
        check_int("dim", self.dim, minimum=1)
        check_int("depth", self.depth, minimum=1)
        check_int("heads", self.heads, minimum=1)
        if self.dim % self.heads:
            raise ValueError(f"dim must be divisible by heads; got dim={self.dim}, heads={self.heads}")
        if self.ff_dim is not None:
            check_int("ff_dim", self.ff_dim, minimum=1)
        check_float("dropout", self.dropout, minimum=0.0, maximum=1.0, exclusive_maximum=True)
        check_int("max_len", self.max_len, minimum=1)
        check_choice("positional", self.positional, ("sinusoidal", "learned", "none"))
        make_options(self.attention, self.attention_options)  # unknown name / bad option -> ValueError
        check_bool("centroid_flow", self.centroid_flow)
        if self.centroid_flow and not get(self.attention).learned_centroids:
            raise ValueError(f"centroid_flow needs attention="
                             f"{' or '.join(map(repr, names_where(learned_centroids=True)))}, got {self.attention!r}")
        if self.centroid_flow and "own_centroids" in self.attention_options:
            raise ValueError("centroid_flow sets own_centroids per layer; do not pass it in attention_options")
        if not isinstance(self.layer_attention, dict):
            raise ValueError(f"layer_attention must be a dict {{layer: (name, options)}}, got {self.layer_attention!r}")
        for layer, spec in self.layer_attention.items():
            check_int("layer_attention key", layer, minimum=0)
            if layer >= self.depth:
                raise ValueError(f"layer_attention names layer {layer}, but depth is {self.depth}")
            if not (isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], dict)):
                raise ValueError(f"layer_attention[{layer}] must be (name, options dict), got {spec!r}")
            make_options(spec[0], spec[1])
        if self.centroid_flow and self.layer_attention:
            raise ValueError("centroid_flow cannot be combined with layer_attention overrides")
        check_bool("reversible", self.reversible)
        check_bool("tied", self.tied)
        if self.tied and not self.reversible:
            raise ValueError("tied=True needs reversible=True (the tied connection belongs to reversible blocks)")
        if self.tied_lipschitz is not None:
            check_float("tied_lipschitz", self.tied_lipschitz, minimum=0.0, maximum=1.0, exclusive_minimum=True,
                        exclusive_maximum=True)
        if self.reversible and self.centroid_flow:
            raise ValueError("centroid_flow is not supported with reversible=True (blocks are replayed one by one)")

    def attention_for(self, layer: int) -> tuple[str, dict[str, Any]]:
        """Mechanism name and options of block ``layer``.

        Mechanisms with a ``seed`` option (hash rotations, hash planes, initial centroids) get a distinct seed
        per layer, ``seed + LAYER_SEED_STRIDE * layer`` (``seed`` as given, or the mechanism's default), so
        layers hash independently as in the Reformer while a fixed seed still reproduces the whole model."""
        if layer in self.layer_attention:
            name, options = self.layer_attention[layer]
            options = dict(options)
        else:
            name, options = self.attention, dict(self.attention_options)
            if self.centroid_flow:
                options["own_centroids"] = layer == 0
        defaults = describe(name)["options"]
        if "seed" in defaults:
            options["seed"] = layer_seed(options.get("seed", defaults["seed"]), layer)
        return name, options




def cluster_former_config(
    vocab_size: int, *, depth: int = 4, cluster_layers: tuple[int, ...] = (2,), window: int = 128,
    stride: int = 64, num_clusters: int = 32, cluster_options: dict[str, Any] | None = None, **config: Any,
) -> EncoderConfig:
    """The Cluster-Former stack (section 3): sliding-window layers everywhere except ``cluster_layers``
    (0-based), which are Cluster-Former layers with the same window and stride. The paper's LM model uses
    16 layers with Cluster-Former layers 11 and 15 (1-based); its QA model 24 layers with 15 and 20."""
    for layer in cluster_layers:
        check_int("cluster_layers entry", layer, minimum=0)
        if layer >= depth:
            raise ValueError(f"cluster_layers entry {layer} is >= depth={depth}")
    options = {"window": window, "stride": stride, "num_clusters": num_clusters, **(cluster_options or {})}
    return EncoderConfig(
        vocab_size=vocab_size, depth=depth, attention="sliding-window",
        attention_options={"window": window, "stride": stride},
        layer_attention={layer: ("cluster-former", options) for layer in cluster_layers}, **config,
    )


def sinusoidal_positions(length: int, dim: int, device: torch.device | None = None) -> torch.Tensor:
    """(length, dim) sine/cosine position encodings of Vaswani et al."""
    return sinusoidal_at(torch.arange(length, device=device), dim)


def sinusoidal_at(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """(..., dim) sine/cosine encodings of the given integer positions (one token per sequence when decoding)."""
    device = positions.device
    position = positions.to(torch.float32).unsqueeze(-1)
    freq = torch.exp(torch.arange(0, dim, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(*positions.shape, dim, device=device)
    table[..., 0::2] = torch.sin(position * freq)
    table[..., 1::2] = torch.cos(position * freq[: dim // 2])
    return table


class Block(nn.Module):
    """Pre-norm block: x + Drop(Attn(LN(x))), then x + Drop(FF(LN(x)))."""

    def __init__(self, config: EncoderConfig, attention: AttentionLayer) -> None:
        super().__init__()
        ff_dim = config.ff_dim or 4 * config.dim
        self.norm_attn = nn.LayerNorm(config.dim)
        self.attn = attention
        self.norm_ff = nn.LayerNorm(config.dim)
        self.ff = nn.Sequential(
            nn.Linear(config.dim, ff_dim), nn.GELU(), nn.Dropout(config.dropout), nn.Linear(ff_dim, config.dim)
        )
        self.drop = nn.Dropout(config.dropout)

    def attention_branch(self, x, key_padding_mask=None, causal=False):
        """Drop(Attn(LN(x))): F of a reversible block."""
        return self.drop(self.attn(self.norm_attn(x), key_padding_mask, causal))

    def ff_branch(self, x):
        """Drop(FF(LN(x))): G of a reversible block."""
        return self.drop(self.ff(self.norm_ff(x)))

    def prefill_attention(self, x, key_padding_mask=None):
        """F over a prompt under a strict causal mask, and its attention cache (eval mode: no dropout)."""
        attended, cache = self.attn.prefill(self.norm_attn(x), key_padding_mask)
        return self.drop(attended), cache

    def step_attention(self, x_t, cache):
        """F for one new token per sequence, x_t (B, dim), against the cache."""
        attended, cache = self.attn.step(self.norm_attn(x_t), cache)
        return self.drop(attended), cache

    def forward(self, x, key_padding_mask=None, causal=False, flow=None):
        """(x, flow) -> (x', flow'): the flow is what attention layers hand on (neural clustering's centroids)."""
        attended, flow = self.attn(self.norm_attn(x), key_padding_mask, causal, flow=flow, return_flow=True)
        x = x + self.drop(attended)
        return x + self.ff_branch(x), flow


@dataclass
class EncoderCache:
    """The decoding state of an :class:`Encoder`: one attention cache per block (:mod:`clusterformer.ops.decode`)
    and ``lengths`` (B,), the tokens each sequence holds so far (its next token's position)."""

    layers: list[DecodeCache]
    lengths: torch.Tensor

    def select(self, index: torch.Tensor) -> EncoderCache:
        """Sequence i of the result is sequence ``index[i]`` of this cache (beam search: reorder, repeat)."""
        return EncoderCache([cache.select(index) for cache in self.layers], self.lengths.index_select(0, index))

    def memory_bytes(self) -> int:
        return sum(cache.memory_bytes() for cache in self.layers)


class Encoder(nn.Module):
    """Token embeddings + positions + ``depth`` pre-norm blocks + final LayerNorm.

    ``forward(tokens (B, N) long, key_padding_mask (B, N) bool | None, causal=False) -> (B, N, dim)``.

    Cached decoding (every block's mechanism strictly causal, eval mode): ``prefill(tokens, key_padding_mask)
    -> (hidden (B, N, dim), EncoderCache)`` equals ``forward(..., causal=True)`` on a right-padded prompt batch,
    and ``step(tokens_t (B,), cache) -> (hidden (B, dim), cache)`` gives each sequence's next position, equal
    to the causal forward over the whole sequence there.
    """

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim, padding_idx=0)
        self.positions = nn.Embedding(config.max_len, config.dim) if config.positional == "learned" else None
        self.drop = nn.Dropout(config.dropout)
        blocks = []
        for layer in range(config.depth):
            name, options = config.attention_for(layer)
            blocks.append(Block(config, build(name, dim=config.dim, heads=config.heads, **options)))
        self.blocks = nn.ModuleList(blocks)
        self.reversible = None
        if config.reversible:
            self.reversible = ReversibleSequence(self.blocks, dim=config.dim, tied=config.tied,
                                                 tied_lipschitz=config.tied_lipschitz)
        self.norm = nn.LayerNorm(config.dim)

    def forward(
        self, tokens: torch.Tensor, key_padding_mask: torch.Tensor | None = None, causal: bool = False
    ) -> torch.Tensor:
        key_padding_mask = self._check_tokens(tokens, key_padding_mask)
        x = self._embed(tokens, torch.arange(tokens.shape[1], device=tokens.device))
        if self.reversible is not None:
            y1, y2 = self.reversible(x, x, key_padding_mask=key_padding_mask, causal=causal)
            return self.norm((y1 + y2) / 2)
        flow = None
        for block in self.blocks:
            x, flow = block(x, key_padding_mask, causal, flow)
            if not self.config.centroid_flow:  # the paper's flow: layer l + 1 starts from layer l's C_hat
                flow = None
        return self.norm(x)

    def _check_tokens(self, tokens: torch.Tensor, key_padding_mask: torch.Tensor | None) -> torch.Tensor | None:
        """Validate (B, N) integer tokens and their padding mask; the checked mask."""
        check_tensor("tokens", tokens, ndim=2)
        if tokens.is_floating_point() or tokens.dtype == torch.bool:
            raise ValueError(f"tokens must be an integer tensor, got dtype {tokens.dtype}")
        B, N = tokens.shape
        if self.config.max_len < N and self.config.positional == "learned":
            raise ValueError(f"tokens has length {N} > max_len={self.config.max_len} of the learned positions")
        return check_padding_mask(key_padding_mask, B, N, device=tokens.device)

    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token embeddings plus the encodings of ``positions`` (broadcast against tokens), then dropout."""
        x = self.embed(tokens)
        if self.config.positional == "sinusoidal":
            x = x + sinusoidal_at(positions, self.config.dim).to(x.dtype)
        elif self.positions is not None:
            x = x + self.positions(positions)
        return self.drop(x)

    def prefill(self, tokens: torch.Tensor, key_padding_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, EncoderCache]:
        """The causal forward over a right-padded prompt batch and the cache that continues it."""
        key_padding_mask = self._check_tokens(tokens, key_padding_mask)
        x = self._embed(tokens, torch.arange(tokens.shape[1], device=tokens.device))
        caches = []

        def attend(i: int, block: Block, h: torch.Tensor) -> torch.Tensor:
            f_out, cache = block.prefill_attention(h, key_padding_mask)
            caches.append(cache)
            return f_out

        x = self._decoding_blocks(x, attend)
        return self.norm(x), EncoderCache(caches, caches[0].lengths.clone())

    def _decoding_blocks(self, x: torch.Tensor, attend) -> torch.Tensor:
        """The blocks as in :meth:`forward` with the attention branch F given by ``attend(i, block, h)`` (prefill or
        step): reversible, y1 = x1 + F(x2) [+ H(x1, x2)], y2 = x2 + G(y1), streams averaged; else pre-norm residual."""
        if self.reversible is not None:
            x1 = x2 = x
            for i, block in enumerate(self.blocks):
                f_out = attend(i, block, x2)
                x1 = x1 + f_out + (self.reversible.tied[i](x1, x2) if self.reversible.tied is not None else 0)
                x2 = x2 + block.ff_branch(x1)
            return (x1 + x2) / 2
        for i, block in enumerate(self.blocks):
            x = x + attend(i, block, x)
            x = x + block.ff_branch(x)
        return x

    def step(self, tokens: torch.Tensor, cache: EncoderCache) -> tuple[torch.Tensor, EncoderCache]:
        """tokens (B,) long, each sequence's next token -> (hidden (B, dim), cache updated in place)."""
        check_tensor("tokens", tokens, ndim=1)
        if tokens.is_floating_point() or tokens.dtype == torch.bool:
            raise ValueError(f"tokens must be an integer tensor, got dtype {tokens.dtype}")
        if not isinstance(cache, EncoderCache) or cache.lengths.shape != tokens.shape:
            raise ValueError(f"cache must be the EncoderCache of {tokens.shape[0]} sequences from prefill/step")
        if self.config.positional == "learned" and int(cache.lengths.max()) >= self.config.max_len:
            raise ValueError(f"position {int(cache.lengths.max())} is past max_len={self.config.max_len} of the "
                             "learned positions")
        x = self._embed(tokens, cache.lengths)

        def attend(i: int, block: Block, h: torch.Tensor) -> torch.Tensor:
            f_out, cache.layers[i] = block.step_attention(h, cache.layers[i])
            return f_out

        x = self._decoding_blocks(x, attend)
        cache.lengths = cache.lengths + 1
        return self.norm(x), cache


class SequenceClassifier(nn.Module):
    """Encoder + masked mean pooling (or the first token) + linear head -> logits (B, num_classes)."""

    def __init__(self, config: EncoderConfig, num_classes: int, pooling: str = "mean") -> None:
        super().__init__()
        check_int("num_classes", num_classes, minimum=2)
        self.pooling = check_choice("pooling", pooling, ("mean", "first"))
        self.encoder = Encoder(config)
        self.head = nn.Linear(config.dim, num_classes)

    def forward(self, tokens: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.encoder(tokens, key_padding_mask)
        if self.pooling == "first":
            pooled = h[:, 0]
        elif key_padding_mask is None:
            pooled = h.mean(1)
        else:
            keep = real_tokens(key_padding_mask, *h.shape[:2], h.device).unsqueeze(-1).to(h.dtype)
            pooled = (h * keep).sum(1) / keep.sum(1).clamp(min=1.0)
        return self.head(pooled)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The task loss L3 (cross-entropy)."""
        return F.cross_entropy(logits, labels)


class TokenClassifier(nn.Module):
    """Encoder + a linear head at every position -> logits (B, N, num_classes): the recall tasks' model
    (:mod:`clusterformer.data.recall`). ``causal=True`` runs the encoder causally (the language-model form: the
    label at position t may use tokens 0..t only); ``causal=False`` is the bidirectional form."""

    def __init__(self, config: EncoderConfig, num_classes: int, causal: bool = False) -> None:
        super().__init__()
        check_int("num_classes", num_classes, minimum=2)
        self.causal = check_bool("causal", causal)
        self.encoder = Encoder(config)
        self.head = nn.Linear(config.dim, num_classes)

    def forward(self, tokens: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.encoder(tokens, key_padding_mask, causal=self.causal))


class MaskedLanguageModel(nn.Module):
    """Bidirectional encoder + masked-token head (+ a next-sentence head on the first, [CLS], position) ->
    (token logits (B, N, vocab), next-sentence logits (B, 2) or None): BERT's pretraining model
    (:mod:`clusterformer.train.mlm`). The token head is a transform (linear, GELU, LayerNorm, as BERT's) and an
    output layer tied to the input embedding, plus a bias. ``encoder`` is what fine-tuning (``train --init PATH``)
    takes into a downstream model.

    ``positions`` (B, N) bool: the token logits at those positions alone, (M, vocab) in row-major order -- the
    masked positions the loss reads (15% of the tokens), so that the head's (N, vocab) product, softmax and their
    gradients run on M rows instead of B N (Megatron's and NVIDIA's BERT gather the masked positions the same way;
    with a vocabulary of 8,000 and dim 64 the head is most of a training step's time at 2,048 tokens on a CPU)."""

    def __init__(self, config: EncoderConfig, nsp: bool = False) -> None:
        super().__init__()
        self.encoder = Encoder(config)
        self.transform = nn.Sequential(nn.Linear(config.dim, config.dim), nn.GELU(), nn.LayerNorm(config.dim))
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.nsp = nn.Linear(config.dim, 2) if check_bool("nsp", nsp) else None

    def forward(self, tokens: torch.Tensor, key_padding_mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = self.encoder(tokens, key_padding_mask)
        if positions is not None:
            if positions.dtype != torch.bool or positions.shape != tokens.shape:
                raise ValueError(f"positions must be a bool tensor shaped like tokens {tuple(tokens.shape)}; got "
                                 f"{positions.dtype} {tuple(positions.shape)}")
            rows = h[positions]  # (M, dim)
        else:
            rows = h
        # tied to the embedding, scaled by dim^-1/2 (as T5 scales its tied output): the embedding is initialised
        # N(0, 1), so unscaled logits would start with a standard deviation of sqrt(dim)
        logits = F.linear(self.transform(rows) * self.transform[0].in_features ** -0.5, self.encoder.embed.weight,
                          self.bias)
        return logits, None if self.nsp is None else self.nsp(h[:, 0])
