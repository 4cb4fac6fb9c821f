"""Sentence embeddings of a pretrained encoder, as sentence-transformers computes them for all-MiniLM-L6-v2."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["embed", "mean_pool"]


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, N, d) hidden states, (B, N) mask (1 = token) -> (B, d) mean over real tokens."""
    keep = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * keep).sum(1) / keep.sum(1).clamp(min=1.0)


@torch.no_grad()
def embed(model: nn.Module, tokenizer: Any, texts: Sequence[str], *, batch_size: int = 64,
          max_length: int = 128, normalize: bool = True, progress: bool = False) -> torch.Tensor:
    """Sentence embeddings (len(texts), d): mean pooling over real tokens (then L2-normalised), as
    sentence-transformers computes them for all-MiniLM-L6-v2. Texts are batched by length (less padding) and
    returned in the given order."""
    if batch_size < 1 or max_length < 1:
        raise ValueError(f"batch_size and max_length must be >= 1; got {batch_size}, {max_length}")
    device = next(model.parameters()).device
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out: list[torch.Tensor] = [torch.empty(0)] * len(texts)
    batches = range(0, len(order), batch_size)
    if progress:
        from tqdm import tqdm

        batches = tqdm(batches, desc="embed", unit="batch", leave=False)
    for start in batches:
        idx = order[start:start + batch_size]
        enc = tokenizer([texts[i] for i in idx], padding=True, truncation=True, max_length=max_length,
                        return_tensors="pt").to(device)
        pooled = mean_pool(model(**enc).last_hidden_state, enc["attention_mask"]).float()
        if normalize:
            pooled = F.normalize(pooled, dim=-1)
        for row, i in zip(pooled.cpu(), idx, strict=True):
            out[i] = row
    return torch.stack(out) if out else torch.empty(0, 0)
