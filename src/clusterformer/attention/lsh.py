"""``"lsh"``: Reformer LSH attention (Kitaev et al. 2020), the papers' hashing baseline.

For x (B, N, dim):

1. Shared QK and values: qk = x W^QK, v = x W^V (B, H, N, D); keys are qk / ||qk||.
2. ``num_rounds`` (n_hashes) rounds of angular LSH, h(x) = argmax([xR; -xR]) with a fresh Gaussian R (D x n_buckets/2)
   per head and round, drawn from the layer's seeded generator (:mod:`clusterformer.clustering.hashing`).
   With ``num_clusters="auto"`` each sequence's bucket count follows its own real length, and its R is the
   first n_b/2 columns of one draw (:meth:`LSHAttention.rotations`), the same as if it were alone.
3. Per round: sort by bucket (ties by position), chunks of ``chunk_size`` (bucket size), each chunk attends to itself
   and ``look_back`` previous chunks; a token attends to itself only when it has no other target; rounds
   merged with log-sum-exp weights (:func:`clusterformer.ops.bucketed_attention`).
The layer's output projection follows. Groups published (:func:`clusterformer.attention.record_groups`): the
buckets, (B, H, num_rounds, N).

Cost: O(num_rounds N (look_back + 1) chunk_size D) for attention plus O(num_rounds N D n_buckets) for hashing.
Any length: the last chunk may be short (empty slots are masked, never asserted away).

Masks: key padding; ``causal=True`` is strict -- hashes depend on each token alone and each bucket is
chunked by rank among earlier tokens, in chunks of ``causal_chunk_size`` (16), so output t depends on tokens
0..t only; the bucket count is then fixed (``causal_clusters``, not derived from the length), so a prefix
alone gives the same outputs as inside a longer sequence.

Randomness: in training each forward draws new rotations from the layer's generator (seeded by ``seed``);
in evaluation the rotations are re-drawn from ``seed`` each call, so the same input gives the same output.
With staged draws (:func:`clusterformer.attention.stage_draws`) the rotations come from a device buffer filled
before the step, and without a padding mask the bucket count is known on the host, so the training step can be
captured in a CUDA graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from .._checks import check_int
from ..clustering.hashing import angular_lsh_buckets
from ..masks import NO_MASK, AttentionMask
from ..ops.bucketed import bucketed_attention, bucketed_cache, bucketed_step
from ..ops.decode import GroupRingCache
from .aux import publish_groups
from .base import BucketOptions, InnerAttention
from .registry import register


@dataclass(frozen=True)
class LSHOptions(BucketOptions):
    """Options of ``"lsh"`` (besides ``dropout``, ``bias``, ``seed`` -- which seeds the random rotations --,
    ``chunk_size`` -- alias ``bucket_size`` -- and ``look_back``: :class:`~clusterformer.attention.BucketOptions`).

    Attributes:
        num_rounds: hashing rounds (the Reformer's n_hashes; alias ``n_hashes``).
        num_clusters: buckets per round (the Reformer's n_buckets; alias ``n_buckets``), an even int >= 2, or
            "auto" for ceil(L / chunk_size) rounded up to an even number (at least 2), L being each
            sequence's real length.
        causal_clusters: with ``num_clusters="auto"`` and ``causal=True``: the bucket count, fixed (an even
            int >= 2) so that a prefix is hashed the same whatever follows it (prefix invariance, what cached
            generation needs; alias ``causal_buckets``). An int ``num_clusters`` is used as is.
    """

    ALIASES: ClassVar[dict[str, str]] = {"bucket_size": "chunk_size", "n_hashes": "num_rounds",
                                         "n_buckets": "num_clusters", "causal_buckets": "causal_clusters"}

    budget_rounds: ClassVar[str | None] = "num_rounds"  # a query sees its chunks in every round

    num_rounds: int = 4
    num_clusters: int | str = "auto"
    causal_clusters: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("num_rounds", self.num_rounds, minimum=1)
        if self.num_clusters != "auto":
            if isinstance(self.num_clusters, str):
                raise ValueError(f"num_clusters must be an even int >= 2 or 'auto', got {self.num_clusters!r}")
            check_int("num_clusters", self.num_clusters, minimum=2)
            if self.num_clusters % 2:
                raise ValueError(f"num_clusters must be even (hashes are argmax over [xR; -xR]), "
                                 f"got {self.num_clusters}")
        check_int("causal_clusters", self.causal_clusters, minimum=2)
        if self.causal_clusters % 2:
            raise ValueError(f"causal_clusters must be even (hashes are argmax over [xR; -xR]), "
                             f"got {self.causal_clusters}")


@register("lsh", LSHOptions, "Reformer: shared QK, angular LSH rounds, sorted bucket chunks; O(rounds N w)")
class LSHAttention(InnerAttention):
    shared_qk = True
    decodes = True

    def buckets_for(self, length: int | torch.Tensor) -> int | torch.Tensor:
        """Buckets per round for a sequence of ``length`` real tokens (an int, or a tensor of lengths)."""
        if self.options.num_clusters == "auto":
            size = 2 * self.options.chunk_size
            if isinstance(length, torch.Tensor):
                return ((length + size - 1) // size * 2).clamp(min=2)
            return max(2, 2 * math.ceil(length / size))
        if isinstance(length, torch.Tensor):
            return torch.full_like(length, self.options.num_clusters)
        return self.options.num_clusters

    def rotations(self, half: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """The random rotations of this forward, (heads, num_rounds, head_dim, half) float64 on the CPU.

        Column j of every rotation is the same whatever ``half`` is (the draw is a prefix of one stream,
        laid out column by column), so a sequence hashed with its own n_b / 2 columns gets the rotations it
        would get alone. The stream is seeded by one number drawn from ``generator`` (default: the layer's,
        advancing in training, re-seeded by ``seed`` in evaluation); numpy's normal sampler fills arrays in
        order, torch's CPU one does not."""
        generator = self.draw_generator() if generator is None else generator
        stream_seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        shape = (half, self.heads, self.options.num_rounds, self.head_dim)
        return torch.from_numpy(np.random.default_rng(stream_seed).standard_normal(shape)).permute(1, 2, 3, 0)

    def _drawn_rotations(self, half: int, like: torch.Tensor) -> torch.Tensor:
        """:meth:`rotations` on ``like``'s device and dtype, through :meth:`draw` (a staged buffer when staged)."""
        return self.draw(f"rotations {half}", lambda generator: self.rotations(half, generator), like.device,
                         like.dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask = NO_MASK
                ) -> torch.Tensor:
        B, _, N, _ = q.shape  # q is k (shared QK): the keys are the normalised queries
        causal = mask.causal
        fixed = causal and self.options.num_clusters == "auto"  # fixed: a prefix hashes the same whatever follows
        if mask.padding is None:
            # every sequence has N real tokens: the bucket count is known on the host, with no read of a device
            # tensor (so the step can be captured in a CUDA graph); the same count the masked path finds
            n_buckets, per_sequence = self.options.causal_clusters if fixed else self.buckets_for(N), None
        else:
            # the bucket count follows each sequence's real length, not the padded length of the batch
            lengths = mask.lengths(B, N, q.device)
            per_sequence = self.buckets_for(lengths)
            if fixed:
                per_sequence = torch.full_like(lengths, self.options.causal_clusters)
            n_buckets = int(per_sequence.max()) if B else 2
        rotations = self._drawn_rotations(n_buckets // 2, q)
        buckets = angular_lsh_buckets(q.detach(), rotations, num_buckets=per_sequence)  # (B, H, rounds, N)
        publish_groups(self, buckets)
        return bucketed_attention(
            q, v, buckets, min(self.options.chunk_for(causal), max(N, 1)), num_buckets=n_buckets,
            look_back=self.options.look_back, mask=mask, dropout_p=self.dropout_p,
        )

    # cached decoding: rings per bucket, head and round (clusterformer.ops.bucketed.bucketed_cache)
    def _causal_buckets(self, qk: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(B, H, N, D) -> bucket ids (B, H, R, N) under causal=True, and the bucket count (fixed)."""
        n = self.options.causal_clusters if self.options.num_clusters == "auto" else self.options.num_clusters
        rotations = self._drawn_rotations(n // 2, qk)
        return angular_lsh_buckets(qk.detach(), rotations), n

    def cache_from(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> GroupRingCache:
        buckets, n = self._causal_buckets(q)
        return bucketed_cache(q, v, buckets, self.options.causal_chunk_size, num_buckets=n,
                              look_back=self.options.look_back, mask=mask)

    def step(self, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, cache: GroupRingCache
             ) -> tuple[torch.Tensor, GroupRingCache]:
        buckets, _ = self._causal_buckets(q_t.unsqueeze(2))
        return bucketed_step(q_t, v_t, buckets[..., 0], cache), cache
