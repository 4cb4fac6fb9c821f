"""Sorted-chunk attention alone, three ways, on CUDA: the fused Triton kernel, SDPA over key-window views
(the unfused path), and FlexAttention with a block mask in sorted order (issue: "measure both").

``python -m clusterformer.bench.chunk_kernels --lengths 8192,32768 --dtype bfloat16 --json out.json``

Inputs are already in sorted order (what the layers hand to the op): (B, H, N, D) with chunks of
w = ceil(N / round(sqrt(N))) and look-back 1 (wrapping), no padding. Times are CUDA-event medians of
forward + backward of ``out.sum()``; FlexAttention's block mask is built once outside the timing (its build
time is reported separately) and ``flex_attention`` is compiled with ``torch.compile``. Peak memory is
``torch.cuda.max_memory_allocated`` above the inputs.
"""

from __future__ import annotations

import argparse
import json
import math

import torch


def _time(fn) -> float:
    from .attention import _median_ms

    return _median_ms(fn, 3, 10, torch.cuda.synchronize, cuda=True)


def _peak(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def run(length: int, dtype: torch.dtype, heads: int = 4, head_dim: int = 64) -> list[dict]:
    from ..ops.layouts import sorted_layout
    from ..ops.windows import windowed_attention

    k_clusters = max(1, round(math.sqrt(length)))
    w = math.ceil(length / k_clusters)
    n_c = math.ceil(length / w)
    ids = (torch.arange(length, device="cuda") // w).unsqueeze(0)  # already sorted: chunk c = cluster c
    layout = sorted_layout(ids, w, 1)
    R, W = layout.rows.numel(), layout.num_windows
    x = torch.randn(R, 3, heads, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    records = []

    def windowed(kernel):
        def step():
            q = layout.query_rows(x[:, 0]).view(W, w, heads, head_dim).transpose(1, 2)
            windowed_attention(q, x[:, 1], x[:, 2], layout, kernel=kernel).sum().backward()
            x.grad = None
        return step

    for kernel in ("fused", "sdpa"):
        step = windowed(kernel)
        records.append({"method": kernel, "length": length, "chunk": w, "fwd_bwd_ms": _time(step),
                        "peak_mem_mb": _peak(step)})

    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:  # pragma: no cover - old torch
        return records
    flex = torch.compile(flex_attention)
    padded = n_c * w
    y = torch.randn(3, 1, heads, padded, head_dim, device="cuda", dtype=dtype, requires_grad=True)

    def mask_mod(b, h, q_idx, kv_idx):
        cq, ck = q_idx // w, kv_idx // w
        return ((ck == cq) | (ck == (cq + n_c - 1) % n_c)) & (kv_idx < length)

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    try:  # compiled: the eager build materialises the dense (N, N) mask (128 GiB at N = 131,072 on an H100)
        block_mask = create_block_mask(mask_mod, None, None, padded, padded, device="cuda", _compile=True)
    except torch.OutOfMemoryError as error:
        records.append({"method": "flex", "length": length, "chunk": w, "error": str(error)[:200]})
        return records
    end.record()
    end.synchronize()
    build_ms = start.elapsed_time(end)

    def flex_step():
        flex(y[0], y[1], y[2], block_mask=block_mask).sum().backward()
        y.grad = None

    records.append({"method": "flex", "length": length, "chunk": w, "fwd_bwd_ms": _time(flex_step),
                    "peak_mem_mb": _peak(flex_step), "block_mask_build_ms": build_ms})
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="8192,32768,131072")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json")
    args = parser.parse_args()
    records = []
    for length in (int(n) for n in args.lengths.split(",")):
        for r in run(length, getattr(torch, args.dtype)):
            r |= {"dtype": args.dtype, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
            print(json.dumps(r), flush=True)
            records.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
