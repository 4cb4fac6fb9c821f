"""``clusterformer cluster``: the stand-alone clustering experiment -- the neural clustering method vs k-means
vs SOM (accuracy by Hungarian matching, purity, NMI)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .._io import emit_json
from ._args import json_object, log


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cluster", help="stand-alone clustering: neural clustering method vs k-means vs SOM "
                                       "(accuracy by Hungarian matching, purity, NMI)")
    p.add_argument("--method", required=True, choices=["neural", "kmeans", "som"])
    p.add_argument("--k", type=int, required=True, help="number of clusters")
    p.add_argument("--dataset", choices=["digits", "digits784"], default=None,
                   help="built-in data: scikit-learn's digits (1797 x 64), or digits784: 10,000 x 784 made from them "
                        "(upsampled to 28x28, noise added; an MNIST-sized stand-in)")
    p.add_argument("--data", default=None, help="points as a .npy array (n, d)")
    p.add_argument("--labels", default=None, help="labels as a .npy array (n,) (optional)")
    p.add_argument("--seeds", type=lambda t: [int(v) for v in t.split(",")], default=[0],
                   help="comma-separated seeds; mean and std over them are reported")
    p.add_argument("--options", default=None, help='method options as JSON, e.g. {"steps": 500}')
    p.add_argument("--keep-labels", action="store_true", help="include every point's cluster in the JSON")
    p.add_argument("--json", default=None, help="write the record here (default: stdout)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from ..apps.clustering import digits_784, run_clustering

    if (args.dataset is None) == (args.data is None):
        raise ValueError("give exactly one of --dataset digits|digits784 or --data X.npy")
    if args.dataset == "digits":
        from sklearn.datasets import load_digits

        digits = load_digits()
        x, labels, source = digits.data, digits.target, "sklearn load_digits (1797 x 64)"
    elif args.dataset == "digits784":
        x, labels = digits_784()
        source = "digits784: 10,000 sklearn digits upsampled to 28x28 + N(0, 1) noise (seed 0)"
    else:
        x = _load_npy("--data", args.data)
        labels = _load_npy("--labels", args.labels) if args.labels else None
        if x.ndim != 2:
            raise ValueError(f"--data must hold a 2-D array (points x features), got shape {x.shape}")
        if labels is not None and labels.shape != (x.shape[0],):
            raise ValueError(f"--labels must hold one label per point: shape ({x.shape[0]},), got {labels.shape}")
        source = args.data
    options = json_object("--options", args.options, '{"steps": 500}')
    results = []
    for seed in args.seeds:
        result = run_clustering(args.method, args.k, x, labels, seed=seed, **options)
        if not args.keep_labels:
            result.pop("labels")
        scores = {m: round(result[m], 4) for m in ("accuracy", "purity", "nmi") if m in result}
        log(f"{args.method} k={args.k} seed={seed}: {scores} ({result['seconds']:.1f} s)")
        results.append(result)
    record = {"method": args.method, "k": args.k, "data": source, "runs": results}
    for metric in ("accuracy", "purity", "nmi"):
        values = np.array([r[metric] for r in results if metric in r])
        if len(values):
            record[metric] = float(values.mean())
            record[f"{metric}_std"] = float(values.std(ddof=1)) if len(values) > 1 else 0.0
    emit_json(record, args.json, log=log)
    return 0


def _load_npy(flag: str, path: str):
    import numpy as np

    if not Path(path).is_file():
        raise ValueError(f"{flag}: no such file {path!r} (expected a .npy array)")
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise ValueError(f"{flag}: {path!r} is not a readable .npy array ({exc})") from None
