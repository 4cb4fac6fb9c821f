"""Heads as views of the fused projection, and gradients written straight back into its layout.

An attention layer projects x (B, N, dim) to q, k and v with one linear map, (B, N, P * H * D) for P parts (3, or 2
with shared QK). Each part's heads, (B, H, N, D), are then a strided view of it: row stride P H D, head stride D,
unit stride along D. Kernels that read rows with any stride (the fused CPU kernels of :mod:`listed_attention` and
:mod:`spherical`) take these views in place; before, each made them contiguous (a copy of q, k and v per layer) and
the gradients came back as three (B, H, N, D) tensors that autograd stacked, then transposed into the projection's
layout (two more passes over all three). Here:

- :func:`split_heads` returns the P views through an autograd function whose backward hands the projection its
  gradient in its own layout: with no copy when the three gradients already are the thirds of one buffer of
  :func:`gradient_buffers` (a part whose gradient was summed with another -- k's, with the clustering's commitment
  gradient -- is copied into its slot), else in one pass.
- :func:`gradient_buffers` allocates the gradients of such views as the slots of one buffer in the projection's
  layout; :func:`empty_heads` an output in the (B, N, H, D) order the heads are joined in (their join is then a
  view).

The layouts change no value: every kernel reads and writes the same numbers at other addresses.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["empty_heads", "gradient_buffers", "split_heads", "unit_rows"]

# set on the buffers gradient_buffers allocates: their slots hold nothing but the gradients of one split's parts,
# so split_heads' backward may write a part's gradient into its slot
_OWNED = "_clusterformer_gradient_buffer"


class _SplitHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, packed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.shape = packed.shape
        return tuple(packed[:, :, p].transpose(1, 2) for p in range(packed.shape[2]))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> torch.Tensor:  # materialised: a part no loss read gets zeros
        buffer = _common_buffer(grads, ctx.shape)
        if buffer is None:
            buffer = grads[0].new_empty(ctx.shape)
        for p, grad in enumerate(grads):
            slot = buffer[:, :, p].transpose(1, 2)
            if not _is_view(grad, slot):
                slot.copy_(grad)
        return buffer


def _is_view(tensor: torch.Tensor, of: torch.Tensor) -> bool:
    """Whether ``tensor`` addresses exactly the elements of ``of``."""
    return (tensor.data_ptr() == of.data_ptr() and tensor.shape == of.shape and tensor.stride() == of.stride()
            and tensor.dtype == of.dtype)


def _common_buffer(grads: tuple[torch.Tensor, ...], shape: torch.Size) -> torch.Tensor | None:
    """The gradient_buffers buffer (B, N, P, H, D) whose first slot the first gradient is, or None."""
    base = grads[0]._base
    if base is None or not getattr(base, _OWNED, False) or base.shape != shape:
        return None
    return base if _is_view(grads[0], base[:, :, 0].transpose(1, 2)) else None


def split_heads(projected: torch.Tensor, parts: int, heads: int) -> tuple[torch.Tensor, ...]:
    """The fused projection (B, N, parts * heads * D) -> its ``parts`` views (B, H, N, D), strided, not copied;
    their gradients come back in the projection's layout (no stack and transpose; see the module docstring)."""
    B, N, width = projected.shape
    if width % (parts * heads):
        raise ValueError(f"projected's last dim {width} is not parts={parts} x heads={heads} x head_dim")
    return _SplitHeads.apply(projected.view(B, N, parts, heads, width // (parts * heads)))


def unit_rows(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself where its last dim has unit stride (what the fused kernels read in place), else a
    contiguous copy."""
    return tensor if tensor.shape[-1] <= 1 or tensor.stride(-1) == 1 else tensor.contiguous()


def empty_heads(B: int, H: int, N: int, D: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised (B, H, N, D) tensor laid out as (B, N, H, D): joining its heads, ``.transpose(1, 2)
    .flatten(2)``, is a view."""
    return like.new_empty(B, N, H, D).transpose(1, 2)


def gradient_buffers(*parts: torch.Tensor, zero: tuple[bool, ...]) -> tuple[torch.Tensor, ...]:
    """Uninitialised gradients for ``parts`` (B, H, L, D) -- zero-filled where ``zero`` says so. When the parts are
    the consecutive views :func:`split_heads` made of one projection, they are the slots of one buffer in its layout,
    which that split's backward returns as it is; otherwise each is laid out as (B, L, H, D)."""
    if len(zero) != len(parts):
        raise ValueError(f"zero must say for each of the {len(parts)} parts whether to zero it; got {zero!r}")
    if not _consecutive_slots(parts):
        return tuple(empty_heads(*part.shape, like=part).zero_() if fill else empty_heads(*part.shape, like=part)
                     for part, fill in zip(parts, zero, strict=True))
    B, H, L, D = parts[0].shape
    buffer = parts[0].new_empty(B, L, len(parts), H, D)
    setattr(buffer, _OWNED, True)
    for p, fill in enumerate(zero):
        if fill:  # in memory order, not through the slot's transposed view (~1.6x slower)
            buffer[:, :, p].zero_()
    return tuple(buffer[:, :, p].transpose(1, 2) for p in range(len(parts)))


def _consecutive_slots(parts: tuple[torch.Tensor, ...]) -> bool:
    """Whether ``parts`` (B, H, L, D) are p = 0, 1, ... of one (B, L, P, H, D) layout: equal shapes and strides
    (L stride P H D, H stride D, unit D stride), each starting H D elements after the one before."""
    first = parts[0]
    if first.dim() != 4:
        return False
    _, H, L, D = first.shape
    P = len(parts)
    expected = (L * P * H * D, D, P * H * D, 1)
    step = H * D * first.element_size()
    return all(part.shape == first.shape and part.dtype == first.dtype and part.device == first.device
               and part.stride() == expected and part.data_ptr() == first.data_ptr() + p * step
               for p, part in enumerate(parts))
