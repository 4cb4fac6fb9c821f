"""The configuration of ``clusterformer train``, in parts by concern.

:class:`TrainConfig` is the one object a run takes (``TrainConfig(task="mr", out="runs/mr", dim=64)``: flat
keywords, as the command line gives them, and flat in ``metrics.json`` and checkpoints). It is made of four
parts, each a dataclass with its own fields and its own checks:

* :class:`ModelConfig` -- the mechanism and its options, sizes, reversible/tied blocks, per-layer mechanisms, the
  Cluster-Former stack, centroid flow, ``init``; checked by :meth:`ModelConfig.check_model`;
* :class:`OptimConfig` -- batch, learning rate and schedule, loss weights, the dense warm-up;
  :meth:`OptimConfig.check_optim`;
* :class:`DataConfig` -- the task, its data and tokenizer, ``task_options``, the translation task's decoder and
  beam; :meth:`DataConfig.check_data`, then the task's own rules (its
  :class:`~clusterformer.train.tasks.TaskSpec` in :data:`~clusterformer.train.tasks.TASK_SPECS`);
* :class:`RunConfig` -- the run directory, seed, checkpoints, logging, device, precision; :meth:`RunConfig.check_run`.

What depends on two parts at once is checked after them, by a named rule each (:func:`_check_init`,
:func:`_check_causal`, :func:`_check_layer_mix`, :func:`_check_neural_clustering`). A task owns its options
(``task_options``, the translation fields) and its preparation: see :mod:`clusterformer.train.tasks`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._checks import check_choice, check_float, check_int
from ..attention.registry import causal_semantics, get, make_options, mechanisms, names, names_where
from ..data.pretrained import PRETRAINED_ENCODERS
from .checkpoint import CHECKPOINT
from .tasks import TASK_SPECS, TASKS

__all__ = ["FINE_TUNE_LR", "INIT_TASKS", "DataConfig", "ModelConfig", "OptimConfig", "RunConfig", "TrainConfig",
           "normal_layer_attention", "pretrained_model"]

# Default peak learning rate when fine-tuning a pretrained model (``init``): the usual BERT fine-tuning range
# (2e-5 .. 5e-5); the from-scratch default 1e-3 would wreck the pretrained weights.
FINE_TUNE_LR = 5e-5
INIT_TASKS = tuple(name for name, spec in TASK_SPECS.items() if spec.text)  # --init PATH fine-tunes these


def pretrained_model(init: str | None) -> bool:
    """Whether ``init`` names a pretrained model (:data:`~clusterformer.data.pretrained.PRETRAINED_ENCODERS`);
    otherwise it is the path of an MLM checkpoint, or None."""
    return init is not None and init in PRETRAINED_ENCODERS


def check_trainable(argument: str, name: str) -> None:
    """Refuse the mechanisms that only change how a decoder reads its cache (kind "cache"): training one is full
    attention."""
    if name in names() and get(name).kind == "cache":
        raise ValueError(f"{argument}: {name!r} changes only how a pretrained decoder reads its key/value cache "
                         "(clusterformer.hf); a sequence's attention to itself, and so training, is full attention "
                         "-- train with 'full'")


def normal_layer_attention(spec: Any, depth: int) -> dict[int, list[Any]]:
    """``layer_attention`` as {layer in [0, depth): [name, options]}: keys may be ints or their strings (JSON) and
    negative (from the last layer); every name and its options are validated by the registry. ``ValueError``
    naming ``layer_attention`` otherwise."""
    example = '{"0": ["sliding-window", {"window": 64}]}'
    if not isinstance(spec, dict):
        raise ValueError(f"layer_attention must be a dict {{layer: [name, options]}}, e.g. {example}; got {spec!r}")
    out: dict[int, list[Any]] = {}
    for key, value in spec.items():
        try:
            layer = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"layer_attention: {key!r} is not a layer index, e.g. {example}") from None
        if not -depth <= layer < depth:
            raise ValueError(f"layer_attention names layer {layer}, outside depth={depth} (negative counts from the "
                             "last layer)")
        if not (isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], str)
                and isinstance(value[1], dict)):
            raise ValueError(f"layer_attention[{key}] must be [name, options], e.g. {example}; got {value!r}")
        if layer % depth in out:
            raise ValueError(f"layer_attention names layer {layer % depth} twice")
        try:
            make_options(value[0], dict(value[1]))
        except ValueError as error:
            raise ValueError(f"layer_attention[{key}]: {error}") from None
        out[layer % depth] = [value[0], dict(value[1])]
    return dict(sorted(out.items()))


# --------------------------------------------------------------------------------------------------- the parts
@dataclass(kw_only=True)
class ModelConfig:
    """The network: which mechanism, its options and sizes, and the architectures built around it."""

    attention: str = "full"
    attention_options: dict[str, Any] = field(default_factory=dict)
    dim: int = 128
    depth: int = 2
    heads: int = 4
    ff_dim: int | None = None
    dropout: float = 0.1
    reversible: bool = False
    tied: bool = False  # with reversible: the tied connection of the k-means/reversible paper
    tied_lipschitz: float | None = 0.5  # its contraction constant in x1 (invertible as it trains); None: the paper's
    # to fine-tune: a pretrained model of clusterformer.hf (e.g. "minilm") or a `train --task mlm` checkpoint
    init: str | None = None
    init_partial: bool = False  # --init PATH: transfer the tensors whose names and shapes match, skip the rest
    allow_non_strict_causal: bool = False  # a causal task with a mechanism whose causal mode is not strict
    cluster_layers: list[int] | None = None  # cluster-former: the paper's stack, Cluster-Former layers only here
    # per-layer mechanisms, {layer: [name, options]} (negative counts from the last); other layers use `attention`
    layer_attention: dict[int, list[Any]] = field(default_factory=dict)
    centroid_flow: bool = False  # neural-clustering: layer l + 1 starts from layer l's updated centroids (paper)

    def check_model(self) -> None:
        """The model's own rules: sizes, the mechanism and its options, the architectures' requirements."""
        for name in ("dim", "depth", "heads"):
            check_int(name, getattr(self, name), minimum=1)
        check_float("dropout", self.dropout, minimum=0.0, maximum=1.0, exclusive_maximum=True)
        check_trainable("attention", self.attention)
        if pretrained_model(self.init):
            from ..hf import validate_patch_options

            validate_patch_options(self.attention, self.attention_options)
            if self.reversible:
                raise ValueError("--init and --reversible cannot be combined (the pretrained blocks are not "
                                 "reversible)")
        else:
            make_options(self.attention, self.attention_options)
        if self.init_partial and (self.init is None or pretrained_model(self.init)):
            raise ValueError("init_partial transfers part of a pretrained checkpoint: it needs --init PATH")
        if self.tied and not self.reversible:
            raise ValueError("tied is the tied connection between reversible streams: it needs reversible")
        if self.cluster_layers is not None:
            if get(self.attention).stack_layers is None:
                raise ValueError(f"cluster_layers builds the Cluster-Former stack: it needs attention="
                                 f"{' or '.join(repr(m.name) for m in mechanisms() if m.stack_layers)}")
            if not self.cluster_layers:
                raise ValueError("cluster_layers must name at least one layer")
            for layer in self.cluster_layers:
                check_int("cluster_layers entry", layer)
                if not -self.depth <= layer < self.depth:
                    raise ValueError(f"cluster_layers entry {layer} is outside depth={self.depth} (negative counts "
                                     "from the last layer)")
        self.layer_attention = normal_layer_attention(self.layer_attention, self.depth)
        for layer, (name, _options) in self.layer_attention.items():
            check_trainable(f"layer_attention[{layer}]", name)

    def mechanisms(self) -> list[tuple[str, str, dict[str, Any]]]:
        """(argument, mechanism, options) of every attention the model trains: ``attention`` and each entry of
        ``layer_attention``."""
        return [("attention", self.attention, self.attention_options),
                *((f"layer_attention[{layer}]", name, options)
                  for layer, (name, options) in self.layer_attention.items())]


@dataclass(kw_only=True)
class OptimConfig:
    """How the model is trained: batches, learning rate and schedule, the weights of the losses."""

    batch_size: int = 32
    lr: float | None = None  # None: 1e-3 from scratch, FINE_TUNE_LR with init
    weight_decay: float = 0.01
    warmup_steps: int = 100
    schedule: str = "linear"
    clip: float = 1.0
    epochs: int | None = None
    max_steps: int | None = None
    task_weight: float = 1.0
    clustering_weight: float = 0.1
    centroid_sorting_weight: float = 0.1
    commitment_weight: float = 1e-4
    centroid_lr_scale: float = 1.0  # neural-clustering: learning-rate multiplier of the centroids and W^C (0: frozen)
    # neural-clustering with cluster_on="query-key": "kmeans" sets each layer's centroids, before the first step of a
    # new run, to the spherical k-means of its keys on the first step's global batch; "random" keeps their init
    centroid_init: str = "random"
    # neural-clustering, cluster-select: the first training forwards attend to every key (the grouping trains beside)
    dense_warmup_steps: int = 0
    # end that warm-up early, once the task loss (mean of the last DENSE_WARMUP_WINDOW steps, over the ranks) is below
    # this value: at MQAR's phase change rather than at a fixed step; dense_warmup_steps is then the cap
    dense_warmup_loss: float | None = None

    def check_optim(self, fine_tuning: bool) -> None:
        """The optimisation's own rules; ``fine_tuning`` (an ``init``) sets the default learning rate."""
        check_int("batch_size", self.batch_size, minimum=1)
        check_int("warmup_steps", self.warmup_steps, minimum=0)
        if self.epochs is None and self.max_steps is None:
            raise ValueError("give --epochs or --max-steps (or both: training stops at whichever comes first)")
        if self.epochs is not None:
            check_int("epochs", self.epochs, minimum=1)
        if self.max_steps is not None:
            check_int("max_steps", self.max_steps, minimum=1)
        if self.lr is None:
            self.lr = FINE_TUNE_LR if fine_tuning else 1e-3
        check_float("lr", self.lr, minimum=0.0, exclusive_minimum=True)
        for name in ("weight_decay", "clip", "task_weight", "clustering_weight", "centroid_sorting_weight",
                     "commitment_weight"):
            check_float(name, getattr(self, name), minimum=0.0)
        check_choice("schedule", self.schedule, ("linear", "cosine", "constant"))
        # 0 freezes the centroids and W^C (fine-tuning a pretrained clustering without moving it)
        check_float("centroid_lr_scale", self.centroid_lr_scale, minimum=0.0)
        check_choice("centroid_init", self.centroid_init, ("random", "kmeans"))
        check_int("dense_warmup_steps", self.dense_warmup_steps, minimum=0)
        if self.dense_warmup_loss is not None:
            check_float("dense_warmup_loss", self.dense_warmup_loss, minimum=0.0, exclusive_minimum=True)
            if not self.dense_warmup_steps:
                raise ValueError("dense_warmup_loss ends a dense warm-up early: it needs dense_warmup_steps > 0 (the "
                                 "warm-up's longest length)")


@dataclass(kw_only=True)
class DataConfig:
    """The task and its data: where they are, how they are cut and tokenised, the task's own options."""

    task: str
    task_options: dict[str, Any] = field(default_factory=dict)  # mqar, passkey, mlm: the task's own options
    data_dir: str | None = None
    train_file: str | None = None
    test_file: str | None = None
    limit: int | None = None
    fold: int | None = None
    folds: int = 10
    tokenizer: str = "auto"
    # a checkpoint (file or run directory) whose saved tokenizer this run takes, and nothing else: the from-scratch
    # control of a pretraining claim, with the pretrained run's vocabulary (``init`` brings its tokenizer itself)
    tokenizer_from: str | None = None
    vocab_size: int = 20000
    max_len: int = 256
    # translation (task multi30k): its decoder, loss and search
    decoder_attention: str | None = None  # None: the encoder's mechanism if it can decode, else full
    decoder_attention_options: dict[str, Any] = field(default_factory=dict)
    label_smoothing: float = 0.1
    beam: int = 5
    shared_vocab: bool = True

    def check_data(self) -> None:
        """The data's own rules (the task's own, on its options and on the whole configuration, follow in
        :class:`TrainConfig`: :meth:`clusterformer.train.tasks.TaskSpec.check`)."""
        check_choice("task", self.task, TASKS)
        for name in ("vocab_size", "max_len", "folds"):
            check_int(name, getattr(self, name), minimum=1)
        check_choice("tokenizer", self.tokenizer, ("auto", "word", "wordpiece", "bytes"))
        if self.tokenizer_from is not None:
            if not _is_checkpoint(self.tokenizer_from):
                raise ValueError(f"tokenizer_from must be a checkpoint (file or run directory); "
                                 f"{self.tokenizer_from!r} is neither")
            if self.tokenizer != "auto":
                raise ValueError("tokenizer_from takes the checkpoint's own tokenizer; leave --tokenizer at auto")
        check_float("label_smoothing", self.label_smoothing, minimum=0.0, maximum=1.0, exclusive_maximum=True)
        check_int("beam", self.beam, minimum=1)

    def causal(self) -> bool:
        """Whether the task trains a causal model (language modelling, a recall task's causal form)."""
        return TASK_SPECS[self.task].causal(self.task_options)


@dataclass(kw_only=True)
class RunConfig:
    """Where and how the run happens: its directory, seed, checkpoints, logs, device and precision."""

    out: str
    seed: int = 0
    checkpoint_every: int = 500
    eval_every: int = 0
    log_every: int = 10
    resume: bool = False
    device: str = "auto"
    amp: str = "auto"
    progress: bool = True

    def check_run(self) -> None:
        check_int("log_every", self.log_every, minimum=1)
        for name in ("checkpoint_every", "eval_every", "seed"):
            check_int(name, getattr(self, name), minimum=0)
        check_choice("amp", self.amp, ("auto", "off", "bf16"))


# -------------------------------------------------------------------------------------------------- the whole
@dataclass(kw_only=True)
class TrainConfig(DataConfig, ModelConfig, OptimConfig, RunConfig):
    """Everything ``clusterformer train`` takes (see ``clusterformer train --help`` for each option): the four
    parts, checked each by its own rules, then by the task's (its options, and what it asks of the model), then
    by the rules that tie two parts."""

    def __post_init__(self) -> None:
        self.check_data()
        self.check_model()
        self.check_optim(fine_tuning=self.init is not None)
        self.check_run()
        TASK_SPECS[self.task].check(self)
        _check_init(self)
        _check_causal(self)
        _check_layer_mix(self)
        _check_neural_clustering(self)


def _is_checkpoint(path: str) -> bool:
    """Whether ``path`` names a checkpoint: the file, or a run directory holding one."""
    return Path(path).is_file() or (Path(path) / CHECKPOINT).is_file()


def _check_init(config: TrainConfig) -> None:
    """Fine-tuning (``init``) and the task: a pretrained model reads single texts with its own tokenizer and
    positions; an MLM checkpoint, a text task with the pretrained run's tokenizer."""
    if config.init is None:
        return
    if config.tokenizer_from is not None:
        raise ValueError("--init brings its checkpoint's tokenizer; tokenizer_from is for a run without --init")
    if config.tokenizer != "auto":
        raise ValueError("--init uses the pretrained model's own tokenizer; leave --tokenizer at auto")
    if pretrained_model(config.init):
        if not TASK_SPECS[config.task].text or config.task == "wikiqa":
            raise ValueError(f"--init fine-tunes single-text classifiers; task {config.task!r} is not one")
        if config.max_len > 512:
            raise ValueError(f"max_len must be <= 512 (the pretrained model's positions), got {config.max_len}")
        return
    if not _is_checkpoint(config.init):
        raise ValueError(f"init must be one of {', '.join(PRETRAINED_ENCODERS)} or the checkpoint (file or run "
                         f"directory) of a `train --task mlm` run or of a run of this task; {config.init!r} is "
                         "neither")
    if config.centroid_flow:
        raise ValueError("--init PATH takes the pretrained encoder as it is: centroid_flow cannot be combined with it")


def _check_causal(config: TrainConfig) -> None:
    """A causal task needs strictly causal mechanisms in every layer (or ``allow_non_strict_causal``)."""
    if pretrained_model(config.init) or not config.causal():
        return
    for argument, name, options in config.mechanisms():
        semantics = causal_semantics(name, options)
        if semantics == "refused":
            raise ValueError(f"{argument}: {name!r} cannot be causal, so it cannot train a causal model (task "
                             f"{config.task!r})")
        if semantics != "strict" and not config.allow_non_strict_causal:
            raise ValueError(f"{argument}: {name!r} with these options is not strictly causal (which past keys a "
                             "token sees depends on later tokens), so its bits per character would be optimistic; "
                             "pass --allow-non-strict-causal to train it anyway")


def _check_layer_mix(config: TrainConfig) -> None:
    """``layer_attention`` builds a new encoder of mixed layers: nothing else may build the layers (a checkpoint of
    this task may initialise it: :func:`clusterformer.train.loop.init_from_checkpoint` refuses the others)."""
    if (config.layer_attention or config.cluster_layers is not None) and pretrained_model(config.init):
        raise ValueError(f"--init {config.init} is a pretrained model of its own architecture: layer_attention and "
                         "cluster_layers cannot rebuild its layers")
    if config.layer_attention and (config.cluster_layers is not None or config.centroid_flow
                                   or TASK_SPECS[config.task].kind == "translation"):
        raise ValueError("layer_attention builds a new encoder of mixed layers: it cannot be combined with "
                         "cluster_layers, centroid_flow or task multi30k")


def _check_neural_clustering(config: TrainConfig) -> None:
    """The options that act on neural-clustering's centroids need neural-clustering layers to act on."""
    if not (config.centroid_flow or config.centroid_lr_scale != 1.0):
        return
    flag = "centroid_flow" if config.centroid_flow else "centroid_lr_scale"
    # a checkpoint of this library (--init PATH) builds the same neural-clustering layers, so its centroids can take
    # their own rate when fine-tuned; centroid_flow would rewire them, and a pretrained model of clusterformer.hf
    # owns its layers
    refused_init = config.init is not None and (config.centroid_flow or pretrained_model(config.init))
    if not get(config.attention).learned_centroids or refused_init or TASK_SPECS[config.task].kind == "translation":
        raise ValueError(f"{flag} acts on neural-clustering's centroids: it needs attention="
                         f"{' or '.join(map(repr, names_where(learned_centroids=True)))}, "
                         f"{'no init' if config.centroid_flow else 'no pretrained model as init (a PATH is fine)'} "
                         f"and a task other than multi30k (got attention={config.attention!r}, "
                         f"init={config.init!r}, task={config.task!r})")
    if config.centroid_flow and (config.reversible or "own_centroids" in config.attention_options):
        raise ValueError("centroid_flow sets own_centroids per layer and replays no blocks: it cannot be combined "
                         "with reversible or an own_centroids option")
