"""Recompute a cheap tensor in the backward instead of keeping it from the forward
(docs/speed-and-memory.md#memory).

Autograd keeps every tensor an op needs for its backward until the backward runs. For some of them that is a waste:
neural clustering sorts the hidden states into buffer order (one gather, ``index_select``) before projecting
queries, keys and values, and the backward of those projections needs the gathered rows, which are cheap to gather
again from ``x`` (kept anyway). :func:`recompute_saved` swaps every saved tensor that lives in a given tensor's
memory for a recipe while its block runs (``torch.autograd.graph.saved_tensors_hooks``) and reruns the recipe when
the backward first needs it.
The gradients are the same, bit for bit, as long as the recipe computes the same values (same op, same inputs, same
autocast state; the hooks capture the autocast state at entry).

Cost: the recipe once per backward (the first unpack computes it; the other tensors saved from it reuse it, and it
is dropped at the last one), against its output's memory from the forward to the backward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["attach_recipe", "recipe_of", "recompute_saved", "recompute_saved_all"]

_RECIPE = "_clusterformer_recipe"


def attach_recipe(tensor: torch.Tensor, recipe: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Mark ``tensor`` as rebuildable by ``recipe()`` (from tensors the graph keeps anyway), so that whoever consumes
    it can let autograd keep the recipe instead (:func:`recompute_saved`). Returns ``tensor``. Neural clustering
    marks its output, a reorder of the attention's own saved output, and the layer's output projection uses it."""
    if not torch.compiler.is_compiling():  # under torch.compile the compiler decides what to keep (see below)
        setattr(tensor, _RECIPE, recipe)
    return tensor


def recipe_of(tensor: torch.Tensor) -> Callable[[], torch.Tensor] | None:
    """The recipe :func:`attach_recipe` put on ``tensor``, or None."""
    return getattr(tensor, _RECIPE, None)


class _Recipe:
    """What a saved view of the recomputed tensor needs: the shared recomputation and the view's geometry."""

    __slots__ = ("offset", "shape", "shared", "stride")

    def __init__(self, shared: _Shared, view: torch.Tensor) -> None:
        self.shared = shared
        self.shape, self.stride, self.offset = view.shape, view.stride(), view.storage_offset()


class _Shared:
    """One recomputation, run at the first unpack and kept only until every view saved from the tensor has been
    unpacked (then the backward holds what it still needs, and a second backward recomputes)."""

    __slots__ = ("autocast", "device_type", "pending", "recompute", "saved", "value")

    def __init__(self, recompute: Callable[[], torch.Tensor], device_type: str) -> None:
        self.recompute, self.device_type, self.value = recompute, device_type, None
        self.autocast = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        self.saved = self.pending = 0  # views packed; views not yet unpacked in this backward

    def get(self) -> torch.Tensor:
        value = self.value
        if value is None:
            enabled, dtype = self.autocast
            with torch.autocast(self.device_type, dtype=dtype, enabled=enabled):
                value = self.recompute()
            self.pending = self.saved
        self.pending -= 1
        self.value = value if self.pending > 0 else None
        return value


def _outer_hooks_active() -> bool:
    """Whether saved-tensor hooks are already installed (a private query of PyTorch's; assume none without it)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None


@contextmanager
def recompute_saved(source: torch.Tensor, recompute: Callable[[], torch.Tensor]) -> Iterator[None]:
    """Inside this block, autograd keeps no tensor that shares ``source``'s memory: it keeps a recipe and calls
    ``recompute()`` (which must return a tensor equal to ``source``, laid out the same) in the backward.

    Args:
        source: the tensor not to keep (its views and detached aliases are covered too).
        recompute: rebuilds it from tensors the graph keeps anyway. Runs under the autocast state of the block's
            entry, and under the backward's grad mode (so a ``create_graph`` backward still differentiates it).

    Keep the block to the ops that save ``source``: every tensor saved inside passes through these hooks, and an op
    that saves its own output there (a norm, a softmax) forms a reference cycle, output -> its node -> the packed
    output, that Python's collector cannot see, so that part of the graph outlives its use.

    Under saved-tensor hooks installed by the caller (``torch.utils.checkpoint``'s, say) or under ``torch.compile``
    the block does nothing: those hooks, or the compiler, decide what is kept.
    """
    with recompute_saved_all([(source, recompute)]):
        yield


@contextmanager
def recompute_saved_all(pairs: list[tuple[torch.Tensor, Callable[[], torch.Tensor] | None]]) -> Iterator[None]:
    """:func:`recompute_saved` for several sources at once (one pair of hooks: blocks of saved-tensor hooks do not
    nest, an inner one replaces the outer). Pairs whose recipe is None are kept as usual; with none left, nothing
    is installed."""
    if torch.compiler.is_compiling() or _outer_hooks_active():
        # Under torch.compile the compiler's partitioner decides what to keep and what to recompute (and the hooks
        # would break its graph). Under hooks of the caller's (torch.utils.checkpoint, offloading to the CPU) the
        # innermost hooks would replace the caller's for every tensor saved in this block, so the block leaves the
        # saving to them.
        yield
        return
    # Only the addresses and the devices: autograd keeps the hooks with every saved tensor, so a hook that referred
    # to a source itself would keep it alive as long as the graph, the very thing this block is meant to avoid.
    # The addresses cannot be reused inside the block, where the caller still holds the sources. An empty tensor
    # has no memory to save (and its address may be any other's).
    shared = {(source.device, source.untyped_storage().data_ptr()): _Shared(recompute, source.device.type)
              for source, recompute in pairs if recompute is not None and source.numel()}
    if not shared:
        yield
        return

    def pack(saved: torch.Tensor) -> torch.Tensor | _Recipe:
        one = shared.get((saved.device, saved.untyped_storage().data_ptr()))
        if one is not None:
            one.saved += 1
            return _Recipe(one, saved)
        return saved

    def unpack(packed: torch.Tensor | _Recipe) -> torch.Tensor:
        if isinstance(packed, _Recipe):
            return packed.shared.get().as_strided(packed.shape, packed.stride, packed.offset)
        return packed

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
