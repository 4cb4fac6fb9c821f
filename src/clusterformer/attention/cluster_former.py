"""``"sliding-window"`` and ``"cluster-former"``: the two layers of Cluster-Former (Wang et al. 2021,
``cluster-former-kmeans-long-range.md`` section 3). :func:`clusterformer.models.cluster_former_config`
stacks them as in the paper (sliding-window layers, Cluster-Former layers at chosen depths).

``"sliding-window"`` (section 3.1): windows of ``window`` tokens every ``stride`` tokens (stride < window, so
neighbouring windows overlap); full attention inside each window; outputs of tokens in several windows
averaged (:func:`clusterformer.ops.sliding_window_attention`). Cost O(N window^2 / stride). Masks: key
padding; ``causal=True`` is strict (windows are fixed, later keys masked).

``"cluster-former"`` (section 3.2, Algorithm 1), for x (B, N, dim):

1. Memory bank: a FIFO buffer of the last ``memory_size`` input hidden states (real tokens only, detached).
   Every training forward appends its inputs (in a distributed run, every rank's, in rank order:
   :mod:`clusterformer.distributed`, so the bank and the centroids are the same on every rank); every
   ``update_every`` training forwards (and on the first) the centroids are recomputed from the bank:
   spherical K-means with ``kmeans_iterations`` Lloyd steps, then ``GetCentroids``' greedy nearest-neighbour
   chain by cosine, so neighbouring ids are similar
   (:mod:`clusterformer.clustering.kmeans`). :meth:`ClusterFormerAttention.update_centroids` does it on
   demand. Centroids, bank and counters are buffers, saved in ``state_dict``.
2. Each token goes to the centroid of maximum cosine similarity; tokens are stably sorted by id.
3. The sorted sequence is cut into windows of ``window`` every ``stride`` (the same sliding windows as
   above); attention inside each; results mapped back to token order, overlaps averaged.
4. Output projection.

Cost: O(N k dim) assignment + O(N window^2 / stride) attention; K-means on the bank every update_every steps.

Masks: key padding (padded tokens sort last and are never keys). ``causal=True`` masks keys at later
original positions inside each window, as the paper does for language modelling; it is **not strict**:
window boundaries on the sorted sequence move with the cluster sizes of the whole sequence, so which past
keys a token sees can depend on later tokens (no future value is attended directly).

Before the first centroid update (a layer built and put in ``eval()`` without training), the centroids are
random directions drawn from a generator seeded by ``seed`` (not stored): deterministic and independent of
the batch, but not clusters of anything. Train, or call ``update_centroids``, for the paper's behaviour.

Batch invariance: centroids are layer state, a token's id depends on the token alone, padding sorts after
every real token and the sorted windows are those of the sequence's own length, so a sequence's outputs on
its real tokens do not depend on the amount of padding or on the other sequences of its batch (in training
the memory bank, and so the next centroids, do depend on the batches seen).

Randomness: K-means initialisation from the layer's generator (``seed``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .._checks import check_bool, check_float, check_int, check_tensor
from ..clustering.kmeans import greedy_nearest_order, spherical_kmeans
from ..distributed import all_gather_rows
from ..ops.sliding import sliding_window_attention
from .base import AttentionLayer
from .registry import register


def _check_window(window: int, stride: int) -> None:
    check_int("window", window, minimum=1)
    check_int("stride", stride, minimum=1)
    if stride > window:
        raise ValueError(f"stride must be <= window (windows must cover the sequence), got {stride} > {window}")


@dataclass(frozen=True)
class SlidingWindowOptions:
    """Options of ``"sliding-window"``.

    Attributes:
        window: tokens per window (the paper's l; 256 in its experiments).
        stride: tokens between window starts (the paper's m < l; 224 for QA, 128 for LM).
        dropout: attention-weight dropout probability during training.
        bias: bias in the projections.
    """

    window: int = 128
    stride: int = 64
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        _check_window(self.window, self.stride)
        check_float("dropout", self.dropout, minimum=0.0, maximum=1.0, exclusive_maximum=True)
        check_bool("bias", self.bias)


@dataclass(frozen=True)
class ClusterFormerOptions:
    """Options of ``"cluster-former"``.

    Attributes:
        num_clusters: k-means centroids (the paper uses 64-512).
        window, stride: sliding windows over the sorted sequence.
        memory_size: hidden states kept in the memory bank (the paper keeps 100K).
        update_every: training forwards between centroid refreshes.
        kmeans_iterations: Lloyd iterations per refresh.
        seed: seeds the K-means initialisation.
        dropout: attention-weight dropout probability during training.
        bias: bias in the projections.
    """

    num_clusters: int = 32
    window: int = 128
    stride: int = 64
    memory_size: int = 8192
    update_every: int = 100
    kmeans_iterations: int = 10
    seed: int = 0
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        check_int("num_clusters", self.num_clusters, minimum=1)
        _check_window(self.window, self.stride)
        check_int("memory_size", self.memory_size, minimum=1)
        check_int("update_every", self.update_every, minimum=1)
        check_int("kmeans_iterations", self.kmeans_iterations, minimum=0)
        check_int("seed", self.seed, minimum=0)
        check_float("dropout", self.dropout, minimum=0.0, maximum=1.0, exclusive_maximum=True)
        check_bool("bias", self.bias)

    def causal_semantics(self) -> str:
        """See :func:`clusterformer.attention.registry.causal_semantics`."""
        return "paper"  # masking inside sorted windows whose membership depends on all tokens


@register("sliding-window", SlidingWindowOptions, "Cluster-Former's local layer: overlapping windows, averaged")
class SlidingWindowAttention(AttentionLayer):
    def __init__(self, dim: int, heads: int, options: SlidingWindowOptions | None = None) -> None:
        options = options or SlidingWindowOptions()
        super().__init__(dim, heads, bias=options.bias)
        self.options = options

    def _attend(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        q, k, v = self.project_qkv(x)
        if q.shape[2] == 0:
            return self.project_out(q * 0)
        out = sliding_window_attention(
            q, k, v, self.options.window, self.options.stride, causal=causal, key_padding_mask=key_padding_mask,
            dropout_p=self.options.dropout if self.training else 0.0,
        )
        return self.project_out(out)


@register("cluster-former", ClusterFormerOptions, "Cluster-Former: k-means on a memory bank, sorted sliding windows")
class ClusterFormerAttention(AttentionLayer):
    def __init__(self, dim: int, heads: int, options: ClusterFormerOptions | None = None) -> None:
        options = options or ClusterFormerOptions()
        super().__init__(dim, heads, bias=options.bias, seed=options.seed)
        self.options = options
        self.register_buffer("centroids", torch.zeros(options.num_clusters, dim))
        self.register_buffer("memory", torch.zeros(options.memory_size, dim))
        self.register_buffer("memory_filled", torch.zeros((), dtype=torch.long))
        self.register_buffer("memory_next", torch.zeros((), dtype=torch.long))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("centroids_ready", torch.zeros((), dtype=torch.bool))
        self.last_clusters: torch.Tensor | None = None  # (B, N)

    @torch.no_grad()
    def remember(self, states: torch.Tensor) -> None:
        """Append hidden states (n, dim) to the FIFO memory bank (the oldest fall out)."""
        check_tensor("states", states, ndim=2, floating=True)
        size = self.options.memory_size
        states = states[-size:].to(self.memory.dtype)
        n = states.shape[0]
        if n == 0:
            return
        slots = (self.memory_next + torch.arange(n, device=self.memory.device)) % size
        self.memory.index_copy_(0, slots, states)
        self.memory_next.copy_((self.memory_next + n) % size)
        self.memory_filled.copy_(torch.clamp(self.memory_filled + n, max=size))

    @torch.no_grad()
    def update_centroids(self, states: torch.Tensor | None = None) -> None:
        """Recompute the centroids by K-means on the memory bank (or on ``states`` (n, dim) if given), then
        order them with the greedy nearest-neighbour chain."""
        if states is None:
            filled = int(self.memory_filled)
            if filled == 0:
                raise ValueError("the memory bank is empty: run a training forward or pass states=")
            states = self.memory[:filled]
        centroids = self._kmeans(states, self.generator)
        self.centroids.copy_(centroids.to(self.centroids.dtype))
        self.centroids_ready.fill_(True)

    def _kmeans(self, states: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        found = spherical_kmeans(states, self.options.num_clusters, iterations=self.options.kmeans_iterations,
                                 generator=generator)
        return greedy_nearest_order(found)

    def _attend(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        B, N, _ = x.shape
        real = None if key_padding_mask is None else ~key_padding_mask
        if self.updates_state():  # every rank's real tokens, in rank order (a no-op without a process group)
            self.remember(all_gather_rows(x.detach().reshape(-1, self.dim) if real is None else x.detach()[real]))
            self.steps += 1
            due = not bool(self.centroids_ready) or int(self.steps) % self.options.update_every == 0
            if due and int(self.memory_filled) > 0:
                self.update_centroids()
        if bool(self.centroids_ready):
            centroids = self.centroids
        else:  # never updated (an untrained layer in eval): seeded random directions, not stored (module docs)
            draw = torch.Generator().manual_seed(self.options.seed)
            centroids = torch.randn(self.options.num_clusters, self.dim, generator=draw, dtype=torch.float64)
        q, k, v = self.project_qkv(x)
        if N == 0:
            return self.project_out(q * 0)
        sims = F.normalize(x.detach(), dim=-1) @ F.normalize(centroids.to(x.dtype), dim=-1).T
        ids = sims.argmax(-1)  # (B, N): maximum cosine similarity
        if key_padding_mask is not None:
            ids = ids.masked_fill(key_padding_mask, self.options.num_clusters)  # padding sorts last
        self.last_clusters = ids
        order = torch.sort(ids, dim=-1, stable=True).indices  # (B, N) sorted slot -> token
        gather = order[:, None, :, None].expand(B, self.heads, N, self.head_dim)
        pad = None if key_padding_mask is None else key_padding_mask.gather(1, order)
        out_sorted = sliding_window_attention(
            q.gather(2, gather), k.gather(2, gather), v.gather(2, gather), self.options.window,
            self.options.stride, causal=causal, positions=order, key_padding_mask=pad,
            dropout_p=self.options.dropout if self.training else 0.0,
        )
        out = torch.empty_like(out_sorted).scatter_(2, gather, out_sorted)  # back to token order
        return self.project_out(out)
