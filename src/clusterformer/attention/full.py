"""``"full"``: ordinary softmax attention over all N keys via ``F.scaled_dot_product_attention``.

The baseline every mechanism is compared with. Cost O(N^2 d) time; the fused SDPA kernels keep memory
O(N d) where the backend has one (CPU flash kernel for 4-D inputs, CUDA flash/efficient kernels).
Masks: key padding and causal, alone or together (:meth:`clusterformer.masks.AttentionMask.allowed`).

Cached decoding: a :class:`~clusterformer.ops.decode.KVCache` of every key and value so far; a step costs
O(t D) per head at position t, and the cache O(t D) memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..masks import NO_MASK, AttentionMask, masked_sdpa
from ..ops.decode import KVCache
from .base import AttentionOptions, InnerAttention
from .registry import register


@dataclass(frozen=True)
class FullOptions(AttentionOptions):
    """Options of ``"full"``: only the common ones (``dropout``, ``bias``)."""


@register("full", FullOptions, "softmax attention over every key (SDPA); O(N^2)")
class FullAttention(InnerAttention):
    decodes = True
    interface_mode = "dense"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask = NO_MASK
                ) -> torch.Tensor:
        if mask.padding is None and mask.window is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout_p, is_causal=mask.causal)
        # rows with no allowed key (an all-padding sequence, left padding under a causal mask) give zeros
        allowed = mask.allowed(q.shape[2], k.shape[2], q.device)
        return masked_sdpa(q, k, v, allowed, dropout_p=self.dropout_p)

    def cache_from(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> KVCache:
        return KVCache.from_prompt(k, v, mask)

    def step(self, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, cache: KVCache
             ) -> tuple[torch.Tensor, KVCache]:
        cache.append(k_t, v_t)
        return cache.attend(q_t), cache
