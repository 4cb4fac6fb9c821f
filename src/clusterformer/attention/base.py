"""What every attention layer shares: input checks, the Q/K/V and output projections, head reshapes,
padding handling and the auxiliary-loss slot.

The split follows fast-transformers: the layer owns the projections; *how* tokens are grouped is the
mechanism's business (``_attend``), built from the primitives in :mod:`clusterformer.ops`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from .._checks import check_bool, check_int, check_padding_mask, check_tensor

_REPLAYING = False


@contextlib.contextmanager
def replaying() -> Iterator[None]:
    """Context in which layers re-run a forward they already ran (the recompute of a reversible block).

    Stateful mechanisms (memory banks, EMA centroids, step counters) must not change their state inside
    it, so the recompute sees exactly what the original forward saw; see :meth:`AttentionLayer.stateful`.
    """
    global _REPLAYING
    previous, _REPLAYING = _REPLAYING, True
    try:
        yield
    finally:
        _REPLAYING = previous


def is_replaying() -> bool:
    """True inside :func:`replaying`."""
    return _REPLAYING


class SeededModule(nn.Module):
    """A module with its own CPU ``torch.Generator`` seeded by ``seed`` (None: no generator).

    The generator's state travels with ``state_dict`` (extra state), so a resumed run draws the same random
    numbers. :meth:`draw_generator` gives the generator to draw a forward's numbers from."""

    def __init__(self, seed: int | None = None) -> None:
        super().__init__()
        self.seed = seed
        self.generator: torch.Generator | None = None
        if seed is not None:
            self.generator = torch.Generator().manual_seed(seed)

    def get_extra_state(self) -> dict | None:
        return None if self.generator is None else {"generator": self.generator.get_state()}

    def set_extra_state(self, state: dict | None) -> None:
        if state is not None and self.generator is not None and "generator" in state:
            self.generator.set_state(state["generator"])

    def draw_generator(self) -> torch.Generator:
        """The module's own generator, advancing, in training; a fresh one seeded with ``seed`` in evaluation
        (so the same input gives the same output)."""
        if self.generator is None:
            raise RuntimeError(f"{type(self).__name__} was built without a seed")
        if self.training:
            return self.generator
        return torch.Generator().manual_seed(self.seed)


LAYER_SEED_STRIDE = 1_000_003  # a prime: layer seeds of nearby base seeds do not collide in practice


def layer_seed(seed: int, layer: int) -> int:
    """The seed of the ``layer``-th attention layer of a model built with ``seed`` (the Encoder's blocks, the
    layers :func:`clusterformer.hf.patch` replaces): distinct per layer, so hash rotations, hash planes and
    initial centroids differ between layers (as in the Reformer), and fixed by ``seed``."""
    return (seed + LAYER_SEED_STRIDE * layer) % 2**63


def apply_pending_updates(model: nn.Module) -> None:
    """Apply every attention layer's pending state update (EMA centroids) now instead of at its next training
    forward. The result is the same -- nothing else touches the state in between -- but the buffers, and so a
    checkpoint or an evaluation, then hold the state after the last step rather than one step old."""
    for module in model.modules():
        if isinstance(module, AttentionLayer):
            module.apply_pending_updates()


class AttentionLayer(SeededModule):
    """Multi-head self-attention layer: ``layer(x, key_padding_mask=None, causal=False)`` -> (B, N, dim).

    Subclasses implement :meth:`_attend` on (B, N, dim) inputs whose padded rows are already zero.

    Auxiliary losses. After each forward, :attr:`aux_losses` maps loss names (e.g. ``"clustering"``,
    ``"centroid_sorting"``) to scalar tensors of that call; mechanisms without auxiliary losses leave it
    empty. :func:`clusterformer.attention.collect_aux_losses` gathers them from a whole model; that is
    the one way auxiliary losses reach the training loss.

    Padding. Padded input rows are zeroed on entry (so their content, even NaN, cannot leak) and the
    outputs at padded positions are zero.

    Randomness. Mechanisms that draw random numbers (hash planes, rotations, initialisations) draw them
    from :attr:`generator`, a CPU ``torch.Generator`` seeded by their ``seed`` option, never from the
    global RNG; :meth:`draw_generator` gives a fresh generator seeded the same way in evaluation, so the
    same input gives the same output. Dropout uses the global RNG, as everywhere in PyTorch.

    State. Mechanisms whose forward updates buffers (EMA centroids, memory banks) apply those updates in
    training mode only and never inside :func:`replaying`; an update computed in one forward takes effect
    at the start of the next (see :meth:`apply_pending_updates`), so a reversible recompute in the backward
    sees the state its forward saw.
    """

    def __init__(self, dim: int, heads: int, *, bias: bool = True, shared_qk: bool = False,
                 seed: int | None = None) -> None:
        super().__init__(seed)
        check_int("dim", dim, minimum=1)
        check_int("heads", heads, minimum=1)
        if dim % heads:
            raise ValueError(f"dim must be divisible by heads; got dim={dim}, heads={heads}")
        self.dim = dim
        self.heads = heads
        self.head_dim = dim // heads
        self.shared_qk = shared_qk
        self.to_qkv = nn.Linear(dim, (2 if shared_qk else 3) * dim, bias=bias)
        self.to_out = nn.Linear(dim, dim, bias=bias)
        self.aux_losses: dict[str, torch.Tensor] = {}
        self._pending: dict[str, torch.Tensor] = {}

    def updates_state(self) -> bool:
        """Whether this forward may change buffers: training mode and not a reversible recompute."""
        return self.training and not is_replaying()

    def apply_pending_updates(self) -> None:
        """Copy the state updates computed by the last training forward into their buffers (called at the
        start of every training forward, and by :func:`apply_pending_updates` after each optimiser step)."""
        for name, value in self._pending.items():
            getattr(self, name).copy_(value)
        self._pending = {}

    def get_extra_state(self) -> dict | None:
        """The generator's state (if any) and any pending state update, so ``state_dict`` holds all state."""
        state = super().get_extra_state() or {}
        if self._pending:
            state["pending"] = {name: value.detach().clone() for name, value in self._pending.items()}
        return state or None

    def set_extra_state(self, state: dict | None) -> None:
        super().set_extra_state(state)
        self._pending = {} if state is None else {k: v.clone() for k, v in state.get("pending", {}).items()}

    def forward(
        self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None, causal: bool = False
    ) -> torch.Tensor:
        """Args: x (B, N, dim); key_padding_mask (B, N) bool, True = padding; causal: no attention to
        later positions. Returns (B, N, dim)."""
        x, key_padding_mask = self._prepare(x, key_padding_mask, causal)
        return self._finish(self._attend(x, key_padding_mask, causal), key_padding_mask)

    def _attend(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        raise NotImplementedError

    def _prepare(
        self, x: torch.Tensor, key_padding_mask: torch.Tensor | None, causal: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        check_tensor("x", x, ndim=3, floating=True)
        if x.shape[-1] != self.dim:
            raise ValueError(f"x must have shape (B, N, dim={self.dim}), got {tuple(x.shape)}")
        check_bool("causal", causal)
        key_padding_mask = check_padding_mask(key_padding_mask, x.shape[0], x.shape[1], device=x.device)
        if key_padding_mask is not None:
            x = x.masked_fill(key_padding_mask.unsqueeze(-1), 0.0)
        return x, key_padding_mask

    def _finish(self, y: torch.Tensor, key_padding_mask: torch.Tensor | None) -> torch.Tensor:
        if key_padding_mask is not None:
            y = y.masked_fill(key_padding_mask.unsqueeze(-1), 0.0)
        return y

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, N, dim) -> three (B, H, N, head_dim) tensors (with shared QK, q and k are the same tensor)."""
        B, N, _ = x.shape
        if self.shared_qk:
            qk, v = self.to_qkv(x).view(B, N, 2, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
            return qk, qk, v
        qkv = self.to_qkv(x).view(B, N, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return qkv[0], qkv[1], qkv[2]

    def project_out(self, heads_out: torch.Tensor) -> torch.Tensor:
        """(B, H, N, head_dim) -> (B, N, dim)."""
        B, H, N, D = heads_out.shape
        return self.to_out(heads_out.transpose(1, 2).reshape(B, N, H * D))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, heads={self.heads}"
