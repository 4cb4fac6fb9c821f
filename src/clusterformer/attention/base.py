"""The two halves of every attention layer, as in fast-transformers' ``AttentionLayer`` / inner attention:

* :class:`InnerAttention` -- the *mechanism*: given per-head queries, keys and values (B, H, N, D) and the
  call's :class:`~clusterformer.masks.AttentionMask` (key padding and causal order, built once at the layer's
  entry and handed on to the ops as it is), which keys each query sees and how they are mixed. One file per mechanism
  subclasses it and registers it by name with its options dataclass (:mod:`clusterformer.attention.registry`).
  It owns the mechanism's parameters and state (centroids, memory banks, its seeded generator).
* :class:`AttentionLayer` -- the *layer*: input checks, padding, the Q/K/V projections (one fused linear, or
  a shared QK for the mechanisms that declare ``shared_qk``), the output projection, and one inner attention.

Hidden-state hook. A mechanism whose grouping needs the hidden states (neural clustering clusters x W^C, and
projects Q, K, V in sorted order for speed; Cluster-Former assigns x to its k-means centroids) overrides
:meth:`InnerAttention.attend_hidden`, which receives x and the layer's :class:`QKVProjection` instead of q,
k, v; every other mechanism inherits the default (project, then :meth:`InnerAttention.forward`). The same
hook is what :mod:`clusterformer.hf` calls with a pretrained model's own projections.

Per-forward outputs are never stored on modules: auxiliary losses and groupings go to
:mod:`clusterformer.attention.aux`'s collectors. A reversible block's recompute runs inside
:func:`replaying` (a :class:`contextvars.ContextVar`), in which mechanisms leave their state alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_bool, check_float, check_int, check_padding_mask, check_tensor
from ..masks import NO_MASK, AttentionMask
from ..ops.decode import DecodeCache, check_right_padded
from ..ops.heads import split_heads
from ..ops.recompute import recipe_of, recompute_saved

_REPLAYING: ContextVar[bool] = ContextVar("clusterformer_replaying", default=False)


@contextlib.contextmanager
def replaying() -> Iterator[None]:
    """Context in which layers re-run a forward they already ran (the recompute of a reversible block).

    Mechanisms with state (memory banks, EMA centroids, step counters) do not change it inside, so the
    recompute sees exactly what the original forward saw (:meth:`InnerAttention.updates_state`)."""
    token = _REPLAYING.set(True)
    try:
        yield
    finally:
        _REPLAYING.reset(token)


def is_replaying() -> bool:
    """True inside :func:`replaying`."""
    return _REPLAYING.get()


# ----------------------------------------------------------------------------------------------- options
@dataclass(frozen=True)
class AttentionOptions:
    """Options every mechanism has. A mechanism's options dataclass subclasses this (or
    :class:`SeededOptions`), adds its own fields, all with defaults, and checks them in ``__post_init__``
    after calling ``super().__post_init__()``.

    Attributes:
        dropout: attention-weight dropout probability during training.
        bias: bias in the layer's Q/K/V and output projections (a layer option; the inner attention ignores it).

    Class attributes a mechanism may set:
        ALIASES: the papers' names accepted for an option, {alias: option} (e.g. Reformer's ``bucket_size``
            for ``chunk_size``); :func:`clusterformer.attention.registry.make_options` maps them.
        ATTENTION_DROPOUT: False when the mechanism has no attention dropout (then ``dropout`` must be 0).
        DEFAULTS_VERSION: raised by one whenever a default changes what the mechanism computes, with
            :meth:`earlier_defaults` saying what the defaults were before. Checkpoints and ``metrics.json``
            record every mechanism's version (:func:`clusterformer.attention.registry.defaults_versions`), so a
            run written under older defaults is rebuilt as it was trained
            (:func:`clusterformer.attention.registry.pin_defaults`), not silently under the new ones.
    """

    ALIASES: ClassVar[dict[str, str]] = {}
    ATTENTION_DROPOUT: ClassVar[bool] = True
    DEFAULTS_VERSION: ClassVar[int] = 1

    @classmethod
    def earlier_defaults(cls, version: int, options: dict[str, Any]) -> dict[str, Any]:
        """The options to set over ``options`` (as given, canonical names) so that they build what they built
        under the defaults of ``version`` (< DEFAULTS_VERSION). None changed yet: {}."""
        return {}

    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        check_float("dropout", self.dropout, minimum=0.0, maximum=1.0, exclusive_maximum=True)
        if self.dropout and not self.ATTENTION_DROPOUT:
            raise ValueError(f"dropout must be 0 for {type(self).__name__}: the mechanism has no attention "
                             f"dropout; got {self.dropout}")
        check_bool("bias", self.bias)

    def causal_semantics(self) -> str:
        """What ``causal=True`` means: ``"strict"`` (output t depends on tokens 0..t only, and a prefix gives the
        same outputs alone), ``"paper"`` (no direct future leak, but which past keys a token sees depends on
        the whole sequence) or ``"refused"`` (``causal=True`` raises)."""
        return "strict"

    def cached_decoding(self) -> bool:
        """Whether these options keep the mechanism's cached decoding (when it has one and is strictly causal);
        an option that groups in a way the cache cannot follow says False."""
        return True

    # budgets: the keys a query reads and the keys it mixes (docs/ARCHITECTURE.md, "Budgets")
    def keys_read(self, length: int, causal: bool = False) -> int:
        """Keys read: the most key-side vectors whose logit one query computes in a sequence of ``length`` tokens
        (under a causal mask, the query that reaches the most): its keys, and every vector made from this
        sequence's keys that it scores -- a summary, a centroid or a page bound counts as one key read; a
        candidate scored and then dropped (re-ranking, members scored by score) counts too. Each counts once,
        whatever number of rounds or windows bring it. Trained or drawn vectors (learned and EMA centroids, hash
        rotations) are parameters, not keys. The default is every key (full attention; also the mechanisms
        whose centroid queries read every key)."""
        check_int("length", length, minimum=1)
        return length

    def keys_mixed(self, length: int, causal: bool = False) -> int:
        """Keys mixed: the most keys whose values reach one query's output (a summary mixes all its members'
        values), as the maximum over the queries of :meth:`keys_read`. The default: the keys read (every logit
        computed enters the softmax with its own key's value)."""
        return self.keys_read(length, causal)

    def keys_per_query(self, length: int, causal: bool = False) -> int:
        """The budget a comparison matches: :meth:`keys_read` (what a query pays for; :meth:`keys_mixed` says
        what reaches it)."""
        return self.keys_read(length, causal)

    def for_budget(self, keys: int, length: int, causal: bool = False) -> dict[str, Any]:
        """The options that change to give each query at most ``keys`` keys at ``length`` (as large as fits): a
        dict to merge over this mechanism's options. ``ValueError`` for a mechanism whose budget no option sets
        (full attention, and the clustered mechanisms, whose centroid queries read every key)."""
        raise ValueError(f"{type(self).__name__} has no option that sets the keys per query: every query can "
                         f"read all {length} keys")


@dataclass(frozen=True)
class SeededOptions(AttentionOptions):
    """:class:`AttentionOptions` plus ``seed``, for mechanisms that draw random numbers.

    Attributes:
        seed: seeds the mechanism's own generator (hash planes, rotations, centroid initialisation).
    """

    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("seed", self.seed, minimum=0)


@dataclass(frozen=True)
class BucketOptions(SeededOptions):
    """:class:`SeededOptions` plus what the sorted-bucket mechanisms (lsh, routing, kmeans) share.

    Attributes:
        chunk_size: tokens per chunk after sorting by bucket or cluster (the Reformer's bucket size, the
            Routing Transformer's window).
        look_back: previous chunks each chunk attends to (1 in the papers).
        causal_chunk_size: tokens per chunk under ``causal=True`` (and in cached decoding). Strict causal
            chunking gives every bucket chunks of its own (a token's chunk is fixed by the earlier tokens), so
            each non-empty bucket leaves up to a chunk of empty slots: with 16 buckets and chunks of 64 a
            256-token sequence fills 1,264 slots, and training ran 15-50x slower than full attention
            (docs/speed-and-memory.md#at-sentence-length-and-in-causal-training). A chunk near the expected bucket
            size keeps the slots near N; 16, as neural-clustering's ``causal_chunk_size``. Fixed, not derived from
            the length, so a prefix alone gives the same outputs as inside a longer sequence.
    """

    chunk_size: int = 64
    look_back: int = 1
    causal_chunk_size: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("chunk_size", self.chunk_size, minimum=1)
        check_int("look_back", self.look_back, minimum=0)
        check_int("causal_chunk_size", self.causal_chunk_size, minimum=1)

    def chunk_for(self, causal: bool) -> int:
        """The chunk size of a forward: ``causal_chunk_size`` under ``causal=True``, else ``chunk_size``."""
        return self.causal_chunk_size if causal else self.chunk_size

    #: hashing or clustering rounds whose chunks a query attends to (their union counts towards the budget)
    budget_rounds: ClassVar[str | None] = None

    def _rounds(self) -> int:
        return 1 if self.budget_rounds is None else getattr(self, self.budget_rounds)

    def keys_read(self, length: int, causal: bool = False) -> int:
        """At most ``rounds * (look_back + 1) * chunk`` keys (the chunk under ``causal``: ``causal_chunk_size``),
        each mixed as read."""
        check_int("length", length, minimum=1)
        return min(length, self._rounds() * (self.look_back + 1) * self.chunk_for(causal))

    def for_budget(self, keys: int, length: int, causal: bool = False) -> dict[str, Any]:
        """The chunk (``causal_chunk_size`` under ``causal``) = keys // (rounds * (look_back + 1))."""
        check_int("keys", keys, minimum=1)
        chunk = keys // (self._rounds() * (self.look_back + 1))
        if chunk < 1:
            raise ValueError(f"keys={keys} is below one chunk of one key in each of {self._rounds()} round(s) "
                             f"and {self.look_back + 1} chunk(s) per window")
        return {"causal_chunk_size" if causal else "chunk_size": chunk}


def option_fields(options: type) -> dict[str, Any]:
    """A mechanism's options and their defaults, in declaration order."""
    return {f.name: f.default for f in dataclasses.fields(options)}


# ---------------------------------------------------------------------------------------------- randomness
class SeededModule(nn.Module):
    """A module with its own CPU ``torch.Generator`` seeded by ``seed`` (None: no generator).

    The generator's state travels with ``state_dict`` (extra state), so a resumed run draws the same random
    numbers. :meth:`draw_generator` gives the generator to draw a forward's numbers from, and :meth:`draw` draws a
    forward's random tensor from it.

    Staged draws (for a step replayed from a CUDA graph). A forward that draws on the host and copies
    to the GPU cannot be captured, and a tensor copied from pinned host memory would be replayed as the capture's
    numbers for ever. With staging on (:func:`stage_draws`), :meth:`draw` returns a device buffer instead, and
    :func:`restage_draws`, called on the host before each step (outside the graph), draws the step's numbers
    from the same generator into it. Called once before every step, the steps see the same numbers in the same
    order as unstaged ones, and the generator ends in the same state (tests/attention/test_staged_draws.py). The
    buffers are recorded by the first staged step for its shapes; a step that asks for a draw of another shape
    raises (a CUDA graph is captured for one static shape, too)."""

    def __init__(self, seed: int | None = None) -> None:
        super().__init__()
        self.seed = seed
        self.generator: torch.Generator | None = None
        if seed is not None:
            self.generator = torch.Generator().manual_seed(seed)
        # staged draws: None (off), else draw key -> (how to draw it from a generator, the device buffer)
        self.staged: dict[str, tuple[Callable[[torch.Generator], torch.Tensor], torch.Tensor]] | None = None

    def get_extra_state(self) -> dict | None:
        return None if self.generator is None else {"generator": self.generator.get_state()}

    def set_extra_state(self, state: dict | None) -> None:
        if state is not None and self.generator is not None and "generator" in state:
            self.generator.set_state(state["generator"])

    def draw_generator(self) -> torch.Generator:
        """The module's own generator, advancing, in training; a fresh one seeded with ``seed`` in evaluation
        (so the same input gives the same output)."""
        if self.generator is None:
            raise RuntimeError(f"{type(self).__name__} was built without a seed")
        if self.training:
            return self.generator
        return torch.Generator().manual_seed(self.seed)

    def draw(self, key: str, make: Callable[[torch.Generator], torch.Tensor], device: torch.device,
             dtype: torch.dtype | None = None) -> torch.Tensor:
        """This forward's random tensor: ``make(generator)`` (a CPU tensor drawn from :meth:`draw_generator`) on
        ``device`` as ``dtype``. With staged draws on, the buffer :func:`restage_draws` filled instead (the first
        staged step draws it here and records ``make`` under ``key``, which must name the draw and its shape)."""
        if self.staged is None:
            return make(self.draw_generator()).to(device=device, dtype=dtype)
        if key in self.staged:
            return self.staged[key][1]
        if self.staged:
            raise RuntimeError(f"{type(self).__name__}: staged draws were recorded for {sorted(self.staged)}, and "
                               f"this step draws {key!r} (another shape): a staged step has one static shape; call "
                               "stage_draws(model) again to record the new one")
        buffer = make(self.draw_generator()).to(device=device, dtype=dtype)
        self.staged[key] = (make, buffer)
        return buffer

    def restage(self) -> None:
        """Draw the next step's numbers into the staged buffers (see the class docstring)."""
        for make, buffer in (self.staged or {}).values():
            buffer.copy_(make(self.draw_generator()))


LAYER_SEED_STRIDE = 1_000_003  # a prime: layer seeds of nearby base seeds do not collide in practice


def layer_seed(seed: int, layer: int) -> int:
    """The seed of the ``layer``-th attention layer of a model built with ``seed`` (the Encoder's blocks, the
    layers :func:`clusterformer.hf.patch` replaces): distinct per layer, so hash rotations, hash planes and
    initial centroids differ between layers (as in the Reformer), and fixed by ``seed``."""
    return (seed + LAYER_SEED_STRIDE * layer) % 2**63


def apply_pending_updates(model: nn.Module) -> None:
    """Apply every inner attention's pending state update (EMA centroids) now instead of at its next training
    forward. The result is the same -- nothing else touches the state in between -- but the buffers, and so a
    checkpoint or an evaluation, then hold the state after the last step rather than one step old."""
    for module in model.modules():
        if isinstance(module, InnerAttention):
            module.apply_pending_updates()


def stage_draws(model: nn.Module, on: bool = True) -> None:
    """Turn staged draws on (or off) in every seeded module of ``model`` (see :class:`SeededModule`): its
    forwards then read their random numbers from device buffers, which :func:`restage_draws` fills before each
    step, so the step does no host work and can be captured in a CUDA graph. Turning them on again forgets the
    recorded buffers. Call ``restage_draws(model)`` exactly once before every step after the first."""
    for module in model.modules():
        if isinstance(module, SeededModule):
            module.staged = {} if on else None


def restage_draws(model: nn.Module) -> None:
    """Draw the next step's random numbers into every staged buffer of ``model``, on the host, from each module's
    own generator (advancing in training, re-seeded in evaluation, as an unstaged forward draws). A no-op for a
    model without staged draws, or before its first staged step."""
    for module in model.modules():
        if isinstance(module, SeededModule):
            module.restage()


# ----------------------------------------------------------------------------------------------- projection
class QKVProjection(Protocol):
    """How per-head q, k, v come from hidden states: what :meth:`InnerAttention.attend_hidden` receives.

    :class:`AttentionLayer` is one (a fused Q/K/V linear); :class:`clusterformer.hf.PatchedSelfAttention` is
    another (a pretrained model's own ``query``/``key``/``value`` layers)."""

    heads: int
    head_dim: int

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, N, dim) -> q, k, v, each (B, H, N, head_dim)."""
        ...

    def project_rows(self, rows: torch.Tensor, which: str) -> torch.Tensor:
        """(R, dim) hidden rows -> (R, H * head_dim) for ``which`` in "q", "k", "v" (projecting a reordered
        selection of rows, as neural clustering does in sorted order)."""
        ...


def check_prompt_mask(mask: AttentionMask) -> None:
    """A prompt's mask for cached decoding: an :class:`AttentionMask`, causal, without a window, right-padded."""
    if not isinstance(mask, AttentionMask) or not mask.causal or mask.window is not None:
        raise ValueError("mask must be a causal AttentionMask without a window for a prefill (a prompt is read "
                         "causally)")
    check_right_padded(mask)


# ------------------------------------------------------------------------------------------ inner attention
class InnerAttention(SeededModule):
    """A registered mechanism: ``inner(q, k, v, mask=NO_MASK) -> (B, H, N, D)``, ``mask`` the call's
    :class:`~clusterformer.masks.AttentionMask` (key padding, causal order), which the mechanism hands on to its
    ops as it is and never rebuilds.

    Subclasses set :attr:`shared_qk` (the layer must give the same tensor as q and k) and implement
    :meth:`forward`; those that group by hidden states override :meth:`attend_hidden` as well.

    Cached decoding. A strictly causal mechanism sets :attr:`decodes` and implements :meth:`cache_from` (the
    cache after a prompt) and :meth:`step` (one new token per sequence against the cache, equal to the causal
    forward at that position; caches in :mod:`clusterformer.ops.decode`), or :meth:`prefill_hidden` and
    :meth:`step_hidden` when it groups by hidden states. :class:`AttentionLayer` exposes them as
    ``layer.prefill(x, key_padding_mask)`` and ``layer.step(x_t, cache)``.

    Contract for ``forward``: q, k, v (B, H, N, D) with padded rows of no consequence; ``mask`` an
    :class:`~clusterformer.masks.AttentionMask` whose padding is (B, N) bool, True = padding, or None, and whose
    ``causal`` asks for the mechanism's causal semantics; outputs at real positions follow the mechanism's
    equations, outputs at padded positions are unspecified (the layer zeroes them). It publishes auxiliary
    losses and its grouping through :mod:`clusterformer.attention.aux`, never by storing them.

    State. A mechanism whose forward updates buffers (EMA centroids, memory banks) does so in training only and
    never inside :func:`replaying` (:meth:`updates_state`); an update computed in one forward is kept pending in
    :attr:`pending` and applied at the start of the next (or by :func:`apply_pending_updates`), so a
    reversible recompute sees the state its forward saw. Pending updates are part of ``state_dict``.

    Randomness comes from :meth:`draw_generator` (seeded by the ``seed`` option), never the global RNG;
    dropout uses the global RNG, as everywhere in PyTorch.
    """

    shared_qk: ClassVar[bool] = False
    aux_losses: ClassVar[tuple[str, ...]] = ()  # names of the losses the mechanism publishes
    # train --dense-warmup-steps: a mechanism that sets dense_warmup attends to every key in training forwards while
    # the training loop holds ``dense_training`` True (its grouping state still trains); never in evaluation
    dense_warmup: ClassVar[bool] = False
    dense_training: bool = False
    decodes: ClassVar[bool] = False  # implements cached decoding (cache_from + step, or the *_hidden pair)
    # How clusterformer.hf's AttentionInterface runs the mechanism on a pretrained model's own q, k, v: "dense"
    # (exact softmax attention under the model's mask), "sequence" (forward on a sequence attending to itself; a
    # cached decoding step, one query per head, is dense), "cache" (attend_cache: the mechanism reads a decoder's
    # key/value cache), or None: it needs hidden states or a shared QK, which a pretrained model does not give.
    interface_mode: ClassVar[str | None] = None
    # What the mechanism is: "sequence" (a model's layer: a sequence attends to itself, and it trains) or "cache" (it
    # changes only how a pretrained decoder reads its key/value cache, through clusterformer.hf: its forward, a
    # sequence's attention to itself, is full attention, so training it would train full attention; train refuses it)
    kind: ClassVar[str] = "sequence"
    keeps_index: ClassVar[bool] = False  # a cache reader keeping a key index beside the cache (re-clustered by refresh)
    # A mechanism that groups tokens by their hidden states says so here ("<name> clusters the hidden states ..."): it
    # implements attend_hidden, and forward on q, k, v alone refuses with this reason
    hidden_states: ClassVar[str | None] = None
    # learned centroids that can flow from layer to layer (the encoder's centroid_flow, later layers built with
    # own_centroids=False) and train at their own rate (clustering_parameters(), train's centroid_lr_scale)
    learned_centroids: ClassVar[bool] = False
    # the mechanism of the other layers of the paper's stack this one belongs in (train's cluster_layers), or None
    stack_layers: ClassVar[str | None] = None

    def __init__(self, dim: int, heads: int, options: AttentionOptions) -> None:
        super().__init__(getattr(options, "seed", None))
        self.dim = dim
        self.heads = heads
        self.head_dim = dim // heads
        self.options = options
        self.pending: dict[str, torch.Tensor] = {}

    @property
    def dropout_p(self) -> float:
        """The attention dropout of this call: the option in training, 0 in evaluation."""
        return self.options.dropout if self.training else 0.0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask = NO_MASK
                ) -> torch.Tensor:
        if self.hidden_states is not None:
            raise ValueError(f"{self.hidden_states}: call it through attend_hidden (an AttentionLayer, or "
                             "clusterformer.hf.patch), not on q, k, v alone")
        raise NotImplementedError

    def attend_hidden(
        self, x: torch.Tensor, projection: QKVProjection, mask: AttentionMask = NO_MASK,
        flow: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The hook for mechanisms that need the hidden states: x (B, N, dim) with padded rows zero ->
        (heads output (B, N, H, D) in token order, the flow to the next layer or None).

        ``flow`` is what the previous layer handed on (neural clustering's centroid flow between layers);
        a mechanism without one refuses it. The default projects and calls :meth:`forward`."""
        if flow is not None:
            raise ValueError(f"{type(self).__name__} takes no flow from a previous layer")
        q, k, v = projection.qkv(x)
        return self(q, k, v, mask).transpose(1, 2), None

    # ------------------------------------------------------------------ cached decoding (strict causal only)
    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask
                ) -> tuple[torch.Tensor, DecodeCache]:
        """The causal forward over a right-padded prompt batch under its causal ``mask``, and the cache that
        continues it: (out (B, H, N, D), cache). The default runs :meth:`forward`, then :meth:`cache_from`."""
        self.check_decoding()
        check_prompt_mask(mask)
        return self(q, k, v, mask), self.cache_from(q, k, v, mask)

    def cache_from(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> DecodeCache:
        """The cache after a prompt's q, k, v (B, H, N, D): what a strictly causal mechanism implements."""
        raise ValueError(self._no_decoding())

    def step(self, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, cache: DecodeCache
             ) -> tuple[torch.Tensor, DecodeCache]:
        """One new token per sequence, q_t / k_t / v_t (B, H, D), at position ``cache.lengths[b]`` ->
        (out (B, H, D), cache updated in place): equal to the causal forward over the whole sequence at that
        position. Implemented by the strictly causal mechanisms."""
        raise ValueError(self._no_decoding())

    def prefill_hidden(self, x: torch.Tensor, projection: QKVProjection, mask: AttentionMask
                       ) -> tuple[torch.Tensor, DecodeCache]:
        """:meth:`prefill` from hidden states (the :meth:`attend_hidden` counterpart): x (B, N, dim) ->
        (heads output (B, N, H, D), cache)."""
        q, k, v = projection.qkv(x)
        out, cache = self.prefill(q, k, v, mask)
        return out.transpose(1, 2), cache

    def step_hidden(self, x_t: torch.Tensor, projection: QKVProjection, cache: DecodeCache
                    ) -> tuple[torch.Tensor, DecodeCache]:
        """:meth:`step` from hidden states: x_t (B, dim) -> (heads output (B, H, D), cache)."""
        self.check_decoding()
        q, k, v = projection.qkv(x_t.unsqueeze(1))
        return self.step(q[:, :, 0], k[:, :, 0], v[:, :, 0], cache)

    def check_decoding(self) -> None:
        """Cached decoding is inference with a strictly causal mechanism: refuse anything else clearly."""
        if not self.decodes or self.options.causal_semantics() != "strict" or not self.options.cached_decoding():
            raise ValueError(self._no_decoding())
        if self.training:
            raise ValueError(f"{type(self).__name__}: cached decoding is inference (no dropout, no state updates); "
                             "call model.eval() first")

    def _no_decoding(self) -> str:
        if self.decodes and not self.options.cached_decoding():
            return (f"{type(self).__name__} has no cached decoding with these options: "
                    f"{type(self.options).cached_decoding.__doc__}")
        return (f"{type(self).__name__} has no cached decoding: its causal mode is "
                f"{self.options.causal_semantics()!r}, and only strictly causal mechanisms can continue a prefix "
                "token by token (full, neural-clustering with causal_mode='strict', lsh, routing, kmeans, "
                "sliding-window)")

    def init_for_pretrained(self) -> None:
        """Re-initialise the mechanism's own parameters for use inside a pretrained model
        (:func:`clusterformer.hf.patch`); a no-op for mechanisms without parameters."""

    def updates_state(self) -> bool:
        """Whether this forward may change buffers: training mode and not a reversible recompute."""
        return self.training and not is_replaying()

    @torch.no_grad()
    def apply_pending_updates(self) -> None:
        """Copy the state updates computed by the last training forward into their buffers (or parameters that
        follow the data rather than a gradient)."""
        for name, value in self.pending.items():
            getattr(self, name).copy_(value)
        self.pending = {}

    def get_extra_state(self) -> dict | None:
        """The generator's state (if any) and any pending state update, so ``state_dict`` holds all state."""
        state = super().get_extra_state() or {}
        if self.pending:
            state["pending"] = {name: value.detach().clone() for name, value in self.pending.items()}
        return state or None

    def set_extra_state(self, state: dict | None) -> None:
        super().set_extra_state(state)
        self.pending = {} if state is None else {k: v.clone() for k, v in state.get("pending", {}).items()}

    def refuse_causal(self, causal: bool, why: str) -> None:
        """Raise the mechanism's ``ValueError`` for ``causal=True``."""
        if causal:
            raise ValueError(f"{type(self).__name__} does not support causal=True: {why}; use 'lsh', 'kmeans', "
                             "'routing', 'neural-clustering' or 'full' for causal models")


# ------------------------------------------------------------------------------------------------- layer
class AttentionLayer(nn.Module):
    """Multi-head self-attention: ``layer(x, key_padding_mask=None, causal=False)`` -> (B, N, dim).

    Owns the projections and composes one :class:`InnerAttention` (:attr:`inner`), which
    :func:`clusterformer.attention.build` chooses by name. Padded input rows are zeroed on entry (so their
    content, even NaN, cannot leak) and outputs at padded positions are zero.
    """

    def __init__(self, dim: int, heads: int, inner: InnerAttention, *, bias: bool = True) -> None:
        super().__init__()
        if (inner.dim, inner.heads) != (dim, heads):
            raise ValueError(f"inner attention was built for dim={inner.dim}, heads={inner.heads}; the layer has "
                             f"dim={dim}, heads={heads}")
        self.dim = dim
        self.heads = heads
        self.head_dim = dim // heads
        self.shared_qk = inner.shared_qk
        self.to_qkv = nn.Linear(dim, (2 if self.shared_qk else 3) * dim, bias=bias)
        self.to_out = nn.Linear(dim, dim, bias=bias)
        self.inner = inner
        self.register_load_state_dict_pre_hook(_move_mechanism_state_into_inner)

    @property
    def options(self) -> AttentionOptions:
        """The inner attention's options."""
        return self.inner.options

    def forward(
        self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None, causal: bool = False, *,
        flow: torch.Tensor | None = None, return_flow: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """Args: x (B, N, dim); key_padding_mask (B, N) bool, True = padding; causal: no attention to later
        positions (see the mechanism's causal semantics); flow: what the previous layer hands on (neural
        clustering's centroids: the paper lets layer l + 1 start from layer l's C_hat); return_flow: also
        return this layer's flow. Returns y (B, N, dim), or (y, flow or None) with ``return_flow``."""
        key_padding_mask = self._check_input(x, key_padding_mask)
        check_bool("causal", causal)
        mask = AttentionMask(key_padding_mask, causal)  # the call's one mask, handed as it is to the ops
        attend = lambda x: self.inner.attend_hidden(x, self, mask, flow)  # noqa: E731
        y, flow = attend_padded(x, key_padding_mask, attend, self.to_out)
        return (y, flow) if return_flow else y

    # cached decoding
    def prefill(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, DecodeCache]:
        """The causal forward over a prompt batch, and the cache that continues it: x (B, N, dim), right-padded
        with ``key_padding_mask`` (B, N) -> (y (B, N, dim), cache). Equal to ``layer(x, key_padding_mask,
        causal=True)``. Needs a strictly causal mechanism and eval mode."""
        key_padding_mask = self._check_input(x, key_padding_mask)
        self.inner.check_decoding()
        mask = AttentionMask(key_padding_mask, causal=True)  # the prompt's one mask, handed as it is to the ops
        check_right_padded(mask)
        return attend_padded(x, key_padding_mask, lambda x: self.inner.prefill_hidden(x, self, mask), self.to_out)

    def step(self, x_t: torch.Tensor, cache: DecodeCache) -> tuple[torch.Tensor, DecodeCache]:
        """One new token per sequence: x_t (B, dim), the hidden state at position ``cache.lengths[b]`` ->
        (y_t (B, dim), cache, updated in place). Equal to the causal forward over the whole sequence at that
        position; costs what the mechanism's cache costs (O(t) for full, O(chunk) for the clustering ones)."""
        check_tensor("x_t", x_t, ndim=2, floating=True)
        if x_t.shape[-1] != self.dim:
            raise ValueError(f"x_t must have shape (B, dim={self.dim}), got {tuple(x_t.shape)}")
        if not isinstance(cache, DecodeCache) or cache.batch_size != x_t.shape[0]:
            raise ValueError(f"cache must be the DecodeCache of this layer's prefill/step for {x_t.shape[0]} "
                             f"sequences, got {type(cache).__name__}")
        heads_out, cache = self.inner.step_hidden(x_t, self, cache)
        return self.to_out(heads_out.reshape(x_t.shape[0], self.dim)), cache

    def _check_input(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None) -> torch.Tensor | None:
        """Check x (B, N, dim) and return its key padding mask checked (None: no padding)."""
        check_tensor("x", x, ndim=3, floating=True)
        if x.shape[-1] != self.dim:
            raise ValueError(f"x must have shape (B, N, dim={self.dim}), got {tuple(x.shape)}")
        return check_padding_mask(key_padding_mask, x.shape[0], x.shape[1], device=x.device)

    # QKVProjection: how the inner attention gets q, k, v from hidden states
    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, N, dim) -> q, k, v (B, H, N, head_dim); with shared QK, q and k are the same tensor."""
        # strided views of the fused projection, whose gradients come back in its layout (ops/heads.py): in one
        # pass, or none when a fused kernel wrote them there; where unbind's backward stacked them and then
        # transposed the stack (two passes; each indexing's backward, before it, filled a zero tensor of all three)
        if self.shared_qk:
            qk, v = split_heads(self.to_qkv(x), 2, self.heads)
            return qk, qk, v
        q, k, v = split_heads(self.to_qkv(x), 3, self.heads)
        return q, k, v

    def project_rows(self, rows: torch.Tensor, which: str) -> torch.Tensor:
        """(R, dim) -> (R, dim): the slice of the fused projection for "q", "k" or "v"."""
        index = ({"q": 0, "k": 0, "v": 1} if self.shared_qk else {"q": 0, "k": 1, "v": 2})[which]
        part = slice(index * self.dim, (index + 1) * self.dim)
        bias = None if self.to_qkv.bias is None else self.to_qkv.bias[part]
        return F.linear(rows, self.to_qkv.weight[part], bias)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, heads={self.heads}, shared_qk={self.shared_qk}"


def attend_padded(x: torch.Tensor, key_padding_mask: torch.Tensor | None,
                  attend: Callable[[torch.Tensor], tuple[torch.Tensor, Any]],
                  project: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, Any]:
    """The padding discipline of every attention module (:class:`AttentionLayer`'s forward and prefill,
    :class:`clusterformer.hf.PatchedSelfAttention`): padded rows of x (B, N, dim) are zeroed before ``attend``
    (so their content, even NaN, cannot leak), ``attend(x)`` returns the heads' output (B, N, H, D) and something
    else (a flow, a cache), the heads are joined and ``project``-ed (the output projection, or none), and the
    outputs at padded positions are zero. Returns (y (B, N, out), what ``attend`` returned beside the heads)."""
    if key_padding_mask is not None:
        x = x.masked_fill(key_padding_mask.unsqueeze(-1), 0.0)
    heads_out, extra = attend(x)
    y = heads_out.flatten(2)  # (B, N, H * D); also for an empty batch or sequence
    if project is not None:
        recipe = recipe_of(heads_out)  # rebuildable (neural clustering's reorder): keep the recipe, not the copy
        with contextlib.nullcontext() if recipe is None else recompute_saved(y, lambda: recipe().flatten(2)):
            y = project(y)
    if key_padding_mask is not None:
        y = y.masked_fill(key_padding_mask.unsqueeze(-1), 0.0)
    return y, extra


def _move_mechanism_state_into_inner(module, state_dict, prefix, *args) -> None:
    """Checkpoints written before the layer/inner split kept the mechanism's parameters, buffers and extra
    state on the layer itself (``attn.centroids``); they now live on ``attn.inner``."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        if not key[len(prefix):].startswith(("to_qkv.", "to_out.", "inner.")):
            state_dict[prefix + "inner." + key[len(prefix):]] = state_dict.pop(key)
