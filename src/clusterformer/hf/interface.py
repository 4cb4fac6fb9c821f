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

Mechanisms (:data:`MECHANISMS`):

* ``full``: softmax attention (SDPA) honouring any mask the model builds (causal, padding, sliding, packed).
* ``clustered``, ``improved-clustered``: the fast-transformers mechanisms on the model's queries (registry
  options: ``num_clusters``, ``bits``, ``iterations``, ``topk``, ``query_clustering``, ``seed``). They cannot
  honour a causal mask over several queries (a cluster's centroid query mixes positions): a decoder's prefill
  raises ``ValueError`` unless ``causal="dense"`` runs causal calls densely. A decoding step has one query
  per head, and a cluster of one query is that query: clustered attention is then exact, computed densely.
* ``cluster-retrieval``: long-context decoding over the model's cache (:mod:`clusterformer.ops.retrieval`):
  sinks + recent window + the keys of the clusters each query ranks best, up to ``budget``; optionally the
  rest estimated from the clusters' centroids (``estimate_remainder=True``). Prefill (no cached keys before
  the queries) is dense SDPA; every call with cached keys (``generate()``'s steps, or a prompt fed in chunks)
  retrieves. The key index lives on each attention module (``module.clusterformer_index``), is built at the
  first step after a prefill, extended as keys leave the window, rebuilt every ``refresh`` keys, and rebuilt
  from the cache whenever the cache is not the one it indexed (a new prompt, a reordered batch). Without a cache
  (``generate(use_cache=False)``) every call is a prefill, hence dense.
* ``sink-window``: StreamingLLM at the same budget: the first ``sink`` tokens + the most recent ones.

Decoders: grouped-query attention (fewer key/value heads than query heads, ``module.num_key_value_groups``) is
handled without repeating the cache (queries are grouped by their key/value head); RoPE is already in Q and K;
left padding (how ``generate()`` batches prompts) is honoured per sequence. The mask ``transformers`` builds
for these names is its SDPA mask (registered in ``AttentionMaskInterface`` beside the function); it is read
back as key padding + causal (:func:`read_mask`), and a mask that is neither (sliding window, packed
sequences, a custom pattern) raises ``ValueError`` for every mechanism but ``full``.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .._checks import check_choice
from ..attention.base import layer_seed
from ..attention.registry import build_inner, make_options
from ..ops.retrieval import JOIN_BATCH, RetrievalOptions, build_index, extend_index, retrieval_attention

__all__ = ["MECHANISMS", "PREFIX", "MaskStructure", "read_mask", "register_attention", "registered"]

MECHANISMS = ("full", "clustered", "improved-clustered", "cluster-retrieval", "sink-window")
PREFIX = "clusterformer-"
INDEX_ATTRIBUTE = "clusterformer_index"
_REGISTERED: dict[str, tuple[str, dict[str, Any]]] = {}


@dataclass(frozen=True)
class MaskStructure:
    """What a ``transformers`` attention mask asks for, when it is key padding + (optionally) causal.

    padding: (B, n) bool, True = a padding key, or None. causal: query i (of Lq) sits at position n - Lq + i and
    sees keys at positions <= its own (lower-right aligned, as with a cache); False: every real key."""

    padding: torch.Tensor | None
    causal: bool


_last_read: tuple[Any, int, MaskStructure] | None = None  # (weakref to a mask, its version, its structure)


def read_mask(attention_mask: torch.Tensor | None, q_len: int, kv_len: int, batch: int,
              is_causal: bool) -> MaskStructure:
    """The :class:`MaskStructure` behind the mask a model hands its attention function.

    ``None`` means no padding: causal if the module is (``is_causal``) and there is more than one query. A
    4-D mask (B, 1, Lq, n), boolean (True = may attend) or additive float, must be key padding alone or key
    padding and lower-right causal; anything else raises ``ValueError``. The layers of one forward share one
    mask: the last one read is remembered, so it is checked once per forward, not once per layer."""
    global _last_read
    if attention_mask is None:
        return MaskStructure(None, bool(is_causal) and q_len > 1)
    if _last_read is not None and _last_read[0]() is attention_mask and _last_read[1] == attention_mask._version:
        return _last_read[2]
    if attention_mask.dim() != 4 or attention_mask.shape[0] != batch or tuple(attention_mask.shape[2:]) != (
            q_len, kv_len):
        raise ValueError(f"attention_mask must be (B, 1, Lq, n) = ({batch}, 1, {q_len}, {kv_len}); got "
                         f"{tuple(attention_mask.shape)}")
    if attention_mask.dtype == torch.bool:
        allowed = attention_mask
    else:
        allowed = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    if attention_mask.shape[1] > 1 and not bool((allowed == allowed[:, :1]).all()):
        raise ValueError("attention_mask differs between heads: clusterformer's mechanisms take one mask for all "
                         "heads")
    allowed = allowed[:, 0]
    keys = allowed[:, -1, :]  # the last query sees every real key in both patterns
    causal_pattern = (torch.arange(kv_len, device=allowed.device)
                      <= (kv_len - q_len + torch.arange(q_len, device=allowed.device)).unsqueeze(1))
    if q_len > 1 and torch.equal(allowed, keys.unsqueeze(1) & causal_pattern):
        structure = MaskStructure(None if bool(keys.all()) else ~keys, True)
    elif torch.equal(allowed, keys.unsqueeze(1).expand_as(allowed)):
        structure = MaskStructure(None if bool(keys.all()) else ~keys, False)
    else:
        raise ValueError("attention_mask is neither key padding nor key padding + causal (a sliding-window, "
                         "packed-sequence or custom mask): only the 'full' mechanism can honour it")
    _last_read = (weakref.ref(attention_mask), attention_mask._version, structure)
    return structure


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, structure: MaskStructure, scale: float,
                    dropout: float = 0.0) -> torch.Tensor:
    """SDPA of q (B, H, Lq, D) on k, v (B, Hkv, n, D) under ``structure``; (B, H, Lq, D), zeros on rows with no
    key (padded queries)."""
    Lq, n = q.shape[2], k.shape[2]
    mask, is_causal = None, False
    if structure.padding is not None or (structure.causal and Lq != n):
        mask = torch.ones(1, 1, 1, n, dtype=torch.bool, device=q.device)
        if structure.padding is not None:
            mask = ~structure.padding[:, None, None, :]
        if structure.causal:
            pos = torch.arange(n, device=q.device)
            mask = mask & (pos <= (n - Lq + torch.arange(Lq, device=q.device)).unsqueeze(1))
    else:
        is_causal = structure.causal
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal,
                                         scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out if mask is None else torch.nan_to_num(out, nan=0.0)


def _attention_options(mechanism: str, options: dict[str, Any]) -> tuple[Any, str]:
    """Validated options of ``mechanism`` and what to do with causal calls ("refuse" or "dense")."""
    options = dict(options)
    causal = options.pop("causal", "refuse")
    if mechanism in ("clustered", "improved-clustered"):
        check_choice("causal", causal, ("refuse", "dense"))
        for name in ("bias", "dropout", "own_centroids"):
            if name in options:
                raise ValueError(f"option {name!r} cannot be set here: the pretrained model decides it")
        return make_options(mechanism, options), causal
    if causal != "refuse":
        raise ValueError(f"option 'causal' belongs to clustered and improved-clustered; {mechanism!r} is causal by "
                         "construction")
    if mechanism == "full":
        if options:
            raise ValueError(f"'full' takes no options; got {', '.join(sorted(options))}")
        return None, causal
    if mechanism == "sink-window":
        unknown = sorted(set(options) - {"budget", "sink", "dense_layers"})
        if unknown:
            raise ValueError(f"unknown option{'s' if len(unknown) > 1 else ''} for 'sink-window': "
                             f"{', '.join(unknown)} (it takes budget, sink and dense_layers)")
        return RetrievalOptions(clusters=0, window=0, **options), causal
    fields = {f.name for f in dataclasses.fields(RetrievalOptions)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(f"unknown option{'s' if len(unknown) > 1 else ''} for 'cluster-retrieval': "
                         f"{', '.join(unknown)} (it takes {', '.join(sorted(fields))})")
    retrieval = RetrievalOptions(**options)
    if retrieval.clusters == 0:
        raise ValueError("clusters must be >= 1 for cluster-retrieval (use 'sink-window' for none)")
    return retrieval, causal


def register_attention(mechanism: str = "cluster-retrieval", *, name: str | None = None, **options: Any) -> str:
    """Register ``mechanism`` with ``options`` in ``transformers``' attention and mask interfaces; returns the
    name to pass as ``attn_implementation`` (default ``"clusterformer-<mechanism>"``; registering again under a
    name replaces its options). Options are validated here: unknown or out-of-range ones raise ``ValueError``."""
    check_choice("mechanism", mechanism, MECHANISMS)
    name = PREFIX + mechanism if name is None else name
    if not isinstance(name, str) or not name or any(c in name for c in "/|: "):
        raise ValueError(f"name must be a non-empty string without '/', '|', ':' or spaces; got {name!r}")
    parsed, causal = _attention_options(mechanism, options)
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, _make_function(mechanism, parsed, causal))
    AttentionMaskInterface.register(name, sdpa_mask)
    _REGISTERED[name] = (mechanism, dict(options))
    return name


def registered() -> dict[str, tuple[str, dict[str, Any]]]:
    """Names registered by clusterformer -> (mechanism, options)."""
    return dict(_REGISTERED)


def _make_function(mechanism: str, options: Any, causal_calls: str) -> Callable[..., tuple[torch.Tensor, None]]:
    def clusterformer_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                                scaling: float | None = None, is_causal: bool | None = None,
                                **kwargs: Any) -> tuple[torch.Tensor, None]:
        if kwargs.get("softcap") is not None:
            raise ValueError(f"{mechanism!r} does not support attention logit soft-capping (softcap)")
        B, H, Lq, D = query.shape
        Hkv, n = key.shape[1], key.shape[2]
        if H % Hkv:
            raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({Hkv})")
        scale = float(scaling) if scaling is not None else D ** -0.5
        causal = getattr(module, "is_causal", False) if is_causal is None else bool(is_causal)
        structure = read_mask(attention_mask, Lq, n, B, causal)
        if mechanism == "full":
            out = dense_attention(query, key, value, structure, scale, dropout)
        elif dropout > 0:
            raise ValueError(f"{mechanism!r} has no attention dropout; put the model in eval mode (model.eval())")
        elif mechanism in ("clustered", "improved-clustered"):
            out = _clustered(module, mechanism, options, causal_calls, query, key, value, structure, scale)
        else:
            out = _retrieval(module, options, query, key, value, structure, scale)
        return out.transpose(1, 2).contiguous(), None

    clusterformer_attention.__qualname__ = clusterformer_attention.__name__ = f"clusterformer_{mechanism}"
    return clusterformer_attention


def _clustered(module: torch.nn.Module, mechanism: str, options: Any, causal_calls: str, q: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor, structure: MaskStructure, scale: float) -> torch.Tensor:
    _B, H, Lq, D = q.shape
    if Lq == 1 or (structure.causal and causal_calls == "dense"):
        return dense_attention(q, k, v, structure, scale)  # one query is its own cluster: exact
    if structure.causal:
        raise ValueError(f"{mechanism!r} cannot honour a causal mask over several queries (a cluster's centroid "
                         f"query mixes positions); register it with causal='dense' to run a decoder's causal "
                         f"calls densely")
    if Lq != k.shape[2]:
        raise ValueError(f"{mechanism!r} attends a sequence to itself; got {Lq} queries for {k.shape[2]} keys")
    layer = getattr(module, "layer_idx", None)
    if options.seed is not None and layer is not None:  # each layer its own hash planes, as hf.patch gives them
        options = dataclasses.replace(options, seed=layer_seed(options.seed, int(layer)))
    inner = getattr(module, "clusterformer_inner", None)
    if inner is None or inner.options != options or inner.heads != H:
        inner = build_inner(mechanism, dim=H * D, heads=H, **dataclasses.asdict(options))
        module.clusterformer_inner = inner
    inner.train(module.training)
    rep = H // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = inner(q * (scale * D ** 0.5), k, v, key_padding_mask=structure.padding)  # the inner scales by D^-1/2
    if structure.padding is not None:
        out = out.masked_fill(structure.padding[:, None, :, None], 0.0)
    return out


def _retrieval(module: torch.nn.Module, options: RetrievalOptions, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, structure: MaskStructure, scale: float) -> torch.Tensor:
    Lq, n = q.shape[2], k.shape[2]
    if not structure.causal and Lq > 1:
        raise ValueError("cluster retrieval attends causally over a decoder's cache; this call is bidirectional "
                         "(an encoder): use 'full', 'clustered' or 'improved-clustered'")
    real_or_none = None if structure.padding is None else ~structure.padding
    covered = (options.keys_allowed_count(n) >= n if real_or_none is None
               else options.covers(real_or_none.sum(1)))
    dense_layer = (getattr(module, "layer_idx", None) or 0) < options.dense_layers
    if Lq == n or covered or dense_layer:
        return dense_attention(q, k, v, structure, scale)  # a prefill, a budget that covers the cache, a low layer
    index = None
    if options.clusters > 0:
        end = max(0, n - max(options.window, Lq))
        index = getattr(module, INDEX_ATTRIBUTE, None)
        if index is None or not index.follows(k) or index.end > end:
            index = build_index(k, v, real_or_none, end, options)
        elif end - index.end >= JOIN_BATCH:  # keys leave the window in batches; until then the window is wider
            index = extend_index(index, k, v, real_or_none, end, options)
        else:
            index.length = n
        setattr(module, INDEX_ATTRIBUTE, index)
    return retrieval_attention(q, k, v, real_or_none, index, options, scale)


def register_defaults() -> None:
    """Register every mechanism under ``clusterformer-<mechanism>`` with its default options (done on import of
    :mod:`clusterformer.hf` when ``transformers`` is installed)."""
    for mechanism in MECHANISMS:
        register_attention(mechanism)
