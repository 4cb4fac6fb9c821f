"""``"lsh"``: Reformer LSH attention (Kitaev et al. 2020), the papers' hashing baseline.

For x (B, N, dim):

1. Shared QK and values: qk = x W^QK, v = x W^V (B, H, N, D); keys are qk / ||qk||.
2. ``n_hashes`` rounds of angular LSH, h(x) = argmax([xR; -xR]) with a fresh Gaussian R (D x n_buckets/2)
   per head and round, drawn from the layer's seeded generator (:mod:`clusterformer.clustering.hashing`).
3. Per round: sort by bucket (ties by position), chunks of ``bucket_size``, each chunk attends to itself
   and ``look_back`` previous chunks; a token attends to itself only when it has no other target; rounds
   merged with log-sum-exp weights (:func:`clusterformer.ops.bucketed_attention`).
4. Output projection.

Cost: O(n_hashes N (look_back + 1) bucket_size D) for attention plus O(n_hashes N D n_buckets) for hashing.
Any length: the last chunk may be short (empty slots are masked, never asserted away).

Masks: key padding; ``causal=True`` is strict -- hashes depend on each token alone and each bucket is
chunked by rank among earlier tokens, so output t depends on tokens 0..t only.

Randomness: in training each forward draws new rotations from the layer's generator (seeded by ``seed``);
in evaluation the rotations are re-drawn from ``seed`` each call, so the same input gives the same output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._checks import check_bool, check_float, check_int
from ..clustering.hashing import angular_lsh_buckets
from ..ops.bucketed import bucketed_attention
from .base import AttentionLayer
from .registry import register


@dataclass(frozen=True)
class LSHOptions:
    """Options of ``"lsh"``.

    Attributes:
        bucket_size: tokens per chunk after sorting by bucket.
        n_hashes: hashing rounds.
        n_buckets: buckets per round, an even int >= 2, or "auto" for ceil(N / bucket_size) rounded up to
            an even number (at least 2).
        look_back: previous chunks each chunk attends to (Reformer: 1).
        seed: seeds the generator of the random rotations.
        dropout: attention-weight dropout probability during training.
        bias: bias in the projections.
    """

    bucket_size: int = 64
    n_hashes: int = 4
    n_buckets: int | str = "auto"
    look_back: int = 1
    seed: int = 0
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        check_int("bucket_size", self.bucket_size, minimum=1)
        check_int("n_hashes", self.n_hashes, minimum=1)
        if self.n_buckets != "auto":
            if isinstance(self.n_buckets, str):
                raise ValueError(f"n_buckets must be an even int >= 2 or 'auto', got {self.n_buckets!r}")
            check_int("n_buckets", self.n_buckets, minimum=2)
            if self.n_buckets % 2:
                raise ValueError(f"n_buckets must be even (hashes are argmax over [xR; -xR]), got {self.n_buckets}")
        check_int("look_back", self.look_back, minimum=0)
        check_int("seed", self.seed, minimum=0)
        check_float("dropout", self.dropout, minimum=0.0, maximum=1.0, exclusive_maximum=True)
        check_bool("bias", self.bias)


@register("lsh", LSHOptions, "Reformer: shared QK, angular LSH rounds, sorted bucket chunks; O(n_hashes N w)")
class LSHAttention(AttentionLayer):
    def __init__(self, dim: int, heads: int, options: LSHOptions | None = None) -> None:
        options = options or LSHOptions()
        super().__init__(dim, heads, bias=options.bias, shared_qk=True, seed=options.seed)
        self.options = options
        self.last_buckets: torch.Tensor | None = None  # (B, H, n_hashes, N) of the last forward

    def buckets_for(self, length: int) -> int:
        """Buckets per round for a batch padded to ``length`` tokens."""
        if self.options.n_buckets == "auto":
            return max(2, 2 * math.ceil(length / (2 * self.options.bucket_size)))
        return self.options.n_buckets

    def _attend(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        qk, _, v = self.project_qkv(x)
        _B, H, N, D = qk.shape
        n_buckets = self.buckets_for(N)
        rotations = torch.randn(H, self.options.n_hashes, D, n_buckets // 2, generator=self.draw_generator())
        buckets = angular_lsh_buckets(qk.detach(), rotations.to(x.device))
        self.last_buckets = buckets
        out = bucketed_attention(
            qk, v, buckets, min(self.options.bucket_size, max(N, 1)), num_buckets=n_buckets,
            look_back=self.options.look_back, causal=causal, key_padding_mask=key_padding_mask,
            dropout_p=self.options.dropout if self.training else 0.0,
        )
        return self.project_out(out)
