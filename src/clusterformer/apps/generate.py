"""``clusterformer generate``: continue a prompt with a trained character language model, streaming characters.

The model is rebuilt from a ``clusterformer train --task shakespeare-char`` checkpoint alone (its config and the
saved character vocabulary; no data is read) and decodes with its attention cache when every layer is strictly
causal (:meth:`clusterformer.models.LanguageModel.generate`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

from ..models.lm import LanguageModel

__all__ = ["CharacterLM", "load_character_lm"]


@dataclasses.dataclass
class CharacterLM:
    """A trained character language model and its vocabulary (character i + 1 is token i + 1; 0 is padding)."""

    model: LanguageModel
    chars: list[str]
    context: int  # the context length it was trained at
    attention: str

    @property
    def decodes(self) -> bool:
        """Every attention layer has cached decoding (strictly causal)."""
        from ..attention import InnerAttention

        return all(m.decodes and m.options.causal_semantics() == "strict"
                   for m in self.model.modules() if isinstance(m, InnerAttention))

    def encode(self, text: str) -> torch.Tensor:
        index = {c: i + 1 for i, c in enumerate(self.chars)}
        unknown = sorted(set(text) - set(index))
        if unknown:
            raise ValueError(f"prompt holds characters the model's vocabulary lacks: {unknown[:10]}")
        return torch.tensor([index[c] for c in text], dtype=torch.long)

    def decode(self, tokens: torch.Tensor) -> str:
        return "".join(self.chars[t - 1] for t in tokens.tolist() if t > 0)

    def generate(self, prompt: str, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int = 0, use_cache: bool = True,
                 on_text: Callable[[str], None] | None = None) -> str:
        """The continuation of ``prompt`` (``max_new_tokens`` characters); ``on_text`` gets each as it comes."""
        if not prompt:
            raise ValueError("prompt must hold at least one character")
        if use_cache and not self.decodes:
            raise ValueError(f"this model's attention ({self.attention}) is not strictly causal, so it has no cached "
                             "decoding; pass --no-cache (use_cache=False) to recompute the causal forward per token")
        tokens = self.encode(prompt).unsqueeze(0)
        generator = torch.Generator().manual_seed(seed)
        stream = None if on_text is None else (lambda t: on_text(self.decode(t)))
        out = self.model.generate(tokens, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                  top_p=top_p, generator=generator, use_cache=use_cache, on_tokens=stream)
        return self.decode(out[0])


def load_character_lm(path: str | Path) -> CharacterLM:
    """Rebuild the language model of a ``--task shakespeare-char`` run directory or checkpoint file, in eval mode."""
    from ..train.loop import build_model, load_run
    from ..train.tasks import LanguageModelTask

    state, config = load_run(path)
    if config.task != "shakespeare-char":
        raise ValueError(f"{str(path)!r} is a {config.task!r} run; generate needs a character language model "
                         "(clusterformer train --task shakespeare-char)")
    chars = state["tokenizer"].split("\x00")
    empty = torch.zeros(0, dtype=torch.long)
    task = LanguageModelTask("shakespeare-char", empty, empty, len(chars) + 1, state["tokenizer"], config.max_len)
    model = build_model(config, task)
    model.load_state_dict(state["model"])
    return CharacterLM(model.eval(), chars, config.max_len, config.attention)
