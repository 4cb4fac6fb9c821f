"""A causal language model over any registered attention that supports ``causal=True``."""

from __future__ import annotations

import torch
from torch import nn

from .encoder import Encoder, EncoderConfig

__all__ = ["LanguageModel"]


class LanguageModel(nn.Module):
    """Encoder run with ``causal=True`` + a linear head: tokens (B, N) -> next-token logits (B, N, vocab)."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.encoder = Encoder(config)
        self.head = nn.Linear(config.dim, config.vocab_size)

    def forward(self, tokens: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.encoder(tokens, key_padding_mask, causal=True))
