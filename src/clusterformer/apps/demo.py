"""``clusterformer demo``: the benchmark at a few lengths plus a short training of full, neural-clustering and
cluster-select attention (its defaults; ``--with NAMES`` names other mechanisms, ``--with ""`` none) on a generated
long-sequence task. No download, no GPU; a few minutes on 2 CPU cores.

Times hold no first call: the C++ kernels are built, and every mechanism's layer called, before the benchmark
(which warms each layer up again in its own process before timing it), and each training is timed after an untimed
step on a copy of its model (:func:`warm_up`), which leaves the model, its state and the random streams as they were.

The task ("majority marker"): a sequence of ``length`` random filler tokens holds a few copies of two
marker tokens, A and B, at random positions; the label says which marker occurs more often. It checks the
whole training path (encoder, clustering losses through ``collect_aux_losses``, optimiser) and the speed
of each attention in a training step. It is *not* a test of long-range modelling: mean pooling of token
embeddings can solve it. Real tasks are the training CLI's job.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .._io import write_json
from ..attention import build, collect_aux_losses, describe, total_loss
from ..attention.registry import names_where
from ..models import EncoderConfig, SequenceClassifier

# The mechanisms every demo trains; ``--with NAMES`` (DemoConfig.also) adds others, each with its defaults: any that
# trains a model (:func:`addable`). cluster-select is added by default (docs/usage.md#benchmarks).
BASE = ("full", "neural-clustering")
clock = time.perf_counter  # the demo's timer (a test spies on it: nothing is timed before a warm-up)

FILLER = range(3, 40)  # ids 1-2 are unused, 0 is padding
MARKER_A, MARKER_B = 40, 41
VOCAB = 42
MAX_COPIES = 12


@dataclass
class DemoConfig:
    length: int = 512
    train_steps: int = 200
    batch: int = 16
    eval_examples: int = 256
    dim: int = 64
    depth: int = 2
    heads: int = 4
    lr: float = 2e-3
    clustering_weight: float = 0.1  # mu
    sorting_weight: float = 0.1  # nu
    seed: int = 0
    bench_lengths: tuple[int, ...] = (1024, 2048, 4096)
    also: tuple[str, ...] = ("cluster-select",)  # mechanisms trained after those of BASE (addable())

    def __post_init__(self) -> None:
        unknown = [name for name in self.also if name not in addable()]
        if unknown:
            raise ValueError(f"also names {unknown}; the demo can add {addable()}")


def addable() -> list[str]:
    """The mechanisms the demo can train beside :data:`BASE`: every registered one that trains a model (the
    registry's kind ``"sequence"``; the cache readers only read a decoder's cache)."""
    return [name for name in names_where(kind="sequence") if name not in BASE]


def majority_marker_batch(batch: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens (batch, length) long and labels (batch,) long: 1 when marker A occurs more often than B.

    Counts of A and B are drawn from [1, MAX_COPIES] and never equal; markers go to distinct random
    positions (a random permutation per sequence, no Python loop over tokens)."""
    tokens = torch.randint(FILLER.start, FILLER.stop, (batch, length), generator=generator)
    count_a = torch.randint(1, MAX_COPIES + 1, (batch,), generator=generator)
    count_b = torch.randint(1, MAX_COPIES, (batch,), generator=generator)
    count_b = count_b + (count_b >= count_a).long()  # in [1, MAX_COPIES], never equal to count_a
    positions = torch.rand(batch, length, generator=generator).argsort(dim=1)  # random distinct slots
    rank = torch.arange(length).expand(batch, length)
    marker = torch.where(rank < count_a[:, None], MARKER_A, FILLER.start - 1)
    marker = torch.where((rank >= count_a[:, None]) & (rank < (count_a + count_b)[:, None]), MARKER_B, marker)
    placed = torch.full_like(tokens, -1).scatter_(1, positions, marker)
    tokens = torch.where(placed >= MARKER_A, placed, tokens)
    return tokens, (count_a > count_b).long()


def training_step(model: SequenceClassifier, optimizer: torch.optim.Optimizer, tokens: torch.Tensor,
                  labels: torch.Tensor, weights: dict[str, float]) -> float:
    """One optimiser step on the task loss and the auxiliary losses (``weights``); returns the task loss."""
    with collect_aux_losses() as aux:
        logits = model(tokens)
    task = model.loss(logits, labels)
    loss = total_loss(task, aux, weights)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return task.item()


def warm_up(model: SequenceClassifier, config: DemoConfig, weights: dict[str, float]) -> None:
    """One untimed training step on a copy of ``model``, with its own optimiser, on a batch of its own: whatever a
    first call costs (building a C++ kernel, first allocations, the thread pool) is spent here. The model, its
    state (EMA centroids, memory banks, generators), the data stream and the global random state are untouched."""
    twin = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(twin.parameters(), lr=config.lr, weight_decay=0.01)
    tokens, labels = majority_marker_batch(config.batch, config.length, torch.Generator().manual_seed(config.seed))
    with torch.random.fork_rng(devices=[]):
        training_step(twin, optimizer, tokens, labels, weights)


def train_one(attention: str, config: DemoConfig, log: Callable[[str], None]) -> dict:
    torch.manual_seed(config.seed)
    model_config = EncoderConfig(
        vocab_size=VOCAB, dim=config.dim, depth=config.depth, heads=config.heads,
        dropout=0.0, max_len=config.length, attention=attention,
    )
    model = SequenceClassifier(model_config, num_classes=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.01)
    weights = {"clustering": config.clustering_weight, "centroid_sorting": config.sorting_weight}
    data = torch.Generator().manual_seed(config.seed + 1)
    warm_up(model, config, weights)
    start = clock()
    running = None
    for step in range(1, config.train_steps + 1):
        tokens, labels = majority_marker_batch(config.batch, config.length, data)
        task = training_step(model, optimizer, tokens, labels, weights)
        running = task if running is None else 0.95 * running + 0.05 * task
        if step % 50 == 0 or step == config.train_steps:
            elapsed = clock() - start
            eta = elapsed / step * (config.train_steps - step)
            log(f"  {attention}: step {step}/{config.train_steps}  task loss {running:.3f}  "
                f"{step * config.batch / elapsed:.0f} seq/s  ETA {eta:.0f} s")
    train_seconds = clock() - start
    model.eval()
    test = torch.Generator().manual_seed(config.seed + 2)
    tokens, labels = majority_marker_batch(config.eval_examples, config.length, test)
    with torch.no_grad():
        accuracy = (model(tokens).argmax(-1) == labels).float().mean().item()
    return {
        "attention": attention,
        "keys_per_query": model.encoder.blocks[0].attn.options.keys_per_query(config.length),
        "accuracy": accuracy,
        "final_task_loss": running,
        "train_seconds": train_seconds,
        "ms_per_step": 1000 * train_seconds / config.train_steps,
    }


def call_each_layer(names: list[str], length: int = 256) -> None:
    """Build each mechanism's layer (the benchmark's width) and call it once in training and once in evaluation, in
    this process, untimed: the C++ kernels the layers use are compiled now (once per machine), not inside the first
    benchmark or training. The global random state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        for name in names:
            layer = build(name, dim=256, heads=4)
            x = torch.randn(1, length, 256, requires_grad=True)
            layer(x).sum().backward()
            with torch.no_grad():
                layer.eval()(x)


def run_demo(out_dir: str | Path, config: DemoConfig | None = None, log: Callable[[str], None] = print) -> dict:
    from ..bench import BenchConfig, run_attention_benchmark

    config = config or DemoConfig()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = [*BASE, *config.also]
    started = clock()
    call_each_layer(names)
    log(f"0/2 called each layer once, untimed ({clock() - started:.0f} s; a first run compiles the C++ kernels here)")
    log(f"1/2 benchmark: {', '.join(names)} layers (dim 256, 4 heads) at N = {list(config.bench_lengths)}")
    bench = run_attention_benchmark(BenchConfig(names=names, lengths=list(config.bench_lengths)), progress=log)
    write_json(out / "bench.json", bench)
    plot_path = None
    try:
        from ..bench.plot import plot_attention_benchmark

        plot_path = plot_attention_benchmark(bench, out / "bench.png")
    except RuntimeError as exc:
        log(f"  (no plot: {exc})")
    log(f"2/2 training on the majority-marker task, N={config.length}, {config.train_steps} steps of "
        f"{config.batch} sequences")
    runs = [train_one(name, config, log) for name in names]
    summary = {"config": asdict(config), "benchmark": bench, "training": runs}
    write_json(out / "demo.json", summary)

    by = {(r["name"], r["length"]): r for r in bench}
    lines = ["", "Attention layer, forward+backward (median ms), CPU float32, B=1, H=4, D=64; in brackets, x full's:",
             f"{'N':>6} " + " ".join(f"{name:>24}" for name in names)]
    for n in config.bench_lengths:
        full_ms = by[("full", n)]["fwd_bwd_ms"]
        cells = [f"{by[(name, n)]['fwd_bwd_ms']:.1f} ({by[(name, n)]['fwd_bwd_ms'] / full_ms:.2f}x)" for name in names]
        lines.append(f"{n:>6} " + " ".join(f"{cell:>24}" for cell in cells))
    lines += ["", f"Majority-marker task (N={config.length}), held-out accuracy after {config.train_steps} steps:",
              f"{'attention':<18} {'keys read':>10} {'accuracy':>9} {'ms/step':>9} {'train s':>8}"]
    for r in runs:
        lines.append(f"{r['attention']:<18} {r['keys_per_query']:>10} {r['accuracy']:>9.3f} {r['ms_per_step']:>9.1f} "
                     f"{r['train_seconds']:>8.1f}")
    full, nc = runs[:2]
    if nc["accuracy"] < full["accuracy"] - 0.02:
        lines += ["", "Why neural-clustering is below full here: the label is a count over the whole sequence, "
                  f"and each of its queries sees {nc['keys_per_query']} of the {config.length} keys (its "
                  "cluster's chunk and the one before), where full attention sees them all. Grouping helps where a "
                  "query needs a few distant tokens chosen by content (recall), not a count over all of them: "
                  "docs/recall-and-aggregation.md measures both kinds of task at equal keys per query."]
    for r in runs[len(BASE):]:  # the added mechanisms: say plainly whether each reached full's accuracy here
        reached = r["accuracy"] >= full["accuracy"] - 0.02
        lines += ["", f"{r['attention']} reads {r['keys_per_query']} keys per query "
                  f"({describe(r['attention'])['summary']}): "
                  f"accuracy {r['accuracy']:.3f} against full's {full['accuracy']:.3f}, "
                  + ("at full's accuracy (within 0.02)" if reached else
                     "below full's here; 200 steps of one seed move a run by several points (docs/usage.md#"
                     "benchmarks)")
                  + f", at {r['ms_per_step'] / full['ms_per_step']:.1f}x full's training step on this machine."]
    lines += ["", f"wrote {out / 'demo.json'}, {out / 'bench.json'}" + (f", {plot_path}" if plot_path else "")]
    log("\n".join(lines))
    return summary
