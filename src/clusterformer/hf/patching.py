"""Patching a pretrained BERT-family encoder: its self-attention modules replaced in place by
:class:`PatchedSelfAttention`, which runs a mechanism of the attention registry on the model's own projections
(see :mod:`clusterformer.hf` for what can be patched and how)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ..attention import AttentionOptions
from ..attention.base import attend_padded, layer_seed
from ..attention.registry import build_inner, mechanisms
from ..masks import AttentionMask
from .interface import pretrained_options, read_mask

__all__ = ["PatchedSelfAttention", "encoder_attention_mask", "key_padding_from_hf_mask", "patch", "patchable",
           "patched_modules", "unpatch", "validate_patch_options"]

_ORIGINALS = "_clusterformer_originals"  # on a patched model: {name: the original module}, None once unpatched


def patchable() -> list[str]:
    """The registered mechanisms :func:`patch` accepts: those that work on separate Q and K projections (every
    mechanism but the shared-QK ones: a pretrained model's queries and keys are different projections) of a
    sequence attending to itself (not the ones that only change how a decoder reads its cache)."""
    return [mech.name for mech in mechanisms() if not mech.shared_qk and mech.inner.interface_mode != "cache"]


def validate_patch_options(attention: str, options: dict[str, Any]) -> AttentionOptions:
    """Validate ``options`` for ``attention`` with the registry (aliases allowed); the options the pretrained
    model decides (projection bias, attention dropout, centroid ownership) are refused."""
    if attention not in patchable():
        raise ValueError(f"attention must be one of {', '.join(patchable())} (mechanisms that work on separate "
                         f"Q and K projections); got {attention!r}")
    return pretrained_options(attention, options)


def encoder_attention_mask(attention_mask: torch.Tensor | None, batch: int, length: int) -> AttentionMask:
    """The :class:`~clusterformer.masks.AttentionMask` (key padding, not causal) behind the mask ``transformers``
    hands an encoder's self-attention: built once here, at the entry, and passed down as it is.

    Accepts None, a 2-D (B, N) mask (1/True = token), or a 4-D (B, 1 or H, N, N) mask, boolean (True =
    may attend) or additive float (0 = may attend, a large negative number = masked). A 4-D mask whose
    rows differ (causal or custom masks) is not key padding: ``ValueError``."""
    if attention_mask is None:
        return AttentionMask(None)
    if attention_mask.dim() == 2:
        if tuple(attention_mask.shape) != (batch, length):
            raise ValueError(f"attention_mask must have shape (B, N) = ({batch}, {length}), got "
                             f"{tuple(attention_mask.shape)}")
        return AttentionMask(~attention_mask.bool() if attention_mask.dtype == torch.bool else attention_mask == 0)
    if attention_mask.dim() != 4:
        raise ValueError(f"attention_mask must be (B, N) or (B, 1, N, N) with B={batch}, N={length}; got "
                         f"{tuple(attention_mask.shape)}")
    try:  # the reader the AttentionInterface functions use
        mask = read_mask(attention_mask, length, length, batch, is_causal=False)
    except ValueError as error:
        raise ValueError(f"patched attention supports key-padding masks only (bidirectional encoders): "
                         f"{error}") from None
    if mask.causal:
        raise ValueError("patched attention supports key-padding masks only (bidirectional encoders); the "
                         "attention_mask is causal")
    return mask


def key_padding_from_hf_mask(attention_mask: torch.Tensor | None, batch: int, length: int) -> torch.Tensor | None:
    """The (B, N) key-padding mask (True = padding) behind the mask ``transformers`` hands to self-attention:
    the padding of :func:`encoder_attention_mask` (None without padding)."""
    return encoder_attention_mask(attention_mask, batch, length).padding


class PatchedSelfAttention(nn.Module):
    """Drop-in for a BERT-family self-attention module: ``forward(hidden_states, attention_mask=None, ...)``
    -> (context (B, N, hidden), None). ``query``, ``key``, ``value`` are the original module's layers; the
    mechanism is :attr:`inner`, built by the attention registry, and this module is the
    :class:`~clusterformer.attention.QKVProjection` it projects through."""

    def __init__(self, original: nn.Module, attention: str, options: AttentionOptions) -> None:
        super().__init__()
        for name in ("query", "key", "value"):
            if not isinstance(getattr(original, name, None), nn.Linear):
                raise ValueError(f"cannot patch {type(original).__name__}: it has no nn.Linear {name!r}")
        self.query, self.key, self.value = original.query, original.key, original.value
        self.heads = int(original.num_attention_heads)
        self.head_dim = int(original.attention_head_size)
        dim = self.heads * self.head_dim
        if self.query.in_features != dim:
            raise ValueError(f"cannot patch {type(original).__name__}: hidden size {self.query.in_features} != "
                             f"heads x head size = {dim}")
        dropout = getattr(original, "dropout", None)
        if isinstance(dropout, nn.Dropout) and options.ATTENTION_DROPOUT:
            options = dataclasses.replace(options, dropout=float(dropout.p))
        self.attention = attention
        self.inner = build_inner(attention, dim=dim, heads=self.heads, **dataclasses.asdict(options))
        self.inner.init_for_pretrained()
        param = self.query.weight
        self.inner.to(device=param.device, dtype=param.dtype)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, N, _ = x.shape
        return tuple(layer(x).view(B, N, self.heads, self.head_dim).transpose(1, 2)
                     for layer in (self.query, self.key, self.value))

    def project_rows(self, rows: torch.Tensor, which: str) -> torch.Tensor:
        return {"q": self.query, "k": self.key, "v": self.value}[which](rows)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Any = None,
        encoder_hidden_states: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        # transformers >= 5.24 passes a cache as ``cache``; earlier 5.x releases as ``past_key_values`` (or
        # ``past_key_value``): refused under every name
        caches = [cache, kwargs.get("past_key_values"), kwargs.get("past_key_value")]
        if any(c is not None for c in caches) or encoder_hidden_states is not None:
            raise ValueError("patched attention supports encoder self-attention only (no key/value cache, no "
                             "cross-attention)")
        B, N, _ = hidden_states.shape
        mask = encoder_attention_mask(attention_mask, B, N)
        out, _ = attend_padded(hidden_states, mask.padding, lambda x: self.inner.attend_hidden(x, self, mask))
        return out, None  # the original module's output projection follows (attention.output)

    def extra_repr(self) -> str:
        return f"attention={self.attention!r}, heads={self.heads}, head_dim={self.head_dim}"


def _is_self_attention(module: nn.Module) -> bool:
    return (
        all(isinstance(getattr(module, n, None), nn.Linear) for n in ("query", "key", "value"))
        and hasattr(module, "num_attention_heads") and hasattr(module, "attention_head_size")
        and not getattr(module, "is_cross_attention", False) and "Cross" not in type(module).__name__
    )


def patch(model: nn.Module, attention: str = "improved-clustered", **options: Any) -> nn.Module:
    """Replace every self-attention of a BERT/RoBERTa-family ``model`` in place; returns ``model``.

    Args:
        model: a ``transformers`` encoder (e.g. ``BertModel``, ``RobertaModel``, ``BertForSequenceClassification``).
        attention: one of :func:`patchable`.
        **options: that mechanism's options (see :mod:`clusterformer.hf`); unknown ones raise ``ValueError``.

    Raises ``ValueError`` for a decoder model, a model that is already patched (call :func:`unpatch`
    first), or one with no self-attention module this function recognises."""
    opts = validate_patch_options(attention, options)
    config = getattr(model, "config", None)
    if getattr(config, "is_decoder", False):
        raise ValueError("patch supports encoders only; this model's config has is_decoder=True")
    if getattr(model, _ORIGINALS, None):
        raise ValueError("model is already patched; call clusterformer.hf.unpatch(model) first")
    targets = [(name, module) for name, module in model.named_modules() if _is_self_attention(module)]
    if not targets:
        raise ValueError(f"found no BERT-family self-attention (query/key/value nn.Linear + num_attention_heads) "
                         f"in {type(model).__name__}")
    originals: dict[str, nn.Module] = {}
    for index, (name, module) in enumerate(targets):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer_opts = opts
        if getattr(opts, "seed", None) is not None:  # a distinct seed per layer: different hash planes
            layer_opts = dataclasses.replace(opts, seed=layer_seed(opts.seed, index))
        replacement = PatchedSelfAttention(module, attention, layer_opts)
        replacement.train(module.training)
        setattr(parent, child, replacement)
        originals[name] = module
    object.__setattr__(model, _ORIGINALS, originals)  # a plain attribute: not part of state_dict
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Put the original self-attention modules back (their weights are the ones the patch used, so any
    fine-tuning of Q/K/V is kept; the added clustering parameters are dropped) and leave nothing of the patch on
    the model. Returns ``model``."""
    originals = getattr(model, _ORIGINALS, None)
    if not originals:
        raise ValueError("model is not patched")
    for name, module in originals.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, module)
    object.__delattr__(model, _ORIGINALS)
    return model


def patched_modules(model: nn.Module) -> list[PatchedSelfAttention]:
    """The :class:`PatchedSelfAttention` modules inside ``model``, in order."""
    return [m for m in model.modules() if isinstance(m, PatchedSelfAttention)]
