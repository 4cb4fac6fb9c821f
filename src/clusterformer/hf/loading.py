"""Loading a pretrained model of :data:`~clusterformer.data.pretrained.PRETRAINED` with ``transformers``,
offline: safetensors for ``minilm``, a de-quantised GGUF file for ``smollm2``."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch
from torch import nn

from ..data.pretrained import GGUF_FILES, pretrained_path

__all__ = ["load_pretrained"]


def load_pretrained(name: str = "minilm", device: str | torch.device = "cpu",
                    attn_implementation: str | None = None) -> tuple[nn.Module, Any]:
    """(model in eval mode, fast tokenizer) of pretrained ``name``, loaded from local files only: no network
    access is attempted (``HF_HUB_OFFLINE`` is set for the call).

    ``minilm``: a ``BertModel``. ``smollm2``: a ``LlamaForCausalLM`` (30 layers, 9 query / 3 key-value heads,
    head size 64, 8,192 positions), de-quantised from its 4-bit GGUF file to float32 (about 20 s on 2 cores);
    ``attn_implementation`` picks its attention (``"sdpa"`` by default, or a name from
    :func:`~clusterformer.hf.register_attention`)."""
    path = pretrained_path(name)
    try:
        import transformers
    except ImportError:
        raise ValueError("the transformers package is needed: pip install 'clusterformer[hf]'") from None
    extra: dict[str, Any] = {"local_files_only": True}
    if name in GGUF_FILES:
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
