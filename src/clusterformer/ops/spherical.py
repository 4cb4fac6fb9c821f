"""Online spherical k-means' per-token step, fused on the CPU: the nearest unit centroid of each key, the key's
squared distance to it and the per-cluster sums of the unit keys.

Routing and cluster-select assign every key to its nearest centroid (Roy et al. 2021, section 4.1: mini-batch
spherical k-means), publish the commitment loss -- the mean of ||u - mu_id||^2, whose gradient pulls the
projections towards their centroids -- and move the centroids by an exponential moving average of their members.
For k (B, H, N, D), unit centroids mu (H, C, D) and an optional bias (H, C) (cluster-select's load balancing),
with u = k / max(|k|, 1e-12) (``F.normalize``):

    ids[b, h, n]    = argmax_c (u . mu[h, c] + bias[h, c])       (the first of equal maxima, as ``torch.argmax``)
    gap[b, h, n]    = ||u - mu[h, ids]||^2                        (differentiable in k)
    sums[h, c]      = sum of u over the real tokens with ids = c   (no gradient)
    counts[h, c]    = their number

Why a kernel of its own. As tensor operations these are a dozen passes over (B, H, N, D) -- the normalisation,
the cosines, the gathered centroids, the difference, its square, the sums by ``index_add_`` -- and as many in the
backward through the normalisation: about 0.3 s of a 4,096-token MQAR training step of 6 s on one core, at two
layers (docs/speed-and-memory.md#cluster-select-its-kernels-and-its-training-step). Here the forward reads each key
once (the cosines vectorised over the clusters) and the backward once more, recomputing u; the distance's gradient
through the normalisation is written out:

    dk = g (2 / max(|k|, eps)) ((u - mu_id) - [|k| >= eps] u (u . (u - mu_id)))

:func:`spherical_assignment_reference` is the same function by tensor operations -- the definition the tests hold
the kernel to, and the path on CUDA, in half precision or without a compiler (``CLUSTERFORMER_NO_EXTENSIONS=1``).
The kernel is C++ (``csrc/spherical_assignment.cpp``), built on first use like the key-list kernel
(:mod:`clusterformer.ops.extensions`).

Batch invariance: a token's id, gap and gradient depend on that token and the centroids alone (its cosines and
norm summed in a fixed order over d), never on what else is in the batch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..clustering.kmeans import cluster_sums
from .extensions import CppExtension
from .heads import unit_rows

__all__ = ["SphericalAssignment", "spherical_assignment", "spherical_assignment_reference",
           "spherical_extension_available"]

_KERNEL = CppExtension("spherical_assignment", "the fused spherical assignment")
EPS = 1e-12  # F.normalize's


class SphericalAssignment(NamedTuple):
    """Each key's nearest unit centroid and the statistics of the assignment (module docstring)."""

    ids: torch.Tensor  # (B, H, N) int64
    gap: torch.Tensor  # (B, H, N) ||u - mu_id||^2, differentiable in the keys
    sums: torch.Tensor  # (H, C, D) per cluster the sum of its real tokens' unit keys (no gradient)
    counts: torch.Tensor  # (H, C) per cluster its number of real tokens


def spherical_extension_available() -> bool:
    """Whether the fused kernel is built (building it now if it was not)."""
    return _KERNEL.available()


def spherical_assignment(k: torch.Tensor, centroids: torch.Tensor, *, bias: torch.Tensor | None = None,
                         real: torch.Tensor | None = None) -> SphericalAssignment:
    """The nearest unit centroid of each key, the squared distance to it and the per-cluster sums (module
    docstring).

    Args:
        k: keys (B, H, N, D), float.
        centroids: unit centroids (H, C, D), converted to ``k``'s dtype.
        bias: (H, C) added to the cosines before the argmax (not to ``gap``), or None.
        real: (B, N) bool, the tokens counted in ``sums`` and ``counts`` (padding excluded), or None (all).

    The fused C++ kernel for float32/float64 CPU tensors where it builds, else
    :func:`spherical_assignment_reference`; the two agree to rounding (tests/ops/test_spherical.py).
    """
    _check(k, centroids, bias, real)
    mu = centroids.detach().to(k.dtype).contiguous()
    bias = None if bias is None else bias.detach().to(k.dtype).contiguous()
    if k.device.type == "cpu" and k.dtype in (torch.float32, torch.float64) and _KERNEL.available():
        empty = k.new_empty(0)
        ids, gap, sums, counts = _Assign.apply(unit_rows(k), mu, empty if bias is None else bias,
                                               k.new_empty(0, dtype=torch.bool) if real is None else real.contiguous())
        return SphericalAssignment(ids, gap, sums.sum(0), counts.sum(0))
    return spherical_assignment_reference(k, mu, bias=bias, real=real)


def spherical_assignment_reference(k: torch.Tensor, centroids: torch.Tensor, *, bias: torch.Tensor | None = None,
                                   real: torch.Tensor | None = None) -> SphericalAssignment:
    """:func:`spherical_assignment` by tensor operations (the definition; any device and dtype)."""
    _check(k, centroids, bias, real)
    B, H, N, D = k.shape
    mu = centroids.detach().to(k.dtype)
    unit = F.normalize(k, dim=-1)
    cosines = torch.einsum("bhnd,hcd->bhnc", unit.detach(), mu)
    if bias is not None:
        cosines = cosines + bias.detach().to(k.dtype)[None, :, None, :]
    ids = cosines.argmax(-1)
    gap = (unit - mu[torch.arange(H, device=k.device)[None, :, None], ids]).pow(2).sum(-1)
    valid = None if real is None else real[:, None, :].expand(B, H, N).transpose(0, 1).reshape(H, B * N)
    sums, counts = cluster_sums(unit.detach().transpose(0, 1).reshape(H, B * N, D),
                                ids.transpose(0, 1).reshape(H, B * N), mu.shape[1], valid)
    return SphericalAssignment(ids, gap, sums, counts)


def _check(k: torch.Tensor, centroids: torch.Tensor, bias: torch.Tensor | None, real: torch.Tensor | None) -> None:
    if k.dim() != 4 or not k.is_floating_point():
        raise ValueError(f"k must be a float tensor (B, H, N, D); got {k.dtype} {tuple(k.shape)}")
    B, H, N, D = k.shape
    if centroids.dim() != 3 or centroids.shape[0] != H or centroids.shape[2] != D or centroids.shape[1] < 1:
        raise ValueError(f"centroids must be (H, C, D) = ({H}, C >= 1, {D}); got {tuple(centroids.shape)}")
    if bias is not None and tuple(bias.shape) != (H, centroids.shape[1]):
        raise ValueError(f"bias must be (H, C) = ({H}, {centroids.shape[1]}); got {tuple(bias.shape)}")
    if real is not None and (real.dtype != torch.bool or tuple(real.shape) != (B, N)):
        raise ValueError(f"real must be a bool tensor (B, N) = ({B}, {N}); got {real.dtype} {tuple(real.shape)}")


class _Assign(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, k: torch.Tensor, mu: torch.Tensor, bias: torch.Tensor, real: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        ids, gap, sums, counts = _KERNEL.load().assign(k.detach(), mu, bias, real, EPS)
        ctx.save_for_backward(k, mu, ids)
        ctx.mark_non_differentiable(ids, sums, counts)
        return ids, gap, sums, counts

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, _ids: Any, grad_gap: torch.Tensor | None, _sums: Any, _counts: Any
                 ) -> tuple[torch.Tensor | None, None, None, None]:
        k, mu, ids = ctx.saved_tensors
        if grad_gap is None or not ctx.needs_input_grad[0]:
            return None, None, None, None
        return _KERNEL.load().gap_backward(k.detach(), mu, ids, grad_gap.contiguous(), EPS), None, None, None
