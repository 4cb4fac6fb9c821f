"""The training loop behind ``clusterformer train`` and ``clusterformer eval``.

Semantics (what the tests check):

* **Shape.** :func:`run_training` reads top to bottom: set-up (or resume), steps, finish. The task
  (:class:`clusterformer.train.tasks.Task`) provides the model head, the batches, the loss and the evaluation;
  the loop knows nothing of classification or language modelling.
* **Batches** (the task's ``batch``). Each epoch visits a permutation of the training examples drawn from
  ``seed + epoch``; step s of the epoch takes the s-th run of ``batch_size * world_size`` examples (the last
  incomplete run is dropped) and rank r trains on the r-th contiguous slice of ``batch_size``. Language
  modelling draws ``batch_size * world_size`` random windows per step from a generator seeded with ``(seed, step)``.
* **Distributed.** Under ``torchrun --nproc_per_node=N`` (``WORLD_SIZE`` > 1) the model is wrapped in PyTorch
  ``DistributedDataParallel`` (gloo on CPU, nccl on CUDA), which averages gradients over ranks: with equal
  slices and no dropout, N ranks of ``batch_size`` give the same update as one process with
  ``batch_size * N`` (every batch is trimmed to the longest example of the global batch, so all ranks see one
  padded length). Per-example task losses average exactly; token-averaged auxiliary losses (L1, commitment)
  are averaged per rank first, which differs from the global token mean when ranks hold different numbers of
  real tokens. Rank 0 evaluates, logs and writes checkpoints. Dropout RNG is seeded ``seed + rank``.
* **Loss.** ``task_weight * task + clustering_weight * L1 + centroid_sorting_weight * L2 + commitment_weight *
  commitment`` (:func:`clusterformer.attention.total_loss`; aux losses averaged over layers).
* **Schedule.** AdamW; learning rate warms up linearly over ``warmup_steps`` then decays (``linear`` to 0 at the
  last step, ``cosine``, or ``constant``); gradient norm clipped to ``clip`` (0 = off). ``centroid_lr_scale``
  multiplies the learning rate of neural-clustering's clustering parameters (centroids C and the projection W^C),
  which then form a second parameter group under the same schedule. ``centroid_init="kmeans"``: before the first
  step of a new run, each ``cluster_on="query-key"`` layer's centroids are set to the spherical k-means of its keys
  on the first step's global batch (every rank builds the same batch, so every rank fits the same centroids).
* **Checkpoints** (:mod:`clusterformer.train.checkpoint`): every ``checkpoint_every`` steps and at the end, with
  model (with every layer's state: centroids, memory banks, generators; pending EMA updates are applied
  after each optimiser step, so the buffers are never one step old), optimiser, schedule, step, every rank's
  RNG state, the evaluation history and the tokenizer. ``resume=True`` continues from ``out/checkpoint.pt``
  and reproduces the uninterrupted run exactly (same data order, same RNG, bit-identical final weights and
  buffers); the logs are cut back to the checkpoint's step, so no step is logged twice.
* **Stateful layers under DDP.** Routing/kmeans centroid statistics are all-reduced and Cluster-Former's
  memory bank gathers every rank's tokens (:mod:`clusterformer.distributed`), so buffers are identical on
  every rank and equal to a single process's with the global batch; DDP does not broadcast buffers.
* **Mixed precision.** ``amp="auto"`` uses bfloat16 autocast on CUDA devices that support it and float32 on
  CPU; ``"bf16"`` forces bfloat16 autocast (CPU too), ``"off"`` disables it.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._io import write_json
from ..attention import (
    AttentionLayer,
    InnerAttention,
    NeuralClusteringAttention,
    apply_pending_updates,
    collect_aux_losses,
    fitting_centroids,
    total_loss,
)
from ..attention.registry import defaults_versions, make_options, pin_defaults
from ..models import EncoderConfig, cluster_former_config
from .checkpoint import CHECKPOINT, load_checkpoint, save_checkpoint
from .config import INIT_TASKS, TrainConfig, pretrained_model
from .tasks import Task, prepare_task

__all__ = ["INIT_ARCHITECTURE", "evaluate_checkpoint", "init_architecture", "init_from_checkpoint", "load_run",
           "parameter_groups", "run_training"]

DENSE_WARMUP_WINDOW = 20  # steps whose mean task loss ends a dense warm-up with dense_warmup_loss


# ----------------------------------------------------------------------------------------------- set-up


def _distributed() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(backend)
    rank = torch.distributed.get_rank() if world > 1 else 0
    return rank, world


def _device(name: str, rank: int) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name} was given but CUDA is not available")
    return device


def _tokenizer_kind(config: TrainConfig, state: str | None = None) -> str:
    """The tokenizer of the run: a pretrained model's, a saved one's kind (a resumed run, or --init PATH), or the
    flag's. A saved vocabulary, word-level or WordPiece, is restored whole from its state ("word" routes it)."""
    if pretrained_model(config.init):
        return f"pretrained:{config.init}"
    if state is not None and not state.startswith("pretrained:"):
        return "bytes" if state == "bytes" else "word"
    return config.tokenizer


def build_model(config: TrainConfig, task: Task) -> torch.nn.Module:
    """The task's model: a pretrained encoder to fine-tune (``init``), or the task's head on a new encoder."""
    if pretrained_model(config.init):
        from ..hf import PretrainedClassifier

        return PretrainedClassifier(config.init, task.num_classes, attention=config.attention,
                                    options=dict(config.attention_options))
    size = dict(vocab_size=task.vocab_size, dim=config.dim, depth=config.depth, heads=config.heads,
                ff_dim=config.ff_dim, dropout=config.dropout, max_len=task.model_max_len(config.max_len),
                reversible=config.reversible, tied=config.tied, tied_lipschitz=config.tied_lipschitz)
    if config.cluster_layers is not None:  # the paper's stack: sliding-window layers, Cluster-Former layers here
        options = make_options("cluster-former", dict(config.attention_options))
        rest = {k: v for k, v in config.attention_options.items() if k not in ("window", "stride", "num_clusters")}
        layers = tuple(sorted({layer % config.depth for layer in config.cluster_layers}))
        return task.build_model(cluster_former_config(
            cluster_layers=layers, window=options.window, stride=options.stride, num_clusters=options.num_clusters,
            cluster_options=rest, **size))
    enc = EncoderConfig(attention=config.attention, attention_options=dict(config.attention_options),
                        centroid_flow=config.centroid_flow,
                        layer_attention={layer: (name, dict(options))
                                         for layer, (name, options) in config.layer_attention.items()}, **size)
    return task.build_model(enc)


def parameter_groups(model: torch.nn.Module, config: TrainConfig) -> list[dict[str, Any]]:
    """The optimiser's parameter groups: one group, or with ``centroid_lr_scale`` != 1 a second one holding
    neural-clustering's centroids and clustering projection (each layer's ``clustering_parameters``) at
    ``lr * centroid_lr_scale`` (its own ``lr``, which the schedule then scales like the first group's)."""
    if config.centroid_lr_scale == 1.0:
        return [{"params": list(model.parameters())}]
    clustering = [p for m in model.modules() if isinstance(m, NeuralClusteringAttention)
                  for p in m.clustering_parameters()]
    chosen = {id(p) for p in clustering}
    rest = [p for p in model.parameters() if id(p) not in chosen]
    if not clustering:
        raise ValueError("centroid_lr_scale was given but the model has no neural-clustering centroids")
    return [{"params": rest}, {"params": clustering, "lr": config.lr * config.centroid_lr_scale}]


def _schedule(config: TrainConfig, total: int):
    def factor(step: int) -> float:
        if config.warmup_steps and step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        if config.schedule == "constant":
            return 1.0
        progress = (step - config.warmup_steps) / max(1, total - config.warmup_steps)
        progress = min(max(progress, 0.0), 1.0)
        return 1.0 - progress if config.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _autocast(config: TrainConfig, device: torch.device):
    use = config.amp == "bf16" or (config.amp == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported())
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=use)


def _aux_weights(config: TrainConfig) -> dict[str, float]:
    return {"clustering": config.clustering_weight, "centroid_sorting": config.centroid_sorting_weight,
            "commitment": config.commitment_weight}


class _WithAuxLosses(torch.nn.Module):
    """``model(ids, pad)`` -> (logits, the weighted auxiliary losses). The losses are forward *outputs*, so
    DistributedDataParallel (``find_unused_parameters=True``) finds the parameters that only they reach
    (neural-clustering's W^C and centroids) when it walks the graph from the outputs; read from the layers
    after the forward, those parameters would look unused and then be marked ready twice. Losses weighted 0
    are left out: their parameters get no gradient and must look unused."""

    def __init__(self, model: torch.nn.Module, weights: dict[str, float]) -> None:
        super().__init__()
        self.model = model
        self.weights = weights

    def forward(self, ids: torch.Tensor, pad: torch.Tensor | None, extra: torch.Tensor | None = None):
        with collect_aux_losses() as aux:
            logits = self.model(ids, pad) if extra is None else self.model(ids, pad, extra)
        weighted = {k: v for k, v in aux.items() if self.weights.get(k, 0.0)}
        logged = {k: v.detach() for k, v in aux.items()}  # every aux loss, weighted or not, for the logs
        return logits, weighted, logged


# ----------------------------------------------------------------------------------------------- evaluation
@dataclass
class _Predictor:
    """The :class:`clusterformer.train.tasks.Predict` of an evaluation: logits on CPU, and the model itself."""

    model: torch.nn.Module
    device: torch.device
    config: TrainConfig

    def __call__(self, ids: torch.Tensor, pad: torch.Tensor | None) -> Any:
        with _autocast(self.config, self.device):
            output = self.model(ids.to(self.device), None if pad is None else pad.to(self.device))
        if isinstance(output, tuple):  # several heads (masked tokens, next sentence): each as one head is
            return tuple(None if o is None else o.float().cpu() for o in output)
        return output.float().cpu()



@torch.no_grad()
def evaluate(model: torch.nn.Module, task: Task, config: TrainConfig, device: torch.device) -> dict:
    """The task's test metric (accuracy, MAP/MRR, or bits per character) of ``model`` in evaluation mode."""
    was_training = model.training
    apply_pending_updates(model)  # evaluate the state after the last step, not one step old
    model.eval()

    try:
        return task.evaluate(_Predictor(model, device, config), config.batch_size)
    finally:
        model.train(was_training)


# ----------------------------------------------------------------------------------------------- training


def _rng_state(device: torch.device) -> dict:
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if state.get("cuda") is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


class _Logger:
    """metrics.jsonl (one object per log step) and metrics.csv (same columns): started afresh for a new run (so
    the logs of an earlier run in the same directory never mix with this one's); on resume, cut back to the
    checkpoint's step (rows an interrupted run wrote after its last checkpoint are logged again by the resumed
    one, and must not appear twice), then appended."""

    COLUMNS = ("step", "epoch", "loss", "task_loss", "clustering", "centroid_sorting", "commitment", "lr",
               "examples_per_s", "elapsed_s")

    def __init__(self, out: Path, enabled: bool, resume: bool, resumed_step: int = 0) -> None:
        self.enabled = enabled
        self.jsonl, self.csv = out / "metrics.jsonl", out / "metrics.csv"
        if enabled and not resume:
            self.jsonl.unlink(missing_ok=True)
            self.csv.unlink(missing_ok=True)
        if enabled and resume:
            self._cut_back(resumed_step)
        if enabled and not self.csv.exists():
            with open(self.csv, "w", newline="") as f:
                csv.writer(f).writerow(self.COLUMNS)

    def _cut_back(self, step: int) -> None:
        """Keep only the rows of steps <= ``step`` (atomically: a crash here leaves the old file)."""
        if self.jsonl.exists():
            rows = [line for line in self.jsonl.read_text().splitlines() if line and json.loads(line)["step"] <= step]
            _write_atomically(self.jsonl, "".join(r + "\n" for r in rows))
        if self.csv.exists():
            with open(self.csv, newline="") as f:
                table = list(csv.reader(f))
            keep = table[:1] + [r for r in table[1:] if r and int(float(r[0])) <= step]
            with open(self.csv.with_suffix(".csv.tmp"), "w", newline="") as f:
                csv.writer(f).writerows(keep)
            os.replace(self.csv.with_suffix(".csv.tmp"), self.csv)

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        with open(self.jsonl, "a") as f:
            f.write(json.dumps(row) + "\n")
        with open(self.csv, "a", newline="") as f:
            csv.writer(f).writerow([row.get(c, "") for c in self.COLUMNS])


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _checksum(tensors) -> float:
    """Sum of the tensors (float64): equal on ranks that hold equal weights (or buffers)."""
    return float(sum(t.detach().double().sum() for t in tensors))


@dataclass
class _Run:
    """Everything one training run holds, set up by :func:`_set_up` and advanced by :func:`_step`."""

    config: TrainConfig
    task: Task
    rank: int
    world: int
    device: torch.device
    out: Path
    model: torch.nn.Module
    trained: torch.nn.Module  # the model with its aux losses as outputs, DDP-wrapped when distributed
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    per_epoch: int
    total: int
    started: float
    step: int = 0
    train_seconds: float = 0.0
    evaluations: list = field(default_factory=list)
    dense_losses: list = field(default_factory=list)  # dense_warmup_loss: the last steps' task losses (all ranks)
    dense_ended: int | None = None  # dense_warmup_loss: the first sparse step, once the loss has crossed it
    init_report: dict | None = None  # --init PATH: what was transferred from the pretrained checkpoint


def run_training(config: TrainConfig, task: Task | None = None) -> dict:
    """Train, evaluate and write ``out/metrics.json``; returns its content (on rank 0; ``{}`` elsewhere)."""
    run = _set_up(config, task)
    logger = _Logger(run.out, run.rank == 0, config.resume, resumed_step=run.step)
    bar = _progress(run)
    if _evaluation_missing(run):  # a finished run continued to more steps: its last step was evaluated as final
        run.evaluations.append({"step": run.step, **evaluate(run.model, run.task, config, run.device)})
        logger.log({"step": run.step, **run.evaluations[-1]})
    run.model.train()
    while run.step < run.total:
        row = _step(run)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.4f}", ex_s=f"{row['examples_per_s']:.0f}",
                            tok_s=f"{row['tokens_per_s']:.0f}")  # tqdm shows the ETA itself
        if run.step % config.log_every == 0 or run.step == run.total:
            logger.log(row)
        if config.eval_every and run.step % config.eval_every == 0 and run.step < run.total and run.rank == 0:
            run.evaluations.append({"step": run.step, **evaluate(run.model, run.task, config, run.device)})
            logger.log({"step": run.step, **run.evaluations[-1]})
        if (config.checkpoint_every and run.step % config.checkpoint_every == 0) or run.step == run.total:
            _checkpoint(run)
    if bar is not None:
        bar.close()
    return _finish(run)


def _evaluation_missing(run: _Run) -> bool:
    """Whether the step a run resumes from is due an evaluation it lacks (rank 0): a run that finished at that step
    evaluated it as its final one, outside the history, and is now continued past it (``--resume`` with a larger
    ``--max-steps``). A run resumed after a crash evaluated its checkpointed steps already."""
    every = run.config.eval_every
    return (run.rank == 0 and bool(every) and 0 < run.step < run.total and run.step % every == 0
            and all(e["step"] != run.step for e in run.evaluations))


def _set_up(config: TrainConfig, task: Task | None) -> _Run:
    """Processes, device, data, model, optimiser and schedule -- resumed from ``out/checkpoint.pt`` with
    ``config.resume``."""
    started = time.time()
    rank, world = _distributed()
    device = _device(config.device, rank)
    out = Path(config.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    state = _load_for_resume(config, out, world) if config.resume else None
    pretrained = None
    if config.init is not None and not pretrained_model(config.init) and state is None:
        pretrained = _pretrained_checkpoint(config.init, config.task)
    if task is None:
        saved = state["tokenizer"] if state else pretrained["tokenizer"] if pretrained else None
        if saved is None and config.tokenizer_from is not None:  # another run's vocabulary, fresh weights
            saved = load_checkpoint(config.tokenizer_from)["tokenizer"]
        task = _prepare(config, tokenizer_state=saved)
    torch.manual_seed(config.seed)  # identical initial weights on every rank
    model = build_model(config, task).to(device)
    init_report = None
    if pretrained is not None:
        init_report = init_from_checkpoint(model, pretrained, config)
    per_epoch = task.steps_per_epoch(config.batch_size, world)
    if config.centroid_init == "kmeans" and state is None:
        init_report = {**(init_report or {}), "centroid_init": _fit_centroids(model, task, config, per_epoch, world,
                                                                            device)}
    if config.dense_warmup_steps and not _dense_layers(model):
        raise ValueError("dense_warmup_steps trains neural-clustering or cluster-select layers densely at first; this "
                         f"model has none (attention={config.attention!r})")
    total = min(x for x in (config.max_steps, config.epochs and config.epochs * per_epoch) if x)
    optimizer = torch.optim.AdamW(parameter_groups(model, config), lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(config, total))
    run = _Run(config, task, rank, world, device, out, model, _wrap(model, config, device, world), optimizer,
               scheduler, per_epoch, total, started, init_report=init_report)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        run.step, run.train_seconds = state["step"], state["train_seconds"]
        run.evaluations = list(state.get("evaluations", []))
        run.dense_losses = list(state.get("dense_losses", []))
        run.dense_ended = state.get("dense_ended")
        run.init_report = state.get("init_report")
        _set_rng_state(state["rng"][rank], device)
    else:
        torch.manual_seed(config.seed + rank)  # dropout differs across ranks
    return run


def _fit_centroids(model: torch.nn.Module, task: Task, config: TrainConfig, per_epoch: int, world: int,
                   device: torch.device) -> dict[str, Any]:
    """``centroid_init="kmeans"``: one no-grad forward of the model in eval mode (no dropout, no state updates of
    other layers) over the first step's global batch (every rank's slice, built alike on every rank) inside
    :func:`clusterformer.attention.fitting_centroids` (k-means++ seeds from ``config.seed``). Returns what it
    fitted, for the run's report."""
    # every rank's slice has the global batch's padded length (the module docstring), so the slices stack
    slices = [task.batch(0, per_epoch, config.batch_size, rank, world, config.seed) for rank in range(world)]
    ids = torch.cat([s.ids for s in slices]).to(device)
    pad = None if slices[0].pad is None else torch.cat([s.pad for s in slices]).to(device)
    extra = None if slices[0].extra is None else torch.cat([s.extra for s in slices]).to(device)
    generator = torch.Generator().manual_seed(config.seed)
    model.eval()
    try:
        with fitting_centroids(model, generator) as fitted, torch.no_grad(), _autocast(config, device):
            model(ids, pad, extra) if extra is not None else model(ids, pad)
    finally:
        model.train()
    return {"layers": fitted, "sequences": len(ids), "tokens": ids.numel() - (0 if pad is None else int(pad.sum()))}


def _load_for_resume(config: TrainConfig, out: Path, world: int) -> dict:
    state = read_checkpoint(out / CHECKPOINT)
    saved = state["config"]
    changed = {k for k in ("task", "task_options", "attention", "attention_options", "dim", "depth", "heads",
                           "max_len", "seed", "batch_size", "cluster_layers", "reversible", "tied", "tied_lipschitz",
                           "decoder_attention", "decoder_attention_options", "centroid_flow", "centroid_lr_scale",
                           "centroid_init", "layer_attention", "dense_warmup_steps", "dense_warmup_loss")
               if _comparable(saved.get(k, getattr(config, k))) != _comparable(getattr(config, k))}
    if changed:
        pinned = sorted(k for k in changed & {"attention_options", "decoder_attention_options", "layer_attention"}
                        if _comparable(state.get("unpinned_config", {}).get(k)) == _comparable(getattr(config, k)))
        hint = (f"; the defaults of its mechanism changed since it was written: to resume it, give {pinned[0]} as "
                f"the checkpoint trained with, {saved[pinned[0]]}" if pinned else "")
        raise ValueError(f"--resume with different {', '.join(sorted(changed))} than the checkpoint in {out}{hint}")
    if state["world_size"] != world:
        raise ValueError(f"the checkpoint was written with {state['world_size']} processes, not {world}")
    return state


def _comparable(value: Any) -> Any:
    """A config value as JSON writes it (int keys become strings, tuples lists), so that a value read back from
    a checkpoint compares equal to the one given."""
    return json.loads(json.dumps(value))


def _prepare(config: TrainConfig, tokenizer_state: str | None) -> Task:
    return prepare_task(config.task, data_dir=config.data_dir, max_len=config.max_len,
                        tokenizer=_tokenizer_kind(config, tokenizer_state), vocab_size=config.vocab_size,
                        seed=config.seed, fold=config.fold, folds=config.folds, limit=config.limit,
                        train_file=config.train_file, test_file=config.test_file, tokenizer_state=tokenizer_state,
                        translation=_translation_options(config) if config.task == "multi30k" else None,
                        task_options=config.task_options)


def _translation_options(config: TrainConfig) -> dict[str, Any]:
    return {"shared_vocab": config.shared_vocab, "decoder_attention": config.decoder_attention,
            "decoder_options": dict(config.decoder_attention_options), "label_smoothing": config.label_smoothing,
            "beam": config.beam}


def _wrap(model: torch.nn.Module, config: TrainConfig, device: torch.device, world: int) -> torch.nn.Module:
    trained = _WithAuxLosses(model, _aux_weights(config))
    if world > 1:
        # Some parameters get no gradient in some configurations (e.g. neural-clustering's W^C and centroids
        # when the clustering losses are weighted 0: the argmax assignment is not differentiable).
        # No buffer broadcast: stateful layers combine their statistics over ranks (clusterformer.distributed),
        # so every rank already holds the same buffers; broadcasting rank 0's would hide a rank that drifted.
        trained = torch.nn.parallel.DistributedDataParallel(
            trained, device_ids=[device.index] if device.type == "cuda" else None, find_unused_parameters=True,
            broadcast_buffers=False)
    return trained


def _progress(run: _Run):
    if run.rank != 0 or not run.config.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=run.total, initial=run.step, desc=f"{run.config.task}/{run.config.attention}", unit="step",
                dynamic_ncols=True, file=sys.stderr)


def _dense_layers(model: torch.nn.Module) -> list[InnerAttention]:
    """The attention modules that can attend densely in training (``dense_warmup_steps``)."""
    return [m for m in model.modules() if isinstance(m, InnerAttention) and m.dense_warmup]


def _set_dense_training(model: torch.nn.Module, dense: bool) -> None:
    for module in _dense_layers(model):
        module.dense_training = dense


def _step(run: _Run) -> dict:
    """One optimiser step on this rank's slice of the global batch; returns the step's log row."""
    config, device = run.config, run.device
    tick = time.perf_counter()
    ids, pad, targets, extra = run.task.batch(run.step, run.per_epoch, config.batch_size, run.rank, run.world,
                                              config.seed)
    ids, targets = ids.to(device), targets.to(device)
    pad = pad.to(device) if pad is not None else None
    dense = run.step < config.dense_warmup_steps and run.dense_ended is None
    if config.dense_warmup_steps:
        _set_dense_training(run.model, dense)
    extra = extra.to(device) if extra is not None else None
    with _autocast(config, device):
        logits, weighted_aux, logged_aux = run.trained(ids, pad, extra)
    task_loss = run.task.loss(logits, targets)
    loss = total_loss(task_loss, weighted_aux, _aux_weights(config), task_weight=config.task_weight)
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if config.clip:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), config.clip)
    run.optimizer.step()
    run.scheduler.step()
    apply_pending_updates(run.model)  # the state a checkpoint after this step must hold (EMA centroids)
    run.step += 1
    if dense and config.dense_warmup_loss is not None:
        _follow_dense_warmup(run, task_loss.detach())
    seconds = time.perf_counter() - tick
    run.train_seconds += seconds
    tokens = ids.numel() - (0 if pad is None else int(pad.sum()))  # this rank's real input tokens
    return {"step": run.step, "epoch": run.step / run.per_epoch, "loss": loss.item(), "task_loss": task_loss.item(),
            **{k: v.item() for k, v in logged_aux.items()}, "lr": run.scheduler.get_last_lr()[0],
            "examples_per_s": len(ids) * run.world / seconds, "tokens_per_s": tokens * run.world / seconds,
            "elapsed_s": time.time() - run.started}


def _follow_dense_warmup(run: _Run, task_loss: torch.Tensor) -> None:
    """dense_warmup_loss: keep the last DENSE_WARMUP_WINDOW task losses, averaged over the ranks (so every rank ends
    the warm-up at the same step), and end the warm-up once their mean is below the threshold."""
    loss = task_loss.float().clone()
    if run.world > 1:
        torch.distributed.all_reduce(loss)
        loss /= run.world
    run.dense_losses = [*run.dense_losses, loss.item()][-DENSE_WARMUP_WINDOW:]
    if len(run.dense_losses) == DENSE_WARMUP_WINDOW and sum(run.dense_losses) / DENSE_WARMUP_WINDOW < \
            run.config.dense_warmup_loss:
        run.dense_ended = run.step


def _checkpoint(run: _Run) -> None:
    """Every rank's RNG state is gathered; rank 0 writes the checkpoint atomically."""
    rngs = [_rng_state(run.device)]
    if run.world > 1:
        rngs = [None] * run.world
        torch.distributed.all_gather_object(rngs, _rng_state(run.device))
    if run.rank == 0:
        task = run.task
        save_checkpoint(run.out, {
            "model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(),
            "scheduler": run.scheduler.state_dict(), "step": run.step, "train_seconds": run.train_seconds,
            "rng": rngs, "config": asdict(run.config), "tokenizer": task.tokenizer, "world_size": run.world,
            "evaluations": run.evaluations, "dense_losses": run.dense_losses, "dense_ended": run.dense_ended,
            "init_report": run.init_report, "defaults_versions": defaults_versions(),
            "task": {"name": task.name, "kind": task.kind, "vocab_size": task.vocab_size,
                     "num_classes": task.num_classes, "metric": task.metric, "info": task.info},
        })


def _finish(run: _Run) -> dict:
    """Final evaluation and ``metrics.json`` (rank 0), with every rank's weight and buffer checksums."""
    model, device, config = run.model, run.device, run.config
    mine = (_checksum(model.parameters()), _checksum(b for b in model.buffers() if b.is_floating_point()))
    sums = [mine]
    if run.world > 1:  # every rank's final weights and buffers (centroids, memory banks), to show they agree
        sums = [None] * run.world
        torch.distributed.all_gather_object(sums, mine)
    result: dict = {}
    if run.rank == 0:
        metrics = evaluate(model, run.task, config, device)
        epochs = run.step / run.per_epoch
        result = {
            "task": run.task.name, "attention": config.attention, "metrics": metrics, "evaluations": run.evaluations,
            "protocol": run.task.info.get("protocol"), "steps": run.step, "epochs": epochs,
            "steps_per_epoch": run.per_epoch, "train_seconds": run.train_seconds,
            "seconds_per_epoch": run.train_seconds / max(epochs, 1e-9), "wall_seconds": time.time() - run.started,
            "world_size": run.world, "rank_weight_checksums": [w for w, _ in sums],
            "rank_buffer_checksums": [b for _, b in sums], "device": str(device),
            "machine": f"{platform.machine()} {os.cpu_count()} CPUs"
            + (f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "parameters": sum(p.numel() for p in model.parameters()), "config": asdict(config),
            "keys_per_query": keys_per_query(model, config.max_len, getattr(run.task, "causal", run.task.kind == "lm")),
            "keys_mixed": keys_per_query(model, config.max_len, getattr(run.task, "causal", run.task.kind == "lm"),
                                         "keys_mixed"),  # keys_per_query is the keys read
            "defaults_versions": defaults_versions(), "resolved_options": resolved_options(config),
        }
        if run.init_report is not None:
            result["init"] = run.init_report
        if config.dense_warmup_steps:  # how many training steps attended densely
            result["dense_steps"] = run.dense_ended if run.dense_ended is not None else min(
                run.step, config.dense_warmup_steps)
        if device.type == "cuda":  # the accelerator's peak since this process began (RSS misses it)
            result["peak_device_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
        write_json(run.out / "metrics.json", result)
    if run.world > 1:
        torch.distributed.barrier()
    return result


def _pretrained_checkpoint(path: str, task: str) -> dict:
    """The checkpoint behind --init PATH: a `train --task mlm` run, whose encoder a text task fine-tunes, or a run
    of this same ``task``, whose whole model this run continues (at another length, with another mechanism)."""
    state = read_checkpoint(path)
    kind, saved_task = state.get("task", {}).get("kind"), state.get("config", {}).get("task")
    if kind == "mlm":
        if task not in INIT_TASKS:
            raise ValueError(f"--init {path}: an MLM checkpoint's encoder fine-tunes a text task "
                             f"({', '.join(INIT_TASKS)}); task {task!r} is not one")
        return state
    if saved_task != task:
        raise ValueError(f"--init {path}: the checkpoint is of task {saved_task!r}; --init PATH starts from a "
                         f"`train --task mlm` checkpoint or from a run of this task ({task!r})")
    return state


# what must agree between the pretrained run and the fine-tuned one for the encoder to mean the same thing
_ARCHITECTURE_FIELDS = ("dim", "depth", "heads", "ff_dim", "reversible", "tied", "tied_lipschitz")
_ENCODER_FIELDS = ("attention", "attention_options", *_ARCHITECTURE_FIELDS)
INIT_ARCHITECTURE = (*_ARCHITECTURE_FIELDS, "max_len")  # what --init PATH takes from its checkpoint


def init_architecture(path: str | Path, given: dict[str, Any], partial: bool = False) -> dict[str, Any]:
    """The architecture of a run that starts from the checkpoint ``path`` (``--init PATH``), each of
    :data:`INIT_ARCHITECTURE` (sizes, reversible/tied blocks, ``max_len``): the checkpoint's, or the value in
    ``given`` (what the caller set explicitly) instead. A given value that differs from the checkpoint's on a field
    the weights depend on (all but ``max_len``, which a length curriculum changes) raises ``ValueError`` naming
    both values -- unless ``partial`` (``--init-partial``: transfer what matches)."""
    saved = read_checkpoint(path).get("config", {})
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    architecture = {}
    for name in INIT_ARCHITECTURE:
        value = saved.get(name, defaults[name])  # older checkpoints: the defaults of then
        if name in given:
            if name != "max_len" and not partial and _comparable(given[name]) != _comparable(value):
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} {given[name]!r} conflicts with the checkpoint of --init {path}, trained "
                                 f"with {name}={value!r}: leave {flag} out to take the checkpoint's, or pass "
                                 "--init-partial to transfer only the tensors that match")
            value = given[name]
        architecture[name] = value
    return architecture


def _mechanism_state(module: torch.nn.Module) -> set[str]:
    """Names (in ``module.state_dict()``) of the tensors that belong to an attention mechanism: centroids, W^C,
    memory banks -- what a run that changes the mechanism cannot take from the checkpoint."""
    return {f"{prefix}.{name}" if prefix else name
            for prefix, inner in module.named_modules() if isinstance(inner, InnerAttention)
            for name in inner.state_dict()}


def init_from_checkpoint(model: torch.nn.Module, state: dict, config: TrainConfig) -> dict:
    """Load what ``--init PATH`` gives this run from the checkpoint ``state`` (:func:`_pretrained_checkpoint`).

    * An **MLM checkpoint**: its encoder goes into ``model.encoder``. The mechanism, its options and the encoder's
      size must match the pretraining run's.
    * A checkpoint of **this task**: the whole model (encoder and head) continues -- a length curriculum (train
      short, continue long) or a change of mechanism (train dense, continue sparse, or continue as a stack of
      mixed layers by ``cluster_layers`` or ``layer_attention``). The sizes must match; the mechanism and the
      length may differ: tensors of the new mechanism that the checkpoint lacks start fresh (reported as
      ``fresh``), the old mechanism's are left (``unused``).

    Otherwise ``ValueError`` names each difference -- unless ``config.init_partial``, which transfers every tensor
    whose name and shape match and reports the rest. A longer ``max_len`` is a difference only for a learned
    position table (sinusoidal positions have no rows to lack). From an MLM checkpoint, a shorter table takes its
    first rows, and a byte-level task's embedding (257 ids) the first rows of pretraining's (260, with its special
    tokens); a continued run's embedding and head must have the checkpoint's shapes (the same vocabulary).
    Returns what was transferred, what of this model was not (``skipped``, ``fresh``) and what of the checkpoint
    was not used."""
    continuing = state.get("task", {}).get("kind") != "mlm"
    module = model if continuing else getattr(model, "encoder", None)
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"--init PATH loads a pretrained encoder; this task's model ({type(model).__name__}) has none")
    mixed = config.cluster_layers is not None or bool(config.layer_attention)
    if mixed and not continuing:
        raise ValueError("--init: a pretrained (MLM) encoder is taken as it was trained; cluster_layers and "
                         "layer_attention rebuild the layers only when continuing a run of this task")
    fields = _ARCHITECTURE_FIELDS if continuing else _ENCODER_FIELDS
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    saved = {name: state["config"].get(name, defaults[name]) for name in fields}  # older runs: defaults
    differences = [f"{name}: pretrained {saved.get(name)!r}, here {getattr(config, name)!r}"
                   for name in fields if _comparable(saved.get(name)) != _comparable(getattr(config, name))]
    own = module.state_dict()
    saved_len = state["config"].get("max_len", 0)
    if saved_len < config.max_len and any(name.endswith("positions.weight") for name in own):
        differences.append(f"max_len: pretrained {saved_len}, here {config.max_len} (positions the pretrained "
                           "table lacks)")
    if differences and not config.init_partial:
        raise ValueError("--init: the pretrained model does not match this run (" + "; ".join(differences) +
                         "); match the pretraining flags, or pass --init-partial to transfer only what matches")
    prefix = "" if continuing else "encoder."
    pretrained = {k[len(prefix):]: v for k, v in state["model"].items() if k.startswith(prefix)}
    mechanism_changed = continuing and (
        state["config"].get("attention") != config.attention
        or any(_comparable(state["config"].get(name, unset)) != _comparable(getattr(config, name))
               for name, unset in (("attention_options", {}), ("cluster_layers", None), ("layer_attention", {}))))
    fresh_allowed = _mechanism_state(module) if mechanism_changed else set()
    load, skipped, fresh, empty = {}, [], [], set()
    for name, value in own.items():
        source = pretrained.get(name)
        if not continuing and name in ("embed.weight", "positions.weight") and isinstance(source, torch.Tensor) \
                and source.dim() == value.dim() and source.shape[1:] == value.shape[1:] \
                and source.shape[0] >= value.shape[0]:
            source = source[:value.shape[0]]  # the ids (or positions) this run has, which mean the same here
        if name in pretrained and source is None and value is None:
            empty.add(name)  # an empty extra state on both sides (a mechanism without a generator): nothing to load
            continue
        if source is None or (isinstance(source, torch.Tensor) and source.shape != value.shape):
            (fresh if name in fresh_allowed else skipped).append(name)
        else:
            load[name] = source
    if skipped and not config.init_partial:
        raise ValueError(f"--init: the pretrained model lacks or shapes differently {', '.join(skipped[:8])}; pass "
                         "--init-partial to transfer only what matches")
    module.load_state_dict({**own, **load})
    # the pretrained run's tensors this model has no place for (an empty extra state holds nothing to miss)
    unused = sorted(name for name in set(pretrained) - set(load) - empty if pretrained[name] is not None)
    return {"path": str(config.init), "kind": "continue" if continuing else "encoder", "transferred": len(load),
            "skipped": skipped, "fresh": fresh, "unused": unused, "differences": differences,
            "pretrained_step": state.get("step"), "pretrained_max_len": saved_len,
            "pretrained_attention": state["config"].get("attention")}


def keys_per_query(model: torch.nn.Module, length: int, causal: bool, which: str = "keys_read") -> int | None:
    """The most keys a query of ``model`` reads in a sequence of ``length`` tokens (``which="keys_mixed"``: whose
    values reach it): the largest (:meth:`clusterformer.attention.AttentionOptions.keys_read`, ``keys_mixed``) over
    its attention layers, None without one."""
    budgets = [getattr(m.options, which)(length, causal) for m in model.modules() if isinstance(m, AttentionLayer)]
    return max(budgets) if budgets else None


def read_checkpoint(path: str | Path) -> dict:
    """A checkpoint (run directory or file) whose config names the options it was trained with: the options of
    each mechanism whose defaults have changed since it was written set to the defaults of then
    (:func:`clusterformer.attention.registry.pin_defaults`; checkpoints without ``defaults_versions`` predate them),
    so that evaluating, resuming or continuing it rebuilds the model that was trained."""
    state = load_checkpoint(path)
    config = state.get("config")
    if not isinstance(config, dict):
        return state
    versions = state.get("defaults_versions")
    config = dict(config)
    if config.get("attention") is not None:
        config["attention_options"] = pin_defaults(config["attention"], config.get("attention_options") or {},
                                                   versions)
    if config.get("decoder_attention") is not None:
        config["decoder_attention_options"] = pin_defaults(config["decoder_attention"],
                                                           config.get("decoder_attention_options") or {}, versions)
    if config.get("layer_attention"):
        config["layer_attention"] = {layer: [name, pin_defaults(name, options or {}, versions)]
                                     for layer, (name, options) in config["layer_attention"].items()}
    return {**state, "config": config, "unpinned_config": state["config"]}


def resolved_options(config: TrainConfig) -> dict[str, dict[str, Any]]:
    """Every option of each mechanism the run trains, defaults included ({"attention": {...},
    "layer_attention[L]": {...}}): what ran, whatever the defaults become. Empty for a pretrained --init model
    (its patch options are its own)."""
    if pretrained_model(config.init):
        return {}
    return {role: dataclasses.asdict(make_options(name, options)) for role, name, options in config.mechanisms()}


def load_run(path: str | Path) -> tuple[dict[str, Any], TrainConfig]:
    """A checkpoint (run directory or file) and the :class:`TrainConfig` it was trained with."""
    state = read_checkpoint(path)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    return state, TrainConfig(**{k: v for k, v in state["config"].items() if k in fields})


def load_trained(path: str | Path, data_dir: str | None = None, device: str = "cpu",
                 adjust: Callable[[TrainConfig], None] | None = None
                 ) -> tuple[torch.nn.Module, Task, TrainConfig, int]:
    """The model of a checkpoint (run directory or file) with its trained weights, in evaluation mode on ``device``
    ("auto": CUDA when there is one), its prepared task, its config and its step. ``adjust`` may change the config
    before the task is prepared (another length or test set, as ``docs/scripts/length_probe.py`` does)."""
    state, config = load_run(path)
    if data_dir is not None:
        config.data_dir = data_dir
    if adjust is not None:
        adjust(config)
    task = _prepare(config, tokenizer_state=state.get("tokenizer"))
    model = build_model(config, task).to(_device(device, 0))
    model.load_state_dict(state["model"])
    return model.eval(), task, config, state["step"]


def evaluate_checkpoint(path: str | Path, data_dir: str | None = None, device: str = "auto") -> dict:
    """Rebuild the model of a checkpoint (directory or file) and evaluate it on its task's test split."""
    model, task, config, step = load_trained(path, data_dir, device)
    dev = next(model.parameters()).device
    return {"task": task.name, "attention": config.attention, "step": step,
            "metrics": evaluate(model, task, config, dev)}
