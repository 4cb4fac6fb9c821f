"""``"sliding-window"`` and ``"cluster-former"``: the two layers of Cluster-Former (Wang et al. 2021,
``cluster-former-kmeans-long-range.md`` section 3). :func:`clusterformer.models.cluster_former_config`
stacks them as in the paper (sliding-window layers, Cluster-Former layers at chosen depths).

``"sliding-window"`` (section 3.1): windows of ``window`` tokens every ``stride`` tokens (stride < window, so
neighbouring windows overlap); full attention inside each window; outputs of tokens in several windows
averaged (:func:`clusterformer.ops.sliding_window_attention`). Cost O(N window^2 / stride). Masks: key
padding; ``causal=True`` is strict (windows are fixed, later keys masked). Cached decoding (``layer.prefill`` /
``layer.step``): the last ``window`` keys and values; a step costs O(window^2 / stride D) per head.

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
4. The layer's output projection. Groups published: the cluster ids, (B, N) (padding: ``num_clusters``).

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
from typing import Any

import torch
import torch.nn.functional as F

from .._checks import check_int, check_tensor
from ..clustering.kmeans import greedy_nearest_order, spherical_kmeans
from ..distributed import all_gather_rows
from ..masks import NO_MASK, AttentionMask
from ..ops.decode import WindowCache
from ..ops.sliding import sliding_window_attention, window_count
from .aux import publish_groups
from .base import AttentionOptions, InnerAttention, QKVProjection, SeededOptions
from .registry import register


def window_union(window: int, stride: int, length: int, causal: bool = False) -> int:
    """The most keys a row sees under windows of ``window`` every ``stride`` rows over ``length`` rows
    (:func:`clusterformer.ops.sliding_window_attention`'s windows, ``window`` clamped to ``length``), the maximum
    over the rows of the union of the windows that hold it: ``window + stride * (ceil(window / stride) - 1)`` (192
    for 128 / 64) where a row lies in that many whole windows, fewer near the ends. ``causal``: the union's keys up
    to the row itself -- from the first window holding it, so at most ``window`` (42 for 42 / 21, not 63)."""
    check_int("length", length, minimum=1)
    w = min(window, length)
    rows = torch.arange(length)
    first = (rows - w + 1).clamp(min=0).add(stride - 1).div(stride, rounding_mode="floor")  # first window holding r
    if causal:
        return int((rows - first * stride + 1).max())
    last = torch.minimum(rows.div(stride, rounding_mode="floor"),
                         torch.tensor(int(window_count(length, w, stride)) - 1))  # the last window holding r
    return int(((last * stride + w).clamp(max=length) - first * stride).max())


def window_for_budget(keys: int, causal: bool = False) -> dict[str, int]:
    """The window (even) and stride (half of it) whose union of windows, 1.5 windows, is at most ``keys``; under
    ``causal`` (sliding-window's strict mask: a query reads at most one window) the window of ``keys`` (even)."""
    check_int("keys", keys, minimum=3)
    window = keys // 2 * 2 if causal else 2 * keys // 3 // 2 * 2
    return {"window": window, "stride": window // 2}


def _check_window(window: int, stride: int) -> None:
    check_int("window", window, minimum=1)
    check_int("stride", stride, minimum=1)
    if stride > window:
        raise ValueError(f"stride must be <= window (windows must cover the sequence), got {stride} > {window}")


@dataclass(frozen=True)
class SlidingWindowOptions(AttentionOptions):
    """Options of ``"sliding-window"`` (besides ``dropout``, ``bias``).

    Attributes:
        window: tokens per window (the paper's l; 256 in its experiments).
        stride: tokens between window starts (the paper's m < l; 224 for QA, 128 for LM).
    """

    window: int = 128
    stride: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_window(self.window, self.stride)

    def keys_read(self, length: int, causal: bool = False) -> int:
        """The union of the windows that hold a query (:func:`window_union`), under ``causal`` its keys up to the
        query; each mixed as read."""
        return window_union(self.window, self.stride, length, causal)

    def for_budget(self, keys: int, length: int, causal: bool = False) -> dict[str, Any]:
        return window_for_budget(keys, causal)


@dataclass(frozen=True)
class ClusterFormerOptions(SeededOptions):
    """Options of ``"cluster-former"`` (besides ``dropout``, ``bias``, ``seed``; ``seed`` seeds the K-means).

    Attributes:
        num_clusters: k-means centroids (the paper uses 64-512).
        window, stride: sliding windows over the sorted sequence.
        memory_size: hidden states kept in the memory bank (the paper keeps 100K).
        update_every: training forwards between centroid refreshes.
        kmeans_iterations: Lloyd iterations per refresh.
    """

    num_clusters: int = 32
    window: int = 128
    stride: int = 64
    memory_size: int = 8192
    update_every: int = 100
    kmeans_iterations: int = 10

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("num_clusters", self.num_clusters, minimum=1)
        _check_window(self.window, self.stride)
        check_int("memory_size", self.memory_size, minimum=1)
        check_int("update_every", self.update_every, minimum=1)
        check_int("kmeans_iterations", self.kmeans_iterations, minimum=0)

    def causal_semantics(self) -> str:
        return "paper"  # masking inside sorted windows whose membership depends on all tokens

    def keys_read(self, length: int, causal: bool = False) -> int:
        """The union of the sorted windows that hold a query (:func:`window_union`), each mixed as read. Under
        ``causal`` the same: the windows mask later *original* positions, and a query later than every other key of
        its windows sees them all."""
        return window_union(self.window, self.stride, length)

    def for_budget(self, keys: int, length: int, causal: bool = False) -> dict[str, Any]:
        return window_for_budget(keys)


@register("sliding-window", SlidingWindowOptions, "Cluster-Former's local layer: overlapping windows, averaged")
class SlidingWindowAttention(InnerAttention):
    decodes = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask = NO_MASK
                ) -> torch.Tensor:
        if q.shape[2] == 0:
            return q * 0
        return sliding_window_attention(q, k, v, self.options.window, self.options.stride, mask=mask,
                                        dropout_p=self.dropout_p)

    # cached decoding: the last `window` keys and values (clusterformer.ops.decode.WindowCache)
    def cache_from(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> WindowCache:
        return WindowCache.from_prompt(k, v, mask, self.options.window, self.options.stride)

    def step(self, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, cache: WindowCache
             ) -> tuple[torch.Tensor, WindowCache]:
        return cache.append_and_attend(q_t, k_t, v_t), cache


@register("cluster-former", ClusterFormerOptions, "Cluster-Former: k-means on a memory bank, sorted sliding windows")
class ClusterFormerAttention(InnerAttention):
    """Assigns tokens by their hidden states, so it implements :meth:`attend_hidden`; :meth:`forward` on given
    q, k, v is not available (it would need the hidden states)."""

    hidden_states = "cluster-former assigns tokens by their hidden states"
    stack_layers = "sliding-window"  # the paper's stack: sliding-window layers, a few Cluster-Former ones

    def __init__(self, dim: int, heads: int, options: ClusterFormerOptions) -> None:
        super().__init__(dim, heads, options)
        self.register_buffer("centroids", torch.zeros(options.num_clusters, dim))
        self.register_buffer("memory", torch.zeros(options.memory_size, dim))
        self.register_buffer("memory_filled", torch.zeros((), dtype=torch.long))
        self.register_buffer("memory_next", torch.zeros((), dtype=torch.long))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("centroids_ready", torch.zeros((), dtype=torch.bool))

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
        found = spherical_kmeans(states, self.options.num_clusters, iterations=self.options.kmeans_iterations,
                                 generator=self.generator)
        self.centroids.copy_(greedy_nearest_order(found).to(self.centroids.dtype))
        self.centroids_ready.fill_(True)

    def attend_hidden(
        self, x: torch.Tensor, projection: QKVProjection, mask: AttentionMask = NO_MASK,
        flow: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, None]:
        if flow is not None:
            raise ValueError("cluster-former takes no flow from a previous layer")
        B, N, _ = x.shape
        if self.updates_state():  # every rank's real tokens, in rank order (a no-op without a process group)
            states = x.detach()[mask.real(B, N, x.device)]
            self.remember(all_gather_rows(states))
            self.steps += 1
            due = not bool(self.centroids_ready) or int(self.steps) % self.options.update_every == 0
            if due and int(self.memory_filled) > 0:
                self.update_centroids()
        if bool(self.centroids_ready):
            centroids = self.centroids
        else:  # never updated (an untrained layer in eval): seeded random directions, not stored (module docs)
            draw = torch.Generator().manual_seed(self.options.seed)
            centroids = torch.randn(self.options.num_clusters, self.dim, generator=draw, dtype=torch.float64)
        q, k, v = projection.qkv(x)
        if N == 0:
            return (q * 0).transpose(1, 2), None
        sims = F.normalize(x.detach(), dim=-1) @ F.normalize(centroids.to(x), dim=-1).T
        ids = sims.argmax(-1)  # (B, N): maximum cosine similarity
        if mask.padding is not None:
            ids = ids.masked_fill(mask.padding, self.options.num_clusters)  # padding sorts last
        publish_groups(self, ids)
        order = torch.sort(ids, dim=-1, stable=True).indices  # (B, N) sorted slot -> token
        gather = order[:, None, :, None].expand(B, self.heads, N, self.head_dim)
        # the windows run over the sorted rows; the mask, of the original order, is read at each row's token
        out_sorted = sliding_window_attention(
            q.gather(2, gather), k.gather(2, gather), v.gather(2, gather), self.options.window,
            self.options.stride, positions=order, mask=mask, dropout_p=self.dropout_p,
        )
        out = torch.empty_like(out_sorted).scatter_(2, gather, out_sorted)  # back to token order
        return out.transpose(1, 2), None
