"""``clusterformer approx``: how well clustered attention approximates a pretrained model without retraining.

The clustered-attention paper (section 4.3, Table 4) swaps the attention of a pretrained RoBERTa for
clustered / improved-clustered attention with no retraining. Here the pretrained model is all-MiniLM-L6-v2
(a 6-layer BERT sentence encoder), and the measurements are:

* ``cosine``: mean cosine similarity between the patched and the unpatched model's pooled sentence
  embeddings, per dataset -- MR, SUBJ and CR sentences, and 20NEWS test documents truncated to the model's
  512 positions (the long inputs, where clustering actually drops information). ``cosine_mean`` is the mean
  over every text embedded.
* ``accuracy``: logistic regression (scikit-learn, default C) on the frozen embeddings, 10-fold
  cross-validation with the same seeded folds for the unpatched and every patched model (SentEval-style
  protocol), on MR, SUBJ and CR.

The unpatched model is embedded once per invocation; every requested cluster count is a separate patch.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from .. import hf
from .._checks import check_choice, check_int
from ..attention.clustered import QUERY_CLUSTERINGS
from ..attention.registry import describe, names_where
from ..data.classification import kfold_indices, load_20news, load_sentence_task

__all__ = ["ApproxConfig", "logistic_cv_accuracy", "run_approx"]

SENTENCE_TASKS = ("mr", "subj", "cr")


@dataclass
class ApproxConfig:
    """Options of :func:`run_approx` (the CLI flags of ``clusterformer approx``)."""

    model: str = "minilm"
    attention: str = "improved-clustered"
    clusters: list[int] = field(default_factory=lambda: [25])
    topk: int | None = None  # improved-clustered; None = the mechanism's default (32)
    bits: int | None = None
    iterations: int | None = None  # Lloyd iterations; None = the mechanism's default (10)
    query_clustering: str = "hamming"  # or "euclidean": k-means on the queries themselves
    seed: int = 0
    data_dir: str | None = None
    limit: int | None = None  # sentences per sentence task (None: all)
    long_docs: int = 200  # 20NEWS test documents (cosine only)
    sentence_len: int = 128  # tokens per sentence (MiniLM was trained at 128)
    long_len: int = 512  # tokens per 20NEWS document (the model's positions)
    folds: int = 10
    batch_size: int = 64
    device: str = "cpu"
    progress: bool = True

    def __post_init__(self) -> None:
        # the mechanisms that run on a pretrained model's own q, k, v as a sequence, with no parameters to train
        usable = names_where(interface_mode="sequence")
        if self.attention not in usable:
            raise ValueError(f"attention must be {' or '.join(map(repr, usable))}; got {self.attention!r}")
        if not self.clusters or any(not isinstance(c, int) or c < 1 for c in self.clusters):
            raise ValueError(f"clusters must be a non-empty list of positive integers; got {self.clusters!r}")
        if self.topk is not None:
            if "topk" not in describe(self.attention)["options"]:
                with_topk = [name for name in usable if "topk" in describe(name)["options"]]
                raise ValueError(f"topk is an option of {', '.join(map(repr, with_topk))} only")
            check_int("topk", self.topk, minimum=1)
        for name in ("long_docs", "folds", "batch_size", "sentence_len", "long_len"):
            check_int(name, getattr(self, name), minimum=0 if name == "long_docs" else 1)
        check_choice("query_clustering", self.query_clustering, QUERY_CLUSTERINGS)
        if self.folds < 2:
            raise ValueError(f"folds must be >= 2; got {self.folds}")


def logistic_cv_accuracy(features: torch.Tensor, labels: list[int], folds: int = 10, seed: int = 0) -> float:
    """Mean test accuracy of scikit-learn logistic regression over seeded k-fold splits."""
    try:
        from sklearn.linear_model import LogisticRegression
    except ImportError:
        raise ValueError("scikit-learn is needed: pip install 'clusterformer[hf]'") from None
    x = features.double().numpy()
    y = torch.tensor(labels).numpy()
    correct = 0
    for train, test in kfold_indices(len(labels), folds, seed):
        clf = LogisticRegression(max_iter=2000).fit(x[train], y[train])
        correct += int((clf.predict(x[test]) == y[test]).sum())
    return correct / len(labels)


def run_approx(config: ApproxConfig, log: Callable[[str], None] = print) -> dict:
    """Embed with the unpatched model and with the patched one for each cluster count; return the record
    written by ``clusterformer approx --json``."""
    started = time.perf_counter()
    model, tokenizer = hf.load_pretrained(config.model, device=config.device)
    texts: dict[str, list[str]] = {}
    labels: dict[str, list[int]] = {}
    for task in SENTENCE_TASKS:
        data = load_sentence_task(task, config.data_dir, config.limit)
        texts[task], labels[task] = data.train_texts, data.train_labels
    if config.long_docs:
        news = load_20news(config.data_dir)
        step = max(1, len(news.test_texts) // config.long_docs)  # spread over the (group-sorted) test set
        texts["20news"] = news.test_texts[::step][: config.long_docs]

    def embed_all(tag: str) -> dict[str, torch.Tensor]:
        out = {}
        for name, items in texts.items():
            t0 = time.perf_counter()
            max_len = config.long_len if name == "20news" else config.sentence_len
            out[name] = hf.embed(model, tokenizer, items, batch_size=config.batch_size if name != "20news" else 8,
                                 max_length=max_len, progress=config.progress)
            log(f"[{tag}] embedded {len(items)} {name} texts in {time.perf_counter() - t0:.1f} s")
        return out

    def accuracies(emb: dict[str, torch.Tensor]) -> dict[str, float]:
        return {task: logistic_cv_accuracy(emb[task], labels[task], config.folds, config.seed)
                for task in SENTENCE_TASKS}

    t0 = time.perf_counter()
    reference = embed_all("unpatched")
    unpatched = {"accuracy": accuracies(reference), "seconds": time.perf_counter() - t0}
    log(f"[unpatched] accuracy {unpatched['accuracy']}")
    rows = []
    for clusters in config.clusters:
        options: dict = {"clusters": clusters, "seed": config.seed}
        if config.topk is not None:
            options["topk"] = config.topk
        if config.bits is not None:
            options["bits"] = config.bits
        if config.iterations is not None:
            options["iterations"] = config.iterations
        if config.query_clustering != "hamming":
            options["query_clustering"] = config.query_clustering
        hf.patch(model, config.attention, **options)
        t0 = time.perf_counter()
        try:
            emb = embed_all(f"{config.attention} C={clusters}")
        finally:
            hf.unpatch(model)
        cosine = {name: float((emb[name] * reference[name]).sum(-1).mean()) for name in emb}
        total = sum(len(v) for v in emb.values())
        row = {
            "clusters": clusters, "options": options,
            "cosine_mean": sum(float((emb[n] * reference[n]).sum(-1).sum()) for n in emb) / total,
            "cosine": cosine, "cosine_min": {n: float((emb[n] * reference[n]).sum(-1).min()) for n in emb},
            "accuracy": accuracies(emb), "seconds": time.perf_counter() - t0,
        }
        log(f"[{config.attention} C={clusters}] cosine {cosine} accuracy {row['accuracy']}")
        rows.append(row)
    import transformers

    record = {
        "model": config.model, "attention": config.attention, "rows": rows, "unpatched": unpatched,
        "examples": {name: len(items) for name, items in texts.items()},
        "protocol": (f"cosine of L2-normalised mean-pooled embeddings to the unpatched model; logistic regression "
                     f"{config.folds}-fold CV (seed {config.seed}) on frozen embeddings"),
        "config": asdict(config), "wall_seconds": time.perf_counter() - started, "device": config.device,
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads", "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if len(rows) == 1:  # the headline numbers at the top level too
        record.update(cosine_mean=rows[0]["cosine_mean"], accuracy=rows[0]["accuracy"])
    return record
