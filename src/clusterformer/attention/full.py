"""``"full"``: ordinary softmax attention over all N keys via ``F.scaled_dot_product_attention``.

The baseline every mechanism is compared with. Cost O(N^2 d) time; the fused SDPA kernels keep memory
O(N d) where the backend has one (CPU flash kernel for 4-D inputs, CUDA flash/efficient kernels).
Masks: key padding and causal, alone or together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .._checks import check_bool, check_float
from ..ops.masks import masked_sdpa
from .base import AttentionLayer
from .registry import register


@dataclass(frozen=True)
class FullOptions:
    """Options of ``"full"``.

    Attributes:
        dropout: attention-weight dropout probability during training.
        bias: bias in the Q/K/V and output projections.
    """

    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        check_float("dropout", self.dropout, minimum=0.0, maximum=1.0, exclusive_maximum=True)
        check_bool("bias", self.bias)


@register("full", FullOptions, "softmax attention over every key (SDPA); O(N^2)")
class FullAttention(AttentionLayer):
    def __init__(self, dim: int, heads: int, options: FullOptions | None = None) -> None:
        options = options or FullOptions()
        super().__init__(dim, heads, bias=options.bias)
        self.options = options

    def _attend(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        q, k, v = self.project_qkv(x)
        dropout = self.options.dropout if self.training else 0.0
        if key_padding_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=causal)
            return self.project_out(out)
        N = x.shape[1]
        allowed = ~key_padding_mask[:, None, None, :]  # (B, 1, 1, N)
        if causal:
            allowed = allowed & torch.ones(N, N, dtype=torch.bool, device=x.device).tril()
        # rows with no allowed key (an all-padding sequence, left padding under a causal mask) give zeros
        return self.project_out(masked_sdpa(q, k, v, allowed, dropout_p=dropout))
