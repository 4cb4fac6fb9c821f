"""``clusterformer approx``: clustered attention inside a pretrained model without retraining (the clustered-
attention paper's experiment): cosine to the unpatched embeddings and downstream accuracy."""

from __future__ import annotations

import argparse

from .._io import emit_json
from ._args import int_list, log


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("approx", help="clustered attention inside a pretrained model, no retraining: cosine to "
                                      "the unpatched embeddings and downstream accuracy (needs [minilm])")
    p.add_argument("--model", default="minilm", help="pretrained model (minilm: all-MiniLM-L6-v2)")
    p.add_argument("--attention", default="improved-clustered", choices=["clustered", "improved-clustered"])
    p.add_argument("--clusters", type=int_list, default=[25], help="cluster counts, e.g. 8,16,25,32")
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..apps.approx import ApproxConfig, run_approx

    config = ApproxConfig(model=args.model, attention=args.attention, clusters=args.clusters, topk=args.topk,
                          bits=args.bits, iterations=args.iterations, query_clustering=args.query_clustering,
                          seed=args.seed, data_dir=args.data_dir, limit=args.limit, long_docs=args.long_docs,
                          folds=args.folds, batch_size=args.batch_size, device=args.device,
                          progress=not args.no_progress)
    emit_json(run_approx(config, log=log), args.json, log=log)
    return 0
