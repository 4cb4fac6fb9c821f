"""Sharing layer statistics across the processes of a distributed run.

Stateful mechanisms (routing's and kmeans' EMA centroids, Cluster-Former's memory bank) update their buffers
from the tokens of a training forward. Under data parallelism every rank sees a different slice of the global
batch; if each updated from its own slice the buffers would drift apart (and DistributedDataParallel's default
``broadcast_buffers=True`` would hide that by overwriting them with rank 0's, throwing the other ranks' data
away). Instead, the statistics are combined over all ranks before the update, so every rank applies the same
update, the one a single process would compute from the global batch.

The helpers are no-ops outside an initialised process group of more than one process. Inside one they are
collective: every rank must call them in the same order, which holds for training forwards under DDP (every
rank runs the same model on its slice) -- layers call them only while updating state (training mode, not
inside a reversible recompute), never in evaluation, which rank 0 may run alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["all_gather_rows", "all_reduce_sum", "world_size"]


def world_size() -> int:
    """Processes in the default process group (1 when there is none)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """The elementwise sum of ``t`` over all ranks (``t`` itself with one process). Not differentiable."""
    if world_size() == 1:
        return t
    total = t.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


def all_gather_rows(rows: torch.Tensor) -> torch.Tensor:
    """Every rank's rows (n_r, ...) concatenated in rank order, (sum_r n_r, ...): the rows one process holding
    the global batch would see (rank r trains on the r-th slice). ``rows`` itself with one process."""
    world = world_size()
    if world == 1:
        return rows
    rows = rows.detach().contiguous()
    count = torch.tensor([rows.shape[0]], device=rows.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count)
    longest = int(max(int(c) for c in counts))
    padded = F.pad(rows, (0, 0) * (rows.dim() - 1) + (0, longest - rows.shape[0]))
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return torch.cat([g[: int(c)] for g, c in zip(gathered, counts, strict=True)])
