"""clusterformer's mechanisms inside any ``transformers`` model, through its ``AttentionInterface``.

``transformers`` (5.x) models call attention as a function chosen by name (``config._attn_implementation``)
with the model's own projected, position-encoded Q, K, V and mask. :func:`register_attention` registers one of
clusterformer's mechanisms under a name, with its options bound, so that

    name = clusterformer.hf.register_attention("cluster-retrieval", budget=0.1)   # -> "clusterformer-cluster-retrieval"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)
    # or: model.set_attn_implementation(name)

runs it in every layer, in ``forward`` and in ``generate()`` with the model's ``DynamicCache``. Importing
``clusterformer.hf`` registers every mechanism with its default options as ``clusterformer-<mechanism>``;
registering again with options (under the default name or your own ``name=``) is the one way to set them.

Mechanisms. The attention registry is the one list (:func:`interface_mechanisms`: the registered mechanisms
whose ``interface_mode`` says how to run them on a model's own Q, K, V), and its options dataclasses are the one
place options are validated (the options a pretrained model decides -- projection bias, attention dropout,
centroid ownership -- are refused). By mode:

* ``"dense"`` (``full``): softmax attention (SDPA) honouring any mask the model builds (causal, padding,
  sliding, packed).
* ``"sequence"`` (``clustered``, ``improved-clustered``): the mechanism's forward on the model's queries. It
  cannot honour a causal mask over several queries (a cluster's centroid query mixes positions): a decoder's
  prefill raises ``ValueError`` unless ``causal="dense"`` (an option of this interface) runs causal calls
  densely. A decoding step has one query per head, and a cluster of one query is that query: it is exact,
  computed densely.
* ``"cache"`` (``cluster-retrieval``, ``sink-window``; :mod:`clusterformer.attention.retrieval`): long-context
  decoding over the model's cache. A prefill (no cached keys before the queries) is dense; every call with
  cached keys (``generate()``'s steps, or a prompt fed in chunks) reads the cache sparsely; with the option
  ``prefill_block`` the prefill too is read sparsely, block by block (the sparse prefill; under its own budget
  with ``prefill_budget``). Cluster retrieval's key index belongs to the cache it indexes: it is kept in a table
  keyed weakly by the objects themselves -- the ``transformers`` cache, the registered name's runner, the
  attention module -- so it dies with any of them, and two models, prompts or option sets never see each other's
  index (an index also records the options it was built under, and a reader with other options rebuilds it).
  ``transformers`` does not pass the cache to the attention function: a call finds it where the attention
  module's ``forward`` holds it, its ``cache`` (``past_key_values``) argument, in that forward's frame on the
  call stack (:func:`_call_cache`). Nothing is added to the model, its modules or its masks: no hook, no
  attribute. A call's cache is the calling thread's own, so threads that share one model, each with its own
  cache, never cross (one cache must not be read by two threads at once, as for ``transformers`` itself).
  A call whose cache is unknown (the function called outside a module's forward) builds an index for that call
  alone. Without a cache (``generate(use_cache=False)``) every call is a prefill, hence dense (or, with
  ``prefill_block``, a sparse prefill).

Decoders: grouped-query attention (fewer key/value heads than query heads, ``module.num_key_value_groups``) is
handled without repeating the cache (queries are grouped by their key/value head); RoPE is already in Q and K;
left padding (how ``generate()`` batches prompts) is honoured per sequence. The mask ``transformers`` builds
for these names is its SDPA mask (registered in ``AttentionMaskInterface`` beside the function); it is read
back once into the library's typed mask, :class:`~clusterformer.masks.AttentionMask` (key padding, True =
padding, + causal: :func:`read_mask`), which the mechanisms take from there on; a mask that is neither
(sliding window, packed sequences, a custom pattern) raises ``ValueError`` for every mechanism but ``full``.

Importing this module (as importing :mod:`clusterformer.hf` does) registers every mechanism under its default
name when ``transformers`` is installed (:func:`register_defaults`).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch import nn

from .._checks import check_choice
from ..attention.base import AttentionOptions, InnerAttention, layer_seed, option_fields
from ..attention.registry import Mechanism, build_inner, get, make_options, mechanisms
from ..masks import AttentionMask, cache_sdpa, masked_sdpa

__all__ = ["MODEL_OPTIONS", "PREFIX", "cache_state", "interface_mechanisms", "pretrained_options",
           "read_mask", "register_attention", "register_defaults", "registered"]

PREFIX = "clusterformer-"
MODEL_OPTIONS = ("bias", "dropout", "own_centroids")  # set by the pretrained model, not by the caller
_REGISTERED: dict[str, tuple[str, dict[str, Any]]] = {}


def interface_mechanisms() -> list[str]:
    """The registered mechanisms this interface can run on a model's own Q, K, V (those with an
    ``interface_mode``), sorted."""
    return [mech.name for mech in mechanisms() if mech.inner.interface_mode is not None]


def pretrained_options(mechanism: str, options: dict[str, Any]) -> AttentionOptions:
    """Validate ``options`` for ``mechanism`` with the registry (aliases allowed), refusing the options a pretrained
    model decides (:data:`MODEL_OPTIONS`): the one check :func:`register_attention` and
    :func:`clusterformer.hf.patch` share."""
    mech = get(mechanism)
    refused = sorted(set(options) & set(MODEL_OPTIONS))
    if refused:
        raise ValueError(f"option{'s' if len(refused) > 1 else ''} {', '.join(map(repr, refused))} cannot be set "
                         f"for {mechanism!r} in a pretrained model: the model decides "
                         f"{'them' if len(refused) > 1 else 'it'}")
    settable = sorted(set(option_fields(mech.options)) - set(MODEL_OPTIONS))
    unknown = sorted(set(options) - set(settable) - set(mech.options.ALIASES))
    if unknown:
        raise ValueError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} for "
                         f"{mechanism!r} in a pretrained model; it takes {', '.join(settable) or 'no options'}")
    return make_options(mechanism, options)


# The last mask read in each thread, (a weak reference to it, its version and shape, its AttentionMask): the layers
# of one forward share one mask, so it is read once per forward, not once per layer. Nothing is kept on the mask.
_LAST_MASK = threading.local()


def read_mask(attention_mask: torch.Tensor | None, q_len: int, kv_len: int, batch: int,
              is_causal: bool) -> AttentionMask:
    """The :class:`~clusterformer.masks.AttentionMask` behind the mask a model hands its attention function.

    ``None`` means no padding: causal if the module is (``is_causal``) and there is more than one query. A
    4-D mask (B, 1, Lq, n), boolean (True = may attend) or additive float, must be key padding alone or key
    padding and lower-right causal (:meth:`AttentionMask.from_allowed`, where the model's keep mask becomes the
    library's padding, the one flip on this path); anything else raises ``ValueError``. The layers of one
    forward share one mask tensor: the answer for the last mask read in this thread is remembered (beside a weak
    reference to the tensor and its version, so that another tensor, or this one changed in place, is read
    again), so a forward reads its mask once, not once per layer."""
    if attention_mask is None:
        return AttentionMask(None, bool(is_causal) and q_len > 1)
    key = (attention_mask._version, q_len, kv_len, batch)
    last = getattr(_LAST_MASK, "entry", None)
    if last is not None and last[0]() is attention_mask and last[1] == key:
        return last[2]
    if attention_mask.dim() != 4 or attention_mask.shape[0] != batch or tuple(attention_mask.shape[2:]) != (
            q_len, kv_len):
        raise ValueError(f"attention_mask must be (B, 1, Lq, n) = ({batch}, 1, {q_len}, {kv_len}); got "
                         f"{tuple(attention_mask.shape)}")
    allowed = _allowed(attention_mask)
    if attention_mask.shape[1] > 1 and not bool((allowed == allowed[:, :1]).all()):
        raise ValueError("attention_mask differs between heads: clusterformer's mechanisms take one mask for all "
                         "heads")
    try:
        mask = AttentionMask.from_allowed(allowed[:, 0])
    except ValueError as error:
        raise ValueError(f"attention_mask: {error}: only the 'full' mechanism can honour it") from None
    _LAST_MASK.entry = (weakref.ref(attention_mask), key, mask)
    return mask


def _allowed(attention_mask: torch.Tensor) -> torch.Tensor:
    """A ``transformers`` 4-D mask as an allowed tensor (True = the query may attend): boolean as it is, additive
    float where it is not (close to) the dtype's minimum."""
    if attention_mask.dtype == torch.bool:
        return attention_mask
    return attention_mask > torch.finfo(attention_mask.dtype).min / 2


def register_attention(mechanism: str = "cluster-retrieval", *, name: str | None = None, **options: Any) -> str:
    """Register ``mechanism`` with ``options`` in ``transformers``' attention and mask interfaces; returns the
    name to pass as ``attn_implementation`` (default ``"clusterformer-<mechanism>"``; registering again under a
    name replaces its options). Options are the registry's (:func:`clusterformer.attention.describe`), validated
    here, plus ``causal`` ("refuse" or "dense") for the ``"sequence"`` mechanisms: unknown or out-of-range ones
    raise ``ValueError``."""
    check_choice("mechanism", mechanism, tuple(interface_mechanisms()))
    name = PREFIX + mechanism if name is None else name
    if not isinstance(name, str) or not name or any(c in name for c in "/|: "):
        raise ValueError(f"name must be a non-empty string without '/', '|', ':' or spaces; got {name!r}")
    mech = get(mechanism)
    settings = dict(options)
    causal_calls = settings.pop("causal", "refuse")
    if mech.inner.interface_mode == "sequence":
        check_choice("causal", causal_calls, ("refuse", "dense"))
    elif causal_calls != "refuse":
        raise ValueError(f"option 'causal' belongs to the mechanisms that cannot honour a causal mask "
                         f"({', '.join(n for n in interface_mechanisms() if get(n).inner.interface_mode == 'sequence')}"
                         f"); {mechanism!r} is causal by construction")
    runner = _Runner(name, mech, pretrained_options(mechanism, settings), causal_calls)
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, runner.function())
    AttentionMaskInterface.register(name, sdpa_mask)
    _REGISTERED[name] = (mechanism, dict(options))
    return name


def registered() -> dict[str, tuple[str, dict[str, Any]]]:
    """Names registered by clusterformer -> (mechanism, options)."""
    return dict(_REGISTERED)


# What a cache-reading mechanism keeps with a cache (cluster retrieval's key index): per cache object, then per
# runner (a registered name's options), then per attention module, each keyed weakly by the object itself (never by
# its id(), which a new object may reuse): the index dies with the cache, the runner or the module.
_CACHE_STATE: weakref.WeakKeyDictionary[Any, weakref.WeakKeyDictionary[_Runner, weakref.WeakKeyDictionary[
    nn.Module, Any]]] = weakref.WeakKeyDictionary()
_CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value")  # its name in transformers >= 5.24, and before
_FORWARD_DEPTH = 4  # frames above the attention function where its module's forward may be


def cache_state(cache: Any) -> dict[tuple[str, nn.Module], Any]:
    """What clusterformer keeps with ``cache`` (a ``transformers`` cache object): cluster retrieval's key index
    per (registered name, attention module); empty for a cache it has not read. For inspection."""
    return {(runner.name, module): state for runner, modules in list(_CACHE_STATE.get(cache, {}).items())
            for module, state in list(modules.items())}


def _call_cache(module: nn.Module, caller: FrameType | None) -> Any:
    """The cache the current call of ``module`` reads, or None (no cache, or no forward of ``module`` calling):
    the ``cache`` (``past_key_values``) argument of ``module.forward``, found in its frame -- the frame whose
    ``self`` is ``module`` -- among the few above ``caller`` (the frame that called the attention function).
    ``transformers``' attention modules call the function from their forward, holding the cache there."""
    frame = caller
    for _ in range(_FORWARD_DEPTH):
        if frame is None:
            return None
        if frame.f_code.co_varnames[:1] == ("self",) and frame.f_locals.get("self") is module:
            arguments = frame.f_locals
            return next((arguments[name] for name in _CACHE_ARGUMENTS if arguments.get(name) is not None), None)
        frame = frame.f_back
    return None


class _Runner:
    """What one registered name runs: a mechanism from the registry with validated options and the policy for
    causal calls. The inner attentions it builds for a model's attention modules are kept in a table keyed
    weakly by those modules (never stored on them)."""

    def __init__(self, name: str, mechanism: Mechanism, options: AttentionOptions, causal_calls: str) -> None:
        self.name, self.mechanism, self.options, self.causal_calls = name, mechanism, options, causal_calls
        self.mode = mechanism.inner.interface_mode
        self._inners: weakref.WeakKeyDictionary[nn.Module, InnerAttention] = weakref.WeakKeyDictionary()

    def inner(self, module: nn.Module, heads: int, head_dim: int) -> InnerAttention:
        """The mechanism for ``module``: seeded per layer (``layer_idx``), as :func:`clusterformer.hf.patch`
        seeds the layers it replaces, and in the module's training mode."""
        inner = self._inners.get(module)
        if inner is None or inner.heads != heads or inner.head_dim != head_dim:
            options = self.options
            layer = getattr(module, "layer_idx", None)
            if getattr(options, "seed", None) is not None and layer is not None:
                options = dataclasses.replace(options, seed=layer_seed(options.seed, int(layer)))
            inner = build_inner(self.mechanism.name, dim=heads * head_dim, heads=heads,
                                **dataclasses.asdict(options))
            self._inners[module] = inner
        if inner.training != module.training:  # nn.Module.train() walks the children: only on a change
            inner.train(module.training)
        return inner

    def function(self) -> Callable[..., tuple[torch.Tensor, None]]:
        """The function to register in ``AttentionInterface``."""
        name = self.mechanism.name

        def clusterformer_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                                    value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                                    scaling: float | None = None, is_causal: bool | None = None,
                                    **kwargs: Any) -> tuple[torch.Tensor, None]:
            if kwargs.get("softcap") is not None:
                raise ValueError(f"{name!r} does not support attention logit soft-capping (softcap)")
            H, D, Hkv = query.shape[1], query.shape[3], key.shape[1]
            if H % Hkv:
                raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({Hkv})")
            scale = float(scaling) if scaling is not None else D ** -0.5
            causal = getattr(module, "is_causal", False) if is_causal is None else bool(is_causal)
            if self.mode == "dense":
                out = self.dense(query, key, value, attention_mask, causal, scale, dropout)
            elif dropout > 0:
                raise ValueError(f"{name!r} has no attention dropout; put the model in eval mode (model.eval())")
            elif self.mode == "sequence":
                mask = read_mask(attention_mask, query.shape[2], key.shape[2], query.shape[0], causal)
                out = self.sequence(module, query, key, value, mask, scale)
            else:
                mask = read_mask(attention_mask, query.shape[2], key.shape[2], query.shape[0], causal)
                out = self.cache(module, query, key, value, mask, scale, _call_cache(module, sys._getframe(1)))
            return out.transpose(1, 2).contiguous(), None

        clusterformer_attention.__qualname__ = clusterformer_attention.__name__ = f"clusterformer_{name}"
        return clusterformer_attention

    @staticmethod
    def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None,
              causal: bool, scale: float, dropout: float) -> torch.Tensor:
        """Softmax attention under the model's own mask, whatever its pattern; zeros for a query with no key."""
        if attention_mask is None:
            return cache_sdpa(q, k, v, AttentionMask(None, causal), scale=scale, dropout_p=dropout)
        return masked_sdpa(q, k, v, _allowed(attention_mask), scale=scale, dropout_p=dropout,
                           enable_gqa=q.shape[1] != k.shape[1])

    def sequence(self, module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mask: AttentionMask, scale: float) -> torch.Tensor:
        """The mechanism's forward on a sequence attending to itself (one query per head: exact, dense)."""
        _B, H, Lq, D = q.shape
        if Lq == 1 or (mask.causal and self.causal_calls == "dense"):
            return cache_sdpa(q, k, v, mask, scale=scale)
        if mask.causal:
            raise ValueError(f"{self.mechanism.name!r} cannot honour a causal mask over several queries (a "
                             f"cluster's centroid query mixes positions); register it with causal='dense' to run "
                             f"a decoder's causal calls densely")
        if Lq != k.shape[2]:
            raise ValueError(f"{self.mechanism.name!r} attends a sequence to itself; got {Lq} queries for "
                             f"{k.shape[2]} keys")
        rep = H // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = self.inner(module, H, D)(q * (scale * D ** 0.5), k, v, mask)  # the inner scales by D^-1/2
        if mask.padding is not None:  # outputs at padded positions are zeros
            out = out.masked_fill(mask.padding[:, None, :, None], 0.0)
        return out

    def cache(self, module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: AttentionMask, scale: float, cache: Any) -> torch.Tensor:
        """The mechanism's reading of a decoder's cache (``cache``, the call's own, or None when unknown), with the
        state it keeps beside that cache."""
        Lq, n = q.shape[2], k.shape[2]
        if not mask.causal and Lq > 1:
            raise ValueError(f"{self.mechanism.name!r} attends causally over a decoder's cache; this call is "
                             "bidirectional (an encoder): use 'full', 'clustered' or 'improved-clustered'")
        table = None
        if cache is not None:
            table = _CACHE_STATE.setdefault(cache, weakref.WeakKeyDictionary()).setdefault(
                self, weakref.WeakKeyDictionary())
        layer = getattr(module, "layer_idx", None)
        previous = None if table is None or Lq == n else table.get(module)  # a prefill starts the cache afresh
        out, state = self.inner(module, q.shape[1], q.shape[3]).attend_cache(
            q, k, v, mask, scale, previous, None if layer is None else int(layer))
        if table is not None and state is not None:
            table[module] = state
        elif table is not None and Lq == n:  # a dense prefill leaves no index: none from an earlier prompt either
            table.pop(module, None)
        return out


def register_defaults() -> None:
    """Register every mechanism under ``clusterformer-<mechanism>`` with its default options (done on import of
    this module, hence of :mod:`clusterformer.hf`, when ``transformers`` is installed)."""
    for mechanism in interface_mechanisms():
        register_attention(mechanism)


try:  # transformers is an optional dependency: without it, the interface is unavailable
    import transformers  # noqa: F401
except ImportError:  # pragma: no cover - the hf extra is installed in CI
    pass
else:
    register_defaults()
