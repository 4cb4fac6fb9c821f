"""The model ``train --init NAME`` fine-tunes: a pretrained encoder with patched attention and a linear head."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..masks import real_tokens
from .embeddings import mean_pool
from .loading import load_pretrained
from .patching import patch

__all__ = ["PretrainedClassifier"]


class PretrainedClassifier(nn.Module):
    """A pretrained encoder with patched attention + mean pooling + a linear head, for ``train --init NAME``:
    ``forward(tokens (B, N), key_padding_mask (B, N) bool, True = padding)`` -> logits (B, num_classes)."""

    def __init__(self, name: str, num_classes: int, attention: str = "full",
                 options: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.encoder, _ = load_pretrained(name)
        patch(self.encoder, attention, **(options or {}))
        self.head = nn.Linear(self.encoder.config.hidden_size, num_classes)

    def forward(self, tokens: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        mask = real_tokens(key_padding_mask, *tokens.shape, tokens.device).long()  # transformers': 1 = a token
        hidden = self.encoder(input_ids=tokens, attention_mask=mask).last_hidden_state
        return self.head(mean_pool(hidden, mask))
