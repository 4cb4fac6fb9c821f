"""``"lsh"``: Reformer LSH attention (Kitaev et al. 2020), the papers' hashing baseline.

For x (B, N, dim):

1. Shared QK and values: qk = x W^QK, v = x W^V (B, H, N, D); keys are qk / ||qk||.
2. ``n_hashes`` rounds of angular LSH, h(x) = argmax([xR; -xR]) with a fresh Gaussian R (D x n_buckets/2)
   per head and round, drawn from the layer's seeded generator (:mod:`clusterformer.clustering.hashing`).
   With ``n_buckets="auto"`` each sequence's bucket count follows its own real length, and its R is the
   first n_b/2 columns of one draw (:meth:`LSHAttention.rotations`), the same as if it were alone.
3. Per round: sort by bucket (ties by position), chunks of ``bucket_size``, each chunk attends to itself
   and ``look_back`` previous chunks; a token attends to itself only when it has no other target; rounds
   merged with log-sum-exp weights (:func:`clusterformer.ops.bucketed_attention`).
4. Output projection.

Cost: O(n_hashes N (look_back + 1) bucket_size D) for attention plus O(n_hashes N D n_buckets) for hashing.
Any length: the last chunk may be short (empty slots are masked, never asserted away).

Masks: key padding; ``causal=True`` is strict -- hashes depend on each token alone and each bucket is
chunked by rank among earlier tokens, so output t depends on tokens 0..t only; the bucket count is then fixed
(``causal_buckets``, not derived from the length), so a prefix alone gives the same outputs as inside a
longer sequence.

Randomness: in training each forward draws new rotations from the layer's generator (seeded by ``seed``);
in evaluation the rotations are re-drawn from ``seed`` each call, so the same input gives the same output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .._checks import check_bool, check_float, check_int
from ..clustering.hashing import angular_lsh_buckets
from ..ops.bucketed import bucketed_attention
from ..ops.masks import real_lengths
from .base import AttentionLayer
from .registry import register


@dataclass(frozen=True)
class LSHOptions:
    """Options of ``"lsh"``.

    Attributes:
        bucket_size: tokens per chunk after sorting by bucket.
        n_hashes: hashing rounds.
        n_buckets: buckets per round, an even int >= 2, or "auto" for ceil(L / bucket_size) rounded up to
            an even number (at least 2), L being each sequence's real length.
        causal_buckets: with ``n_buckets="auto"`` and ``causal=True``: the bucket count, fixed (an even int
            >= 2) so that a prefix is hashed the same whatever follows it (prefix invariance, what cached
            generation needs). An int ``n_buckets`` is used as is.
        look_back: previous chunks each chunk attends to (Reformer: 1).
        seed: seeds the generator of the random rotations.
        dropout: attention-weight dropout probability during training.
        bias: bias in the projections.
    """

    bucket_size: int = 64
    n_hashes: int = 4
    n_buckets: int | str = "auto"
    causal_buckets: int = 16
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
        check_int("causal_buckets", self.causal_buckets, minimum=2)
        if self.causal_buckets % 2:
            raise ValueError(f"causal_buckets must be even (hashes are argmax over [xR; -xR]), "
                             f"got {self.causal_buckets}")
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

    def buckets_for(self, length: int | torch.Tensor) -> int | torch.Tensor:
        """Buckets per round for a sequence of ``length`` real tokens (an int, or a tensor of lengths)."""
        if self.options.n_buckets == "auto":
            size = 2 * self.options.bucket_size
            if isinstance(length, torch.Tensor):
                return ((length + size - 1) // size * 2).clamp(min=2)
            return max(2, 2 * math.ceil(length / size))
        if isinstance(length, torch.Tensor):
            return torch.full_like(length, self.options.n_buckets)
        return self.options.n_buckets

    def rotations(self, half: int, head_dim: int) -> torch.Tensor:
        """The random rotations of this forward, (heads, n_hashes, head_dim, half) float64.

        Column j of every rotation is the same whatever ``half`` is (the draw is a prefix of one stream,
        laid out column by column), so a sequence hashed with its own n_b / 2 columns gets the rotations it
        would get alone. The stream is seeded by one number drawn from the layer's generator (advancing in
        training, re-seeded by ``seed`` in evaluation); numpy's normal sampler fills arrays in order,
        torch's CPU one does not."""
        stream_seed = int(torch.randint(0, 2**62, (1,), generator=self.draw_generator()))
        draw = np.random.default_rng(stream_seed).standard_normal((half, self.heads, self.options.n_hashes, head_dim))
        return torch.from_numpy(draw).permute(1, 2, 3, 0)

    def _attend(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        qk, _, v = self.project_qkv(x)
        B, _, N, D = qk.shape
        # n_buckets follows each sequence's real length, not the padded length of the batch
        lengths = real_lengths(key_padding_mask, B, N, x.device)
        per_sequence = self.buckets_for(lengths)
        if causal and self.options.n_buckets == "auto":  # fixed: a prefix hashes the same whatever follows
            per_sequence = torch.full_like(lengths, self.options.causal_buckets)
        n_buckets = int(per_sequence.max()) if B else 2
        rotations = self.rotations(n_buckets // 2, D).to(device=x.device, dtype=qk.dtype)
        buckets = angular_lsh_buckets(qk.detach(), rotations, num_buckets=per_sequence)
        self.last_buckets = buckets
        out = bucketed_attention(
            qk, v, buckets, min(self.options.bucket_size, max(N, 1)), num_buckets=n_buckets,
            look_back=self.options.look_back, causal=causal, key_padding_mask=key_padding_mask,
            dropout_p=self.options.dropout if self.training else 0.0,
        )
        return self.project_out(out)
