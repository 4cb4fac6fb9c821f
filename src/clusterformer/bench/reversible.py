"""Activation memory of a whole encoder against depth, with and without reversible blocks.

Each (mode, depth) runs in a fresh process (as in :mod:`clusterformer.bench.attention`); the peak is the rise
of the resident-set high-water mark (CPU) or of ``torch.cuda.max_memory_allocated`` (CUDA) during one
forward + backward, above what the model, its gradients' first allocation and the input already used (one
untimed step runs first, so parameter gradients exist before the measured step).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from .attention import _median_ms, _peak_rss_mb

__all__ = ["ReversibleBenchConfig", "run_reversible_benchmark"]


@dataclass
class ReversibleBenchConfig:
    depths: list[int]
    attention: str = "neural-clustering"
    options: dict[str, Any] = field(default_factory=dict)
    length: int = 4096
    batch: int = 1
    dim: int = 256
    heads: int = 4
    tied: bool = False
    device: str = "cpu"
    repeats: int = 3
    seed: int = 0


def run_reversible_benchmark(config: ReversibleBenchConfig, progress: Callable[[str], None] | None = None) -> list:
    from ..attention.registry import make_options

    make_options(config.attention, config.options)
    records = []
    jobs = [(depth, reversible) for depth in config.depths for reversible in (False, True)]
    for step, (depth, reversible) in enumerate(jobs, 1):
        job = {**asdict(config), "depth": depth, "reversible": reversible}
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "clusterformer.bench.reversible", json.dumps(job)],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"reversible benchmark at depth {depth} failed:\n{proc.stderr[-4000:]}")
        record = json.loads(proc.stdout.strip().splitlines()[-1])
        records.append(record)
        if progress:
            progress(f"[{step}/{len(jobs)}] depth={depth} {'reversible' if reversible else 'standard  '}: "
                     f"peak {record['peak_mem_mb']:.0f} MB, fwd+bwd {record['fwd_bwd_ms']:.0f} ms "
                     f"({time.perf_counter() - started:.0f} s)")
    return records


def _worker(job: dict) -> dict:
    import torch

    from ..models import Encoder, EncoderConfig

    torch.manual_seed(job["seed"])
    device = torch.device(job["device"])
    config = EncoderConfig(vocab_size=256, dim=job["dim"], depth=job["depth"], heads=job["heads"], dropout=0.0,
                           attention=job["attention"], attention_options=job["options"],
                           reversible=job["reversible"], tied=job["tied"] and job["reversible"])
    model = Encoder(config).to(device)
    tokens = torch.randint(1, 256, (job["batch"], job["length"]), device=device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step() -> None:
        model(tokens).float().pow(2).mean().backward()

    step()  # parameter gradients allocated, lazy state built
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        sync()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak = _peak_rss_mb(step)
    return {
        "depth": job["depth"], "reversible": job["reversible"], "tied": config.tied, "attention": job["attention"],
        "length": job["length"], "batch": job["batch"], "dim": job["dim"], "heads": job["heads"],
        "device": str(device), "peak_mem_mb": peak,
        "fwd_bwd_ms": _median_ms(step, 1, job["repeats"], sync), "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


if __name__ == "__main__":
    print(json.dumps(_worker(json.loads(sys.argv[1]))))
