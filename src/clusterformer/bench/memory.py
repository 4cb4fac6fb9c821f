"""Peak memory of live tensors on any device, counted exactly (CPU has no ``max_memory_allocated``).

The process's resident-set peak, which the CPU benchmark also reports, mixes in the allocator's caching and
the kernel's page accounting, and moves by tens of MB between identical runs. :class:`TensorMemoryTracker`
counts instead the bytes of every tensor storage that a PyTorch operator creates while it is active (through
a ``TorchDispatchMode``, so autograd's backward ops are seen too) and subtracts them when the storage is
freed: the same quantity as ``torch.cuda.max_memory_allocated`` without the allocator's rounding, and
identical from run to run. Storages that existed before the tracker started (parameters, the input) are
not counted. Tracking slows every op; use it for a separate, untimed pass.
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["TensorMemoryTracker", "training_pass_memory"]


class TensorMemoryTracker(TorchDispatchMode):
    """``with TensorMemoryTracker() as m: ...`` then ``m.peak_bytes`` (most bytes alive at once) and
    ``m.current_bytes`` (still alive at exit) of the storages created inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}
        self.current_bytes = 0
        self.peak_bytes = 0

    def _freed(self, key: int) -> None:
        size = self._live.pop(key, None)
        if size is not None:
            self.current_bytes -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {storage.data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
                  for storage in _storages(t)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            for storage in _storages(t):
                self._created(storage, inputs)
        return out

    def _created(self, storage: torch.UntypedStorage, inputs: set[int]) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._live or key in inputs:  # a view, an in-place op, an out= argument
            return
        self._live[key] = size
        self.current_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        weakref.finalize(storage, self._freed, key)


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind a tensor: its own, or a sparse tensor's index and value tensors' (a sparse tensor has
    no storage of its own; ops/key_lists.py builds CSR matrices)."""
    if t.layout == torch.strided:
        return [t.untyped_storage()]
    if t.layout == torch.sparse_coo:
        parts = [t._indices(), t._values()]
    elif t.layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = [t.crow_indices(), t.col_indices(), t.values()]
    elif t.layout in (torch.sparse_csc, torch.sparse_bsc):
        parts = [t.ccol_indices(), t.row_indices(), t.values()]
    else:
        return []
    return [part.untyped_storage() for part in parts]


def training_pass_memory(layer: torch.nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """One training pass of ``layer`` on ``x`` (forward, backward of ``out.pow(2).sum()``), tracked: (bytes of the
    tensors it created still alive after the forward -- what autograd keeps for the backward, plus the output --,
    the most alive at once over forward and backward). The gradients are left in ``x.grad`` and the parameters'."""
    layer.train()
    with TensorMemoryTracker() as tracker:
        out = layer(x)
        gc.collect()  # a freed graph's tensors count as gone only once their storages are collected
        kept = tracker.current_bytes
        out.pow(2).sum().backward()
    return kept, tracker.peak_bytes
