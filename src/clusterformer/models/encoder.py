"""A pre-norm Transformer encoder over any registered attention, and a sequence classifier on top.

Read top to bottom: config dataclass -> positional encodings -> block -> encoder -> classifier.
Auxiliary losses of the attention layers are read after a forward with
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
from ..attention import AttentionLayer, NeuralClusteringAttention, build
from ..attention.registry import make_options

__all__ = ["Encoder", "EncoderConfig", "SequenceClassifier"]


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
        if self.centroid_flow and self.attention != "neural-clustering":
            raise ValueError(f"centroid_flow needs attention='neural-clustering', got {self.attention!r}")
        if self.centroid_flow and "own_centroids" in self.attention_options:
            raise ValueError("centroid_flow sets own_centroids per layer; do not pass it in attention_options")


def sinusoidal_positions(length: int, dim: int, device: torch.device | None = None) -> torch.Tensor:
    """(length, dim) sine/cosine position encodings of Vaswani et al."""
    position = torch.arange(length, device=device, dtype=torch.float32).unsqueeze(1)
    freq = torch.exp(torch.arange(0, dim, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim, device=device)
    table[:, 0::2] = torch.sin(position * freq)
    table[:, 1::2] = torch.cos(position * freq[: dim // 2])
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

    def forward(self, x, key_padding_mask=None, causal=False, centroids=None):
        h = self.norm_attn(x)
        if centroids is not None:
            h = self.attn(h, key_padding_mask, causal, centroids=centroids)
        else:
            h = self.attn(h, key_padding_mask, causal)
        x = x + self.drop(h)
        return x + self.drop(self.ff(self.norm_ff(x)))


class Encoder(nn.Module):
    """Token embeddings + positions + ``depth`` pre-norm blocks + final LayerNorm.

    ``forward(tokens (B, N) long, key_padding_mask (B, N) bool | None, causal=False) -> (B, N, dim)``.
    """

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim, padding_idx=0)
        self.positions = nn.Embedding(config.max_len, config.dim) if config.positional == "learned" else None
        self.drop = nn.Dropout(config.dropout)
        blocks = []
        for layer in range(config.depth):
            options = dict(config.attention_options)
            if config.centroid_flow:
                options["own_centroids"] = layer == 0
            attention = build(config.attention, dim=config.dim, heads=config.heads, **options)
            blocks.append(Block(config, attention))
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(config.dim)

    def forward(
        self, tokens: torch.Tensor, key_padding_mask: torch.Tensor | None = None, causal: bool = False
    ) -> torch.Tensor:
        check_tensor("tokens", tokens, ndim=2)
        if tokens.is_floating_point() or tokens.dtype == torch.bool:
            raise ValueError(f"tokens must be an integer tensor, got dtype {tokens.dtype}")
        B, N = tokens.shape
        key_padding_mask = check_padding_mask(key_padding_mask, B, N, device=tokens.device)
        if self.config.max_len < N and self.config.positional == "learned":
            raise ValueError(f"tokens has length {N} > max_len={self.config.max_len} of the learned positions")
        x = self.embed(tokens)
        if self.config.positional == "sinusoidal":
            x = x + sinusoidal_positions(N, self.config.dim, tokens.device).to(x.dtype)
        elif self.positions is not None:
            x = x + self.positions(torch.arange(N, device=tokens.device))
        x = self.drop(x)
        centroids = None
        for block in self.blocks:
            x = block(x, key_padding_mask, causal, centroids)
            if self.config.centroid_flow and isinstance(block.attn, NeuralClusteringAttention):
                centroids = block.attn.updated_centroids  # the paper: next layer starts from C_hat
        return self.norm(x)


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
            keep = (~key_padding_mask).unsqueeze(-1).to(h.dtype)
            pooled = (h * keep).sum(1) / keep.sum(1).clamp(min=1.0)
        return self.head(pooled)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The task loss L3 (cross-entropy)."""
        return F.cross_entropy(logits, labels)
