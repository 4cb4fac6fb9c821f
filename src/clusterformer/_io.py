"""Writing results: JSON files written atomically (a crash leaves the previous file, never half of one)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["emit_json", "read_json", "write_json"]


def read_json(path: str | Path, missing: str) -> Any:
    """The JSON in ``path``; ``ValueError(missing)`` when there is no such file, one naming the file when it is not
    valid JSON."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(missing)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None


def write_json(path: str | Path, record: Any) -> Path:
    """Write ``record`` as indented JSON to ``path`` (creating its folder) through a temporary file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def emit_json(record: Any, path: str | Path | None, log=None) -> None:
    """:func:`write_json` to ``path`` (then ``log("wrote PATH")``), or print to stdout without a path."""
    if path:
        write_json(path, record)
        if log is not None:
            log(f"wrote {path}")
    else:
        sys.stdout.write(json.dumps(record, indent=2) + "\n")
