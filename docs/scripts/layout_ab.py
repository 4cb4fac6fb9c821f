"""Trained runs' training step with q, k, v as strided views of the fused projection, against a split of q, k, v
into contiguous tensors (docs/speed-and-memory.md#cluster-select-its-kernels-and-its-training-step).

Each run's model is loaded twice: as the library builds it (``ops/heads.py``: the kernels read the projection's
views in place and write their gradients into its layout) and with the previous layout patched in -- the split by
view + permute + unbind (whose backward stacks the three gradients, then transposes the stack), and q, k, v made
contiguous before the mechanism runs. The models take the same training steps as ``step_time_ab.py``'s, in turn in
one process, after a warm-up; medians of the repeats, relative to the first model. The machine's drift between runs
(several percent here) cancels in one process; it does not between two runs of different code.

    OMP_NUM_THREADS=1 python docs/scripts/layout_ab.py RUN_DIR [RUN_DIR ...] [--repeats 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import types
from pathlib import Path

import torch

from clusterformer.attention.base import AttentionLayer
from clusterformer.train.loop import load_trained


def _unbind_split(self: AttentionLayer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AttentionLayer.qkv before ops/heads.py (no shared QK in these models)."""
    B, N, _ = x.shape
    return self.to_qkv(x).view(B, N, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)


def with_previous_layout(model: torch.nn.Module) -> torch.nn.Module:
    """The model with each attention layer's split and its mechanism's inputs as they were."""
    for layer in model.modules():
        if isinstance(layer, AttentionLayer):
            if layer.shared_qk:
                raise ValueError("layout_ab.py times models without shared QK")
            layer.qkv = types.MethodType(_unbind_split, layer)
            forward = layer.inner.forward
            layer.inner.forward = lambda q, k, v, *args, _forward=forward, **kwargs: _forward(
                q.contiguous(), k.contiguous(), v.contiguous(), *args, **kwargs)
    return model


def _step_time_ab() -> types.ModuleType:
    """step_time_ab.py beside this script (its timed training step), loaded by path: docs/scripts is no package."""
    spec = importlib.util.spec_from_file_location("step_time_ab", Path(__file__).with_name("step_time_ab.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run directories; the first one's current layout is the reference")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    models = []
    for run in args.runs:
        for layout in ("strided views", "previous"):
            model, task, config, _ = load_trained(run)
            models.append((with_previous_layout(model) if layout == "previous" else model, task, config,
                           f"{run} ({layout})"))

    medians = _step_time_ab().interleaved_medians([(model, task, config) for model, task, config, _ in models],
                                                  args.repeats)
    print(f"training step (forward with auxiliary losses, backward), median of {args.repeats}, "
          f"threads={torch.get_num_threads()}:")
    for (_, _, _, label), median in zip(models, medians, strict=True):
        print(f"  {median:7.3f} s  {median / medians[0]:6.3f}x  {label}")


if __name__ == "__main__":
    main()
