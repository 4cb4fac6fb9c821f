"""How a pretrained decoder reads its key/value cache: ``"cluster-retrieval"``, ``"sink-window"``, and the two
yardsticks ``"oracle"`` and ``"quest"``.

These mechanisms change only what a query reads from a decoder's cache of earlier keys -- the long-context
decoding of pretrained LLMs (ClusterKV, Squeezed Attention; StreamingLLM; Quest) -- and run through
:mod:`clusterformer.hf`'s ``AttentionInterface`` inside any ``transformers`` decoder. Each query reads at most
``budget`` keys, every key and centroid term counted:

* ``"cluster-retrieval"``: per layer and key/value head the cached keys are grouped by K-means; each query scores
  the centroids and attends exactly to the keys of its best clusters, plus the first ``sink`` tokens and its
  most recent ones (:func:`clusterformer.ops.retrieval.retrieval_attention`, which gives the equations and the
  budget's accounting). ``estimate_remainder`` adds every cluster's unread keys as one term from its centroid.
* ``"sink-window"``: StreamingLLM at the same budget: the first ``sink`` tokens and the most recent ones.
* ``"oracle"``: per query and head, the budget's keys of largest q . k -- the upper bound of any selection
  (:func:`clusterformer.ops.topk_cache.oracle_attention`; it computes every score).
* ``"quest"``: Quest's pages of ``page_size`` keys, ranked by the upper bound of q . k from their per-channel min
  and max (:func:`clusterformer.ops.topk_cache.quest_attention`).

A sequence attending to itself -- a prefill, or training -- is exact softmax attention (:meth:`forward` is
``"full"``'s): these papers leave the prompt's own attention dense and make the *reading of the cache* sparse.
Option ``prefill_block`` (beyond them) makes a prefill through :meth:`attend_cache` sparse too, read in
blocks as cached calls (:class:`CacheBudgetOptions`).
:meth:`CacheReadingAttention.attend_cache` is that reading: the last Lq positions of a cache of n keys, with
cluster retrieval's key index (:class:`clusterformer.ops.retrieval.KeyClusterIndex`) that belongs to that cache,
returned to the caller, which keeps it beside the cache (:mod:`clusterformer.hf` keys it by the ``transformers``
cache object, so it dies with it). None has the native ``layer.prefill`` / ``layer.step`` decoding: a sparse step
is not the forward at that position (it reads fewer keys), which native decoding promises.

Cost of a cached step per query and head: cluster retrieval O(C D) centroid scores and O(budget D) attention, the
index O(iterations n C D) per re-clustering, every ``refresh`` keys; Quest O(n / page_size D) page bounds; the
oracle O(n D), as dense.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from .._checks import check_bool, check_choice, check_int
from ..masks import CAUSAL_MASK, AttentionMask, cache_sdpa
from ..ops.retrieval import (
    JOIN_BATCH,
    KeyClusterIndex,
    build_index,
    extend_index,
    keys_allowed,
    keys_allowed_count,
    retrieval_attention,
)
from ..ops.topk_cache import oracle_attention, quest_attention
from .base import AttentionOptions
from .full import FullAttention
from .registry import register

__all__ = ["CacheBudgetOptions", "CacheReadingAttention", "ClusterRetrievalAttention", "ClusterRetrievalOptions",
           "OracleAttention", "QuestAttention", "QuestOptions", "SinkWindowAttention", "SinkWindowOptions"]


def _check_budget(name: str, budget: Any) -> None:
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(f"{name} must be a fraction in (0, 1] or a count >= 1; got {budget!r}")
    if isinstance(budget, float) and not 0.0 < budget <= 1.0:
        raise ValueError(f"{name} as a float is a fraction of the cache and must be in (0, 1]; got {budget}")
    if isinstance(budget, int) and budget < 1:
        raise ValueError(f"{name} as an int is a count of keys and must be >= 1; got {budget}")


@dataclass(frozen=True)
class CacheBudgetOptions(AttentionOptions):
    """What every cache-reading mechanism takes (``"sink-window"``, ``"cluster-retrieval"``, ``"oracle"``,
    ``"quest"``).

    Attributes:
        budget: keys each query of a cached call attends to, every key and centroid term it reads counted: a float
            in (0, 1] is a fraction of the sequence's cached keys (rounded up), an int >= 1 a count. A budget >= the
            cache is dense attention.
        dense_layers: the model's first ``dense_layers`` layers (by the attention module's ``layer_idx``) read their
            cache densely, as Quest and ClusterKV do: the lowest layers' attention is the least sparse
            (docs/long-context-decoding.md#what-each-cache-reader-keeps-of-denses-answers,
            #where-the-attention-mass-goes). Keys read then average ``(dense_layers + (L - dense_layers) * budget) / L``
            of the cache over L layers.
        lower_layers, lower_budget: the model's first ``lower_layers`` layers (those not dense by
            ``dense_layers``) read ``lower_budget`` keys per query (a fraction or a count, as ``budget``), the
            others ``budget``: a budget spread unevenly over the layers, as PyramidKV (Cai et al. 2024) spreads
            its cache, more where attention is least sparse (SmolLM2's lower layers,
            docs/long-context-decoding.md#the-budget-spread-over-the-layers). Keys read
            then average ``(lower_layers * lower_budget + (L - lower_layers) * budget) / L`` of the cache over L
            layers: to compare at a mean budget b, set ``budget = (L b - lower_layers * lower_budget) /
            (L - lower_layers)``. Decoding steps only: a sparse prefill reads ``prefill_budget`` in every layer.
        prefill_block: ``0`` (the default): a prefill -- queries over their own keys, nothing cached before them
            -- is dense, as in the papers, which make only the reading of the cache sparse. ``P > 0``: a *sparse
            prefill* (:meth:`CacheReadingAttention.attend_cache`): the prompt is read in blocks of P queries, in
            order, the first densely and each later one as a cached call on the keys up to its end, under the same
            budget (that of the cache at the block's end; cluster retrieval ranks its clusters once per block
            by the queries of the block before, ``"block"`` selection), its index carried from block to block.
            The cache itself is unchanged (every key and value is stored; only the prompt's attention reads
            fewer keys), and the cached calls that follow read it as after a dense prefill.
        prefill_budget: the budget of the sparse prefill's blocks, as ``budget`` (a fraction or a count); None
            (the default): ``budget``. A prefill errs where decoding does not: every later layer's keys and values
            of the prompt are computed from the sparse attention below it, so a prefill may want more keys than
            the decoding steps that read its cache (docs/long-context-decoding.md#the-prefill).
    """

    ATTENTION_DROPOUT: ClassVar[bool] = False

    budget: float | int = 0.1
    dense_layers: int = 0
    lower_layers: int = 0
    lower_budget: float | int | None = None
    prefill_block: int = 0
    prefill_budget: float | int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_budget("budget", self.budget)
        check_int("dense_layers", self.dense_layers, minimum=0)
        check_int("lower_layers", self.lower_layers, minimum=0)
        if (self.lower_layers > 0) != (self.lower_budget is not None):
            raise ValueError("lower_layers and lower_budget go together: the first lower_layers layers read "
                             f"lower_budget keys; got lower_layers={self.lower_layers}, "
                             f"lower_budget={self.lower_budget!r}")
        if self.lower_budget is not None:
            _check_budget("lower_budget", self.lower_budget)
        check_int("prefill_block", self.prefill_block, minimum=0)
        if self.prefill_budget is not None:
            _check_budget("prefill_budget", self.prefill_budget)
            if self.prefill_block == 0:
                raise ValueError("prefill_budget is the budget of the sparse prefill: it needs prefill_block > 0 "
                                 "(without it the prefill is dense)")

    def for_layer(self, layer: int | None) -> CacheBudgetOptions:
        """These options with the budget of decoding layer ``layer`` (``lower_budget`` below ``lower_layers``)."""
        if self.lower_budget is None or layer is None or layer >= self.lower_layers:
            return self
        return self._lower

    @functools.cached_property
    def _lower(self) -> CacheBudgetOptions:
        """The lower layers' options, made once (a decoding step of every layer asks)."""
        return replace(self, budget=self.lower_budget, lower_layers=0, lower_budget=None)

    def for_prefill(self) -> CacheBudgetOptions:
        """These options with the sparse prefill's budget (``prefill_budget``, where set) as ``budget``."""
        return self if self.prefill_budget is None else replace(self, budget=self.prefill_budget)

    def keys_allowed(self, lengths: torch.Tensor) -> torch.Tensor:
        """(B,) real cached keys -> (B,) keys a query may attend to under the budget (at most the cache)."""
        return keys_allowed(self.budget, lengths)

    def covers(self, lengths: torch.Tensor | int) -> bool:
        """Whether the budget covers every cached key of every sequence (then attention is dense); ``lengths``
        (B,) real keys per sequence, or one int for a batch without padding (no tensors: a decoding step's path)."""
        if isinstance(lengths, int):
            return keys_allowed_count(self.budget, lengths) >= lengths
        return bool((self.keys_allowed(lengths) >= lengths).all())

    # budgets: the query of a cached decoding step over ``length`` cached keys (its own the last), the maximum
    # over the model's layers; a prefill is full attention (unless prefill_block), and is not counted here
    def keys_read(self, length: int, causal: bool = False) -> int:
        """The keys read by the query of a cached decoding step over ``length`` keys (the cache is read causally,
        whatever ``causal``), the most over the layers (``dense_layers``: every key; ``lower_budget``): every
        logit it computes, the keys of its budget and those it scores to choose them (see :meth:`read_and_mixed`).
        The sparse prefill's blocks (``prefill_block``) are not counted."""
        return max(self._layers(length))[0]

    def keys_mixed(self, length: int, causal: bool = False) -> int:
        """The keys whose values reach that query's output, the most over the layers (as :meth:`keys_read`)."""
        return max(mixed for _, mixed in self._layers(length))

    def _layers(self, length: int) -> list[tuple[int, int]]:
        check_int("length", length, minimum=1)
        budgets = [self.budget] + ([self.lower_budget] if self.lower_budget is not None else [])
        found = [(length, length)] if self.dense_layers else []
        for budget in budgets:
            allowed = keys_allowed_count(budget, length)
            found.append((length, length) if allowed >= length else self.read_and_mixed(allowed, length))
        return found

    def read_and_mixed(self, allowed: int, length: int) -> tuple[int, int]:
        """(keys read, keys mixed) of a decoding step's query under a budget of ``allowed`` < ``length`` keys.
        The oracle scores every key and attends to the ``allowed`` best."""
        return length, allowed


@dataclass(frozen=True)
class SinkWindowOptions(CacheBudgetOptions):
    """Options of ``"sink-window"`` (and the budget part of ``"cluster-retrieval"``'s): ``budget`` and
    ``dense_layers`` (:class:`CacheBudgetOptions`), and

    Attributes:
        sink: first real tokens every query attends to (at most budget - 1: a query keeps its own key).
    """

    sink: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("sink", self.sink, minimum=0)

    def read_and_mixed(self, allowed: int, length: int) -> tuple[int, int]:
        """The sinks and the most recent keys, ``allowed`` in all, each mixed as read."""
        return allowed, allowed


@dataclass(frozen=True)
class QuestOptions(CacheBudgetOptions):
    """Options of ``"quest"``: ``budget`` and ``dense_layers`` (:class:`CacheBudgetOptions`), and

    Attributes:
        page_size: positions per page (Quest's 16): a query reads whole pages, each counted in full.
    """

    page_size: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("page_size", self.page_size, minimum=1)

    def read_and_mixed(self, allowed: int, length: int) -> tuple[int, int]:
        """Its own page up to itself (at most ``allowed`` keys), the whole earlier pages that the rest of the budget
        holds, each mixed as read; read besides: the bound of every earlier page, one logit each, which ranks them
        (:func:`clusterformer.ops.topk_cache.quest_attention`)."""
        P, r = self.page_size, length - 1
        own_page = r // P
        own = r - max(own_page * P, r - allowed + 1) + 1
        mixed = own + min(max(0, (allowed - own) // P), own_page) * P
        return mixed + own_page, mixed


@dataclass(frozen=True)
class ClusterRetrievalOptions(SinkWindowOptions):
    """Options of ``"cluster-retrieval"``: the budget, ``sink`` and ``dense_layers`` of
    :class:`SinkWindowOptions`, and

    Attributes:
        num_clusters: K-means clusters per layer and key/value head (ClusterKV's and the earlier interface's
            ``clusters`` is accepted as an alias).
        window: most recent tokens every query attends to (causally).
        refresh: keys that may join the index before it is re-clustered from scratch.
        iterations: Lloyd iterations of each (re)clustering.
        estimate_remainder: add the unretrieved keys of every cluster, estimated from its centroid and size.
        selection: ``"group"``: the query heads that share a key/value head share one ranking of the clusters
            (their best score) and one set of keys; ``"head"``: every query head ranks and gathers its own (more
            precise, ``rep`` times the gathering under grouped-query attention); ``"block"``: those heads at
            every position of a call share one (a chunk of Lq queries gathers once; a decoding step is "group").
            The sparse prefill's blocks always use ``"block"``.
        rerank: candidates per retrieved key (default 4: the best measured,
            docs/long-context-decoding.md#what-each-cache-reader-keeps-of-denses-answers). ``1``: the retrieved keys are
            the ranked clusters' first members up to the budget (ClusterKV's rule). ``f > 1``: the ranked clusters fill
            ``f`` times that many candidate slots, and each unit (a query, or under ``"group"`` a position with the best
            score over its query heads) keeps the candidates of highest exact ``q . k``. The keys *attended* stay within
            the budget; the candidates are *scored* (one dot product each, no value read), ``f`` times the retrieved
            keys, the price of a choice closer to the oracle's
            (docs/long-context-decoding.md#what-each-cache-reader-keeps-of-denses-answers). With ``estimate_remainder``
            a cluster's remainder is its members that were not kept.
        kernel: how a decoding step (one query position) is computed: ``"auto"`` (default): the fused C++ step
            (:func:`clusterformer.ops.retrieval.decode_kernel_unusable` says where it runs: CPU, float32/64, no
            gradient, the extension built; ``"group"`` or ``"head"`` selection, without ``estimate_remainder``), else
            the PyTorch composition; ``"fused"``: the fused step, ``ValueError`` where it cannot run; ``"torch"``: the
            PyTorch composition always. The same keys and function: they differ in rounding and speed
            (docs/long-context-decoding.md#what-a-decoding-step-costs). Calls with several query positions (a prompt in
            chunks, the sparse prefill's blocks) always run the composition.
    """

    ALIASES: ClassVar[dict[str, str]] = {"clusters": "num_clusters"}

    num_clusters: int = 256
    window: int = 64
    refresh: int = 4096
    iterations: int = 8
    estimate_remainder: bool = False
    selection: str = "group"
    rerank: int = 4
    kernel: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("num_clusters", self.num_clusters, minimum=1)
        check_int("window", self.window, minimum=0)
        check_int("refresh", self.refresh, minimum=1)
        check_int("iterations", self.iterations, minimum=0)
        check_bool("estimate_remainder", self.estimate_remainder)
        check_choice("selection", self.selection, ("group", "head", "block"))
        check_int("rerank", self.rerank, minimum=1)
        check_choice("kernel", self.kernel, ("auto", "fused", "torch"))
        if self.kernel == "fused" and self.estimate_remainder:
            raise ValueError("kernel='fused' has no remainder estimate: use kernel='auto' or 'torch' with "
                             "estimate_remainder=True")

    def read_and_mixed(self, allowed: int, length: int) -> tuple[int, int]:
        """:func:`clusterformer.ops.retrieval.retrieval_attention`'s accounting at the step whose window is
        narrowest (``window`` positions: the keys leave it for the index in batches, so later steps of a batch read
        a wider window and retrieve fewer): mixed, the sinks, the window and R retrieved keys, ``allowed`` in all
        (with ``estimate_remainder``, every indexed key through its cluster's centroid term); read besides, the
        ``num_clusters`` centroids scored to rank the clusters and the ``rerank`` x R candidates scored to choose
        the R (at most the index's keys)."""
        window = min(length, max(self.window, 1))
        indexed = max(0, length - window - self.sink)  # the real keys of rank >= sink before the window
        sinks = max(0, min(self.sink, allowed - 1))
        cap = max(1, allowed - sinks)
        reserved = 0
        if self.estimate_remainder and cap - window < indexed and allowed - sinks - 1 >= self.num_clusters:
            reserved, cap = self.num_clusters, max(1, allowed - sinks - self.num_clusters)
        retrieved = max(0, cap - window)
        kept = min(retrieved, indexed)
        read = sinks + min(cap, window) + min(self.rerank * retrieved, indexed) + self.num_clusters
        return read, sinks + min(cap, window) + (indexed if reserved else kept)


PREFILL_REGROWTH = 4  # the sparse prefill re-clusters its index when its keys have grown this many times over


class CacheReadingAttention(FullAttention):
    """What the cache-reading mechanisms share: :meth:`forward` is exact softmax attention (a prefill, or
    training); :meth:`attend_cache` reads the cache sparsely, through :meth:`_read`, when the budget does not
    cover it. Not registered itself."""

    decodes = False
    interface_mode = "cache"
    kind = "cache"  # a FullAttention by its forward, but no model's layer: it reads a decoder's cache

    def attend_cache(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None,
                     scale: float, index: KeyClusterIndex | None = None,
                     layer: int | None = None) -> tuple[torch.Tensor, KeyClusterIndex | None]:
        """Causal attention of the last Lq positions of a cache to it.

        Args:
            q: (B, H, Lq, D) queries of cache positions n - Lq .. n - 1 (H a multiple of the key/value heads).
            k, v: (B, Hkv, n, D) the cache, the queries' own keys included.
            mask: the call's :class:`~clusterformer.masks.AttentionMask`: its padding (B, n) or None (left
                padding, as ``generate()`` batches prompts); causal, as a decoder's cache is read (a bidirectional
                mask over several queries raises ``ValueError``). None: no padding, causal.
            scale: softmax scale.
            index: the key index this cache had after the previous call (cluster-retrieval), or None.
            layer: the model's layer number (``dense_layers``, ``lower_layers``); required when either is > 0.

        Returns:
            (out (B, H, Lq, D), the index to keep with the cache for the next call, or None).
        """
        n, Lq = k.shape[2], q.shape[2]
        for name in ("dense_layers", "lower_layers"):
            if getattr(self.options, name) > 0 and layer is None:
                raise ValueError(f"layer is required when {name}={getattr(self.options, name)}: an attention "
                                 "module without layer_idx cannot say which of the model's layers it is")
        mask = CAUSAL_MASK if mask is None else mask
        if (not mask.causal and Lq > 1) or mask.window is not None:
            raise ValueError("a cache is read causally, without a window: the mask must be key padding + causal")
        lengths = n if mask.padding is None else mask.lengths(k.shape[0], n, k.device)
        if layer is not None and layer < self.options.dense_layers:
            return cache_sdpa(q, k, v, mask, scale=scale), index
        if Lq == n:  # a prefill: sparse by its own budget (a dense decoding budget may follow a sparse prefill)
            prefill = self.options.for_prefill()
            if 0 < self.options.prefill_block < n and not prefill.covers(lengths):
                return self._prefill_in_blocks(q, k, v, mask, scale, prefill)
            return cache_sdpa(q, k, v, mask, scale=scale), index
        options = self.options.for_layer(layer)
        if options.covers(lengths):
            return cache_sdpa(q, k, v, mask, scale=scale), index
        return self._read(q, k, v, mask, scale, index, options)

    def _prefill_in_blocks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask,
                           scale: float, options: CacheBudgetOptions) -> tuple[torch.Tensor, None]:
        """The sparse prefill (option ``prefill_block`` = P): queries 0 .. P - 1 densely, then each block of P
        queries as a cached call on the keys up to the block's end (:meth:`_read`, or densely where the budget
        covers them; cluster retrieval ranks the clusters once per block and key/value head, ``"block"``
        selection, by the best scores of the block before it: a query's keys never depend on a later query),
        the index carried from block to block and rebuilt from scratch whenever the keys it holds
        have grown :data:`PREFILL_REGROWTH`-fold since its last clustering (K-means over about 4/3 n keys in
        all). The prefill's index is not kept: the first cached call after it builds one on every key, as after a
        dense prefill, so that the sparse prefill changes the prompt's attention only.

        A padded batch is read in each sequence's own token order: its real tokens first (a stable sort by
        padding; left padding becomes right padding), so that every block starts at the same token of a sequence
        as when that sequence is prefilled alone, and its outputs do not depend on the batch. The blocks are a
        loop: a block's index must hold exactly the keys before it, which the previous block completes. Each block's
        mask is the call's ``mask`` (key padding + causal) in that order, up to the block's end
        (:meth:`~clusterformer.masks.AttentionMask.packed_prefix`)."""
        B, _, n, _ = q.shape
        P = self.options.prefill_block
        order = None
        if mask.padding is not None:  # rank -> cache position: the real tokens first, each sequence in its own order
            order = torch.sort(mask.padding.to(torch.uint8), dim=1, stable=True).indices
            q, k, v = (x.gather(2, order[:, None, :, None].expand(*x.shape[:2], n, x.shape[-1])) for x in (q, k, v))
        # each block is a call of its own on the keys up to its end, in the sorted order: one mask per block
        blocks = [cache_sdpa(q[:, :, :P], k[:, :, :P], v[:, :, :P], mask.packed_prefix(P), scale=scale)]
        index = None
        for start in range(P, n, P):
            end = min(n, start + P)
            block_mask = mask.packed_prefix(end)
            keys, values = k[:, :, :end], v[:, :, :end]
            if options.covers(block_mask.lengths(B, end, q.device)):
                blocks.append(cache_sdpa(q[:, :, start:end], keys, values, block_mask, scale=scale))
                continue
            if index is not None and index.joined >= (PREFILL_REGROWTH - 1) * (index.end - index.joined):
                index = None  # its keys have grown PREFILL_REGROWTH-fold since it was clustered: cluster afresh
            out, index = self._read(q[:, :, start:end], keys, values, block_mask, scale, index, options,
                                    before=q[:, :, start - P:start])
            blocks.append(out)
        out = torch.cat(blocks, 2)
        if order is None:
            return out, None
        back = torch.argsort(order, dim=1)  # cache position -> rank
        out = out.gather(2, back[:, None, :, None].expand(*out.shape[:2], n, out.shape[-1]))
        return out.masked_fill(mask.padding[:, None, :, None], 0.0), None

    def _read(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask,
              scale: float, index: KeyClusterIndex | None, options: CacheBudgetOptions,
              before: torch.Tensor | None = None) -> tuple[torch.Tensor, KeyClusterIndex | None]:
        """The sparse reading of the cache by ``options`` (the mechanism's own, or with the prefill's budget) under
        the call's ``mask`` (key padding, causal): (out, the index to keep, or None). ``before``: the call is a block
        of the sparse prefill, and these are the queries of the block before it (which may choose its keys)."""
        raise NotImplementedError


@register("sink-window", SinkWindowOptions,
          "StreamingLLM for a decoder's cache (hf): first sink tokens + the most recent ones, up to a budget; a "
          "sequence's attention to itself (prefill) is full unless prefill_block is set")
class SinkWindowAttention(CacheReadingAttention):
    """StreamingLLM's cache reading: the first ``sink`` real tokens and the most recent ones, ``budget`` in all
    (:func:`clusterformer.ops.retrieval.retrieval_attention` without an index)."""

    def _read(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask,
              scale: float, index: KeyClusterIndex | None, options: CacheBudgetOptions,
              before: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        return retrieval_attention(q, k, v, mask, None, options, scale), None


@register("oracle", CacheBudgetOptions,
          "the upper bound of any selection of a decoder's cache (hf): per query and head, the budget's keys of "
          "largest q . k; computes every score; a sequence's attention to itself (prefill) is full unless "
          "prefill_block is set")
class OracleAttention(CacheReadingAttention):
    """The oracle's cache reading (:func:`clusterformer.ops.topk_cache.oracle_attention`): a yardstick for the
    methods that must choose their keys without computing every score."""

    def _read(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask,
              scale: float, index: KeyClusterIndex | None, options: CacheBudgetOptions,
              before: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        return oracle_attention(q, k, v, mask, options.budget, scale), None


@register("quest", QuestOptions,
          "Quest for a decoder's cache (hf; Tang et al. 2024): pages of page_size keys ranked by the upper bound of "
          "q . k from their per-channel min and max, whole pages up to a budget; a sequence's attention to itself "
          "(prefill) is full unless prefill_block is set")
class QuestAttention(CacheReadingAttention):
    """Quest's cache reading (:func:`clusterformer.ops.topk_cache.quest_attention`)."""

    def _read(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask,
              scale: float, index: KeyClusterIndex | None, options: CacheBudgetOptions,
              before: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        return quest_attention(q, k, v, mask, options.budget, options.page_size, scale), None


@register("cluster-retrieval", ClusterRetrievalOptions,
          "clustered key retrieval for a decoder's cache (hf; ClusterKV): sinks + window + the keys of the best "
          "K-means clusters (candidates re-ranked by exact score, rerank), up to a budget; a sequence's attention "
          "to itself (prefill) is full unless prefill_block is set")
class ClusterRetrievalAttention(CacheReadingAttention):
    """ClusterKV-style cache reading; see the module docstring and :meth:`CacheReadingAttention.attend_cache`."""

    keeps_index = True

    def _read(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask,
              scale: float, index: KeyClusterIndex | None, options: CacheBudgetOptions,
              before: torch.Tensor | None = None) -> tuple[torch.Tensor, KeyClusterIndex]:
        index = self._index(k, v, mask, index, q.shape[2])
        if before is None:
            return retrieval_attention(q, k, v, mask, index, options, scale), index
        # a prefill block gathers its retrieved keys once, chosen by the queries of the block before (causal)
        return retrieval_attention(q, k, v, mask, index, options, scale, "block", before), index

    def _index(self, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask,
               index: KeyClusterIndex | None, queries: int) -> KeyClusterIndex:
        """The index of this cache: ``index`` extended by the keys that left the window (in batches of
        :data:`JOIN_BATCH`), or built afresh when there is none or it does not continue this cache. The window
        holds the last ``window`` positions and at least the ``queries`` new ones."""
        n = k.shape[2]
        end = max(0, n - max(self.options.window, queries))
        if index is None or not index.follows(k, self.options) or index.end > end:
            return build_index(k, v, mask, end, self.options)
        if end - index.end >= JOIN_BATCH:  # keys leave the window in batches; until then the window is wider
            return extend_index(index, k, v, mask, end, self.options)
        index.length = n
        return index
