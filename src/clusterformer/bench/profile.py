"""Where one mechanism's time goes: ``torch.profiler`` over an evaluation forward and a training step.

    python -m clusterformer.bench.profile --name neural-clustering --length 32768 --device cuda --dtype bf16

Same layer, input and modes as ``clusterformer bench attention`` (B = 1, 4 heads of 64 by default). Prints,
per mode, the operators with the most self time on the device (CUDA only) and on the host, after warm-up
runs: host time far above device time means the GPU waits on Python, launches or synchronisations.
"""

from __future__ import annotations

import argparse

import torch

from ..attention import build, collect_aux_losses
from .attention import DTYPE_ALIASES


def profile(name: str, length: int, device: str, dtype: str, heads: int, head_dim: int, warmup: int,
            rows: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.manual_seed(0)
    dim = heads * head_dim
    layer = build(name, dim=dim, heads=heads).to(device=device, dtype=getattr(torch, dtype))
    x = torch.randn(1, length, dim, device=device, dtype=getattr(torch, dtype), requires_grad=True)
    cuda = torch.device(device).type == "cuda"

    def forward() -> None:
        layer.eval()
        with torch.no_grad():
            layer(x)

    def training_step() -> None:
        layer.train()
        with collect_aux_losses():
            layer(x).sum().backward()
        x.grad = None
        layer.zero_grad(set_to_none=True)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for mode, step in (("eval forward", forward), ("training step", training_step)):
        for _ in range(warmup):
            step()
        if cuda:
            torch.cuda.synchronize()
        with torch_profile(activities=activities) as prof:
            step()
            if cuda:
                torch.cuda.synchronize()
        print(f"== {name}, N={length}, {dtype}, {mode}")
        averages = prof.key_averages()
        for key in (("self_cuda_time_total", "self_cpu_time_total") if cuda else ("self_cpu_time_total",)):
            print(averages.table(sort_by=key, row_limit=rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rows", type=int, default=15)
    args = parser.parse_args()
    dtype = DTYPE_ALIASES.get(args.dtype, args.dtype)
    if not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"--dtype: unknown dtype {args.dtype!r}")
    profile(args.name, args.length, args.device, dtype, args.heads, args.head_dim, args.warmup, args.rows)


if __name__ == "__main__":
    main()
