"""A causal language model over any registered attention that supports ``causal=True``, and its generation.

Generation decodes with a cache when every layer's mechanism is strictly causal (``prefill`` once over the
prompt, then one ``step`` per new token: :meth:`clusterformer.models.Encoder.step`), or recomputes the causal
forward over the whole sequence for every new token (``use_cache=False``; the reference the cached path is
tested against, and the only way for a mechanism that is not strictly causal).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .._checks import check_float, check_int, check_padding_mask, check_tensor
from ..masks import real_lengths
from .encoder import Encoder, EncoderCache, EncoderConfig

__all__ = ["LanguageModel", "sample_next"]


class LanguageModel(nn.Module):
    """Encoder run with ``causal=True`` + a linear head: tokens (B, N) -> next-token logits (B, N, vocab).

    Token 0 is the embedding's padding index, never a token of the text: :meth:`generate` never samples it."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.encoder = Encoder(config)
        self.head = nn.Linear(config.dim, config.vocab_size)

    def forward(self, tokens: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.encoder(tokens, key_padding_mask, causal=True))

    def prefill(self, tokens: torch.Tensor, key_padding_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, EncoderCache]:
        """Logits (B, N, vocab) over a right-padded prompt batch, and the cache that continues it."""
        hidden, cache = self.encoder.prefill(tokens, key_padding_mask)
        return self.head(hidden), cache

    def step(self, tokens: torch.Tensor, cache: EncoderCache) -> tuple[torch.Tensor, EncoderCache]:
        """tokens (B,), each sequence's next token -> (next-token logits (B, vocab), cache updated in place)."""
        hidden, cache = self.encoder.step(tokens, cache)
        return self.head(hidden), cache

    @torch.no_grad()
    def generate(
        self, prompt: torch.Tensor, key_padding_mask: torch.Tensor | None = None, *, max_new_tokens: int,
        temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
        generator: torch.Generator | None = None, use_cache: bool = True,
        on_tokens: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Continue each prompt of a right-padded batch by ``max_new_tokens`` sampled tokens.

        Args:
            prompt: (B, N) long, at least one real token per sequence.
            key_padding_mask: (B, N) bool, True = padding, at the end of shorter prompts only.
            max_new_tokens: tokens to generate per sequence.
            temperature: divides the logits; 0 means greedy (argmax).
            top_k: sample among the k most likely tokens only.
            top_p: nucleus sampling: among the smallest set of tokens whose probability reaches top_p.
            generator: the random stream of the sampling (default: the global one).
            use_cache: decode with the cache (strictly causal mechanisms); False recomputes the whole causal
                forward for every token (O(N) forwards; the reference).
            on_tokens: called with each step's new tokens (B,) as they come (streaming).

        Returns:
            (B, max_new_tokens) long. The model must be in eval mode.
        """
        check_tensor("prompt", prompt, ndim=2)
        if prompt.is_floating_point() or prompt.dtype == torch.bool:
            raise ValueError(f"prompt must be an integer tensor, got dtype {prompt.dtype}")
        B, N = prompt.shape
        key_padding_mask = check_padding_mask(key_padding_mask, B, N, device=prompt.device)
        lengths = real_lengths(key_padding_mask, B, N, prompt.device)
        if B == 0 or bool((lengths == 0).any()):
            raise ValueError("prompt must hold at least one real token per sequence")
        check_int("max_new_tokens", max_new_tokens, minimum=0)
        check_float("temperature", temperature, minimum=0.0)
        if self.training:
            raise ValueError("generate needs eval mode (no dropout): call model.eval() first")
        new = prompt.new_zeros(B, max_new_tokens)
        if max_new_tokens == 0:
            return new
        if use_cache:
            logits, cache = self.prefill(prompt, key_padding_mask)
            last = logits[torch.arange(B, device=prompt.device), lengths - 1]
            for t in range(max_new_tokens):  # one token at a time: generation is sequential by nature
                new[:, t] = sample_next(last, temperature, top_k, top_p, generator)
                if on_tokens is not None:
                    on_tokens(new[:, t])
                if t + 1 < max_new_tokens:
                    last, cache = self.step(new[:, t], cache)
            return new
        tokens = torch.cat([prompt, new], dim=1)
        rows = torch.arange(B, device=prompt.device)
        for t in range(max_new_tokens):
            span = int(lengths.max()) + t
            mask = torch.arange(span, device=prompt.device) >= (lengths + t).unsqueeze(1)
            logits = self(tokens[:, :span], mask if bool(mask.any()) else None)
            new[:, t] = sample_next(logits[rows, lengths + t - 1], temperature, top_k, top_p, generator)
            tokens[rows, lengths + t] = new[:, t]
            if on_tokens is not None:
                on_tokens(new[:, t])
        return new


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of next-token logits (B, vocab): greedy at temperature 0, else sampled from
    softmax(logits / temperature) restricted to the top_k tokens and to the top_p nucleus. Token 0 (padding)
    is never chosen."""
    if top_k is not None:
        check_int("top_k", top_k, minimum=1)
    if top_p is not None:
        check_float("top_p", top_p, minimum=0.0, maximum=1.0, exclusive_minimum=True)
    logits = logits.float().clone()
    logits[:, 0] = float("-inf")  # the padding index is no token
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        outside = probs.cumsum(-1) - probs >= top_p  # tokens after the nucleus reached top_p
        logits = logits.masked_fill(outside.scatter(1, order, outside), float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)
