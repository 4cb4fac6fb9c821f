"""Where datasets are looked for."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["resolve_data_dir"]


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """The data directory: ``data_dir`` if given, else ``$CLUSTERFORMER_DATA``, else the user cache
    (``$XDG_CACHE_HOME/clusterformer/data``, default ``~/.cache/clusterformer/data``).

    Raises ValueError when the chosen directory does not exist, naming where it came from."""
    if data_dir is not None:
        path, source = Path(data_dir), "--data-dir"
    elif os.environ.get("CLUSTERFORMER_DATA"):
        path, source = Path(os.environ["CLUSTERFORMER_DATA"]), "$CLUSTERFORMER_DATA"
    else:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        path, source = cache / "clusterformer" / "data", "the default cache directory"
    if not path.is_dir():
        raise ValueError(f"data directory {str(path)!r} (from {source}) does not exist")
    return path
