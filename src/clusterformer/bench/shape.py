"""What the layer and decoding benchmarks share: the shape of the attention they time and where it runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True)
class LayerShape:
    """The attention a benchmark times: ``batch`` sequences of ``heads`` heads of ``head_dim`` channels, on
    ``device`` in ``dtype`` with ``threads`` CPU threads (None: torch's default), each mechanism built with its
    ``options`` (name -> build options) and ``seed``; ``cuda_graph`` also times the steps replayed from a CUDA
    graph."""

    batch: int = 1
    heads: int = 4
    head_dim: int = 64
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = None
    options: dict[str, dict[str, Any]] = field(default_factory=dict)  # per-mechanism build options
    seed: int = 0
    cuda_graph: bool = False
