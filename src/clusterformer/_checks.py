"""Argument validation shared by the whole package.

Every public entry point checks its inputs with these helpers so that bad input fails early with a
``ValueError`` that names the argument and says what was expected, instead of a shape error from
deep inside a matmul.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def check_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    """``value`` must be a Python int (bools are rejected) and at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_float(
    name: str, value: Any, *, minimum: float | None = None, maximum: float | None = None,
    exclusive_minimum: bool = False, exclusive_maximum: bool = False,
) -> float:
    """``value`` must be a real number in the given range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if value != value:  # NaN
        raise ValueError(f"{name} must be a number, got NaN")
    if minimum is not None and (value <= minimum if exclusive_minimum else value < minimum):
        op = ">" if exclusive_minimum else ">="
        raise ValueError(f"{name} must be {op} {minimum}, got {value}")
    if maximum is not None and (value >= maximum if exclusive_maximum else value > maximum):
        op = "<" if exclusive_maximum else "<="
        raise ValueError(f"{name} must be {op} {maximum}, got {value}")
    return value


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def check_options(cls: type[T], options: dict[str, Any], what: str) -> T:
    """``cls(**options)`` for an options dataclass, refusing unknown names with a ``ValueError`` that names
    ``what`` (e.g. "task option ... for mlm") and the valid ones; the dataclass checks the values."""
    valid = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - valid)
    if unknown:
        raise ValueError(f"unknown {what}{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                         f"valid: {', '.join(sorted(valid))}")
    return cls(**options)


def check_tensor(
    name: str, value: Any, *, ndim: int | tuple[int, ...] | None = None, floating: bool = False,
) -> torch.Tensor:
    """``value`` must be a tensor with one of the given ranks (and a floating dtype if asked)."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else ndim
        if value.dim() not in allowed:
            want = " or ".join(f"{d}-D" for d in allowed)
            raise ValueError(f"{name} must be {want}, got {value.dim()}-D with shape {tuple(value.shape)}")
    if floating and not value.is_floating_point():
        raise ValueError(f"{name} must have a floating-point dtype, got {value.dtype}")
    return value


def check_padding_mask(
    mask: Any, batch: int, length: int, *, name: str = "key_padding_mask", device: torch.device | None = None,
) -> torch.Tensor | None:
    """A key padding mask is ``None`` or a bool tensor of shape (batch, length); True marks padding."""
    if mask is None:
        return None
    check_tensor(name, mask, ndim=2)
    if mask.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor (True marks padding), got dtype {mask.dtype}")
    if tuple(mask.shape) != (batch, length):
        raise ValueError(f"{name} must have shape (batch, length) = {(batch, length)}, got {tuple(mask.shape)}")
    if device is not None and mask.device != device:
        raise ValueError(f"{name} is on {mask.device} but the input is on {device}")
    return mask
