"""Checkpoints that are never half-written and never lose the last good one.

``save_checkpoint(directory, state)`` writes ``checkpoint.pt.tmp``, flushes it to disk, links the current
``checkpoint.pt`` (if any) to ``checkpoint.prev.pt`` and renames the temporary file over ``checkpoint.pt``; each
rename is atomic, so a crash at any point leaves a complete ``checkpoint.pt`` -- the old one or the new one, never
none (moving the old one away first, as this did, left a moment with only ``checkpoint.prev.pt``, which
``--resume`` and ``compare`` do not read). ``load_checkpoint`` turns a missing, truncated or foreign file into a
``ValueError`` that names it and points at the previous checkpoint.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

__all__ = ["CHECKPOINT", "FORMAT", "load_checkpoint", "save_checkpoint"]

CHECKPOINT = "checkpoint.pt"
PREVIOUS = "checkpoint.prev.pt"
FORMAT = "clusterformer-train-v1"


def save_checkpoint(directory: str | Path, state: dict[str, Any]) -> Path:
    """Atomically write ``state`` (plus a format tag) to ``directory/checkpoint.pt``; keep the previous one."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final, previous, tmp = directory / CHECKPOINT, directory / PREVIOUS, directory / (CHECKPOINT + ".tmp")
    with open(tmp, "wb") as f:
        torch.save({"format": FORMAT, **state}, f)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():  # the previous one: a second name for the current file, then renamed into place
        linked = directory / (PREVIOUS + ".tmp")
        linked.unlink(missing_ok=True)
        try:
            os.link(final, linked)
        except OSError:  # a file system without hard links: a copy
            shutil.copyfile(final, linked)
        os.replace(linked, previous)
        linked.unlink(missing_ok=True)  # rename() does nothing when both names are already one file
    os.replace(tmp, final)
    _fsync_dir(directory)
    return final


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # not supported everywhere (e.g. some network file systems)
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint`; a directory means its ``checkpoint.pt``."""
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT
    if not path.is_file():
        raise ValueError(f"no checkpoint at {str(path)!r}")
    hint = ""
    if path.name == CHECKPOINT and (path.parent / PREVIOUS).is_file():
        hint = f"; the previous checkpoint {str(path.parent / PREVIOUS)!r} is intact and can be resumed from"
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # torch raises several types for truncated/corrupt zip archives
        problem = f"{type(exc).__name__}: {exc}"
        raise ValueError(f"checkpoint {str(path)!r} is corrupt or truncated ({problem}){hint}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} is not a clusterformer training checkpoint (format {FORMAT}){hint}")
    return state
