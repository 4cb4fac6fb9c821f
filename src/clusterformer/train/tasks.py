"""The training tasks: data, tokenisation, model head and metric for each ``--task``.

| task | data | protocol | metric |
|---|---|---|---|
| mr, cr, subj, mpqa | ``label text`` lines | 10-fold CV (``--fold``/``--cv``) or a seeded 90/10 split | accuracy |
| 20news | by-date archive | train / test | accuracy |
| imdb | aclImdb archive | train / test; bytes, 4,000 (LRA text) by default | accuracy |
| text-classification | ``--train-file`` / ``--test-file`` (label text or TSV) | as given | accuracy |
| wikiqa | question/answer pairs | train / filtered test (questions with a correct answer) | MAP, MRR |
| shakespeare-char | one text file | first 90% / last 10% | bits per character |
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..data import ByteTokenizer, WordTokenizer, kfold_indices, load_classification_task, load_labeled_file
from ..data.paths import resolve_data_dir
from ..data.tokenize import PretrainedTokenizer

__all__ = ["TASKS", "PreparedTask", "prepare_task"]

TASKS = ("mr", "cr", "subj", "mpqa", "20news", "imdb", "wikiqa", "shakespeare-char", "text-classification")


@dataclass
class PreparedTask:
    """Tensors ready for training. kind: "classification" (ranking is classification of pairs) or "lm".

    classification: ``train``/``test`` hold ``ids`` (n, L), ``pad`` (n, L), ``labels`` (n,); ranking adds
    ``groups`` (n,) question ids to ``test``. lm: ``train``/``test`` hold ``stream`` (T,) token ids."""

    name: str
    kind: str
    train: dict[str, torch.Tensor]
    test: dict[str, torch.Tensor]
    vocab_size: int
    num_classes: int
    tokenizer: str  # serialised tokenizer (checkpointed, reused by eval)
    metric: str
    info: dict[str, Any] = field(default_factory=dict)


def _tokenizer(kind: str, texts: list[str], vocab_size: int, state: str | None, pairs: bool = False):
    if kind == "bytes" or state == "bytes":
        return ByteTokenizer()
    pretrained = state if state and state.startswith("pretrained:") else kind
    if pretrained.startswith("pretrained:"):
        return PretrainedTokenizer(pretrained.split(":", 1)[1])
    if state is not None:
        return WordTokenizer.from_str(state)
    if kind != "word":
        raise ValueError(f"tokenizer must be 'word', 'bytes' or 'pretrained:NAME', got {kind!r}")
    return WordTokenizer.train(texts, vocab_size=vocab_size, pairs=pairs)


def _encode(tok, texts, labels, max_len) -> dict[str, torch.Tensor]:
    ids, pad = tok.encode(texts, max_len)
    return {"ids": ids, "pad": pad, "labels": torch.tensor(labels, dtype=torch.long)}


def prepare_task(
    name: str, *, data_dir: str | Path | None, max_len: int, tokenizer: str = "auto", vocab_size: int = 20000,
    seed: int = 0, fold: int | None = None, folds: int = 10, limit: int | None = None,
    train_file: str | None = None, test_file: str | None = None, tokenizer_state: str | None = None,
) -> PreparedTask:
    """Load, split and tokenise task ``name``. ``limit`` keeps a small slice (examples, or documents per class
    for 20news/imdb, or pairs for wikiqa, or characters for shakespeare-char) for tests and quick runs.
    ``tokenizer_state`` reuses a saved tokenizer (evaluation of a checkpoint)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; expected one of {', '.join(TASKS)}")
    if tokenizer == "auto":
        tokenizer = "bytes" if name == "imdb" else "word"
    if name == "shakespeare-char":
        return _shakespeare(data_dir, limit, tokenizer_state)
    if name == "wikiqa":
        return _wikiqa(data_dir, max_len, vocab_size, limit, tokenizer_state)
    if name == "text-classification":
        if not train_file or not test_file:
            raise ValueError("task 'text-classification' needs --train-file and --test-file")
        tr_x, tr_y, names = load_labeled_file(train_file, limit)
        te_x, te_y, te_names = load_labeled_file(test_file, limit)
        if te_names != names and not set(te_names) <= set(names):
            raise ValueError(f"{test_file} has labels {te_names} not in the training labels {names}")
        if te_names != names:  # names, remapped to the training indices
            index = {n: i for i, n in enumerate(names)}
            te_y = [index[te_names[y]] for y in te_y]
        info = {"protocol": "given train/test files"}
    else:
        data = load_classification_task(name, data_dir, limit)
        names = data.label_names
        if data.test_texts:
            tr_x, tr_y, te_x, te_y = data.train_texts, data.train_labels, data.test_texts, data.test_labels
            info = {"protocol": "official train/test split"}
        else:  # sentence tasks: a fold of k-fold CV, or a seeded 90/10 split
            k = folds if fold is not None else 10
            index = 0 if fold is None else fold
            if not 0 <= index < k:
                raise ValueError(f"fold must be in [0, {k}), got {index}")
            train_idx, test_idx = kfold_indices(len(data.train_texts), k, seed)[index]
            tr_x = [data.train_texts[i] for i in train_idx]
            tr_y = [data.train_labels[i] for i in train_idx]
            te_x = [data.train_texts[i] for i in test_idx]
            te_y = [data.train_labels[i] for i in test_idx]
            info = {"protocol": f"fold {index} of {k}-fold CV (seed {seed})" if fold is not None
                    else f"seeded 90/10 split (seed {seed})"}
    tok = _tokenizer(tokenizer, tr_x, vocab_size, tokenizer_state)
    return PreparedTask(name, "classification", _encode(tok, tr_x, tr_y, max_len), _encode(tok, te_x, te_y, max_len),
                        tok.vocab_size, len(names), tok.to_str(), "accuracy", {**info, "labels": names})


def _read_lines(path: Path) -> list[str]:
    if not path.is_file():
        raise ValueError(f"expected the file {str(path)!r}")
    return path.read_text(encoding="utf-8").split("\n")


def _wikiqa(data_dir, max_len, vocab_size, limit, state) -> PreparedTask:
    root = resolve_data_dir(data_dir) / "wikiqa"
    splits = {}
    for split in ("train", "test"):
        a, b = _read_lines(root / split / "a.toks"), _read_lines(root / split / "b.toks")
        ids, sim = _read_lines(root / split / "id.txt"), _read_lines(root / split / "sim.txt")
        n = len([x for x in sim if x.strip()])
        if not (len(a) >= n and len(b) >= n and len(ids) >= n):
            raise ValueError(f"{root / split}: a.toks, b.toks, id.txt and sim.txt must have one line per pair")
        rows = [(a[i], b[i], ids[i].strip(), int(sim[i])) for i in range(n)]
        if limit is not None:
            rows = rows[:limit]
        splits[split] = rows
    test = splits["test"]
    positives = {q for _, _, q, y in test if y == 1}
    test = [r for r in test if r[2] in positives]  # the filtered test set: questions with a correct answer
    tr = splits["train"]
    tok = WordTokenizer.from_str(state) if state else WordTokenizer.train(
        [q for q, _, _, _ in tr] + [a for _, a, _, _ in tr], vocab_size=vocab_size, pairs=True)

    def encode(rows):
        ids, pad = tok.encode_pairs([(q, a) for q, a, _, _ in rows], max_len)
        qids = {q: i for i, q in enumerate(dict.fromkeys(r[2] for r in rows))}
        return {"ids": ids, "pad": pad, "labels": torch.tensor([r[3] for r in rows], dtype=torch.long),
                "groups": torch.tensor([qids[r[2]] for r in rows], dtype=torch.long)}

    return PreparedTask("wikiqa", "classification", encode(tr), encode(test), tok.vocab_size, 2, tok.to_str(),
                        "map_mrr", {"protocol": "train / filtered test", "test_questions": len(positives)})


def _shakespeare(data_dir, limit, state) -> PreparedTask:
    path = resolve_data_dir(data_dir) / "tinyshakespeare" / "input.txt"
    if not path.is_file():
        raise ValueError(f"expected the file {str(path)!r}")
    text = path.read_text(encoding="utf-8")
    if limit is not None:
        text = text[:limit]
    chars = state.split("\x00") if state else sorted(set(text))
    index = {c: i + 1 for i, c in enumerate(chars)}  # id 0 is the embedding's padding index: no character
    unknown = set(text) - set(index)
    if unknown:
        raise ValueError(f"{path} holds characters the saved vocabulary lacks: {sorted(unknown)[:10]}")
    stream = torch.tensor([index[c] for c in text], dtype=torch.long)
    cut = int(len(stream) * 0.9)
    vocab = len(chars) + 1  # id 0 (padding) is never a target: the head learns to give it no mass
    return PreparedTask("shakespeare-char", "lm", {"stream": stream[:cut]}, {"stream": stream[cut:]}, vocab,
                        vocab, "\x00".join(chars), "bpc", {"protocol": "first 90% / last 10% of characters"})


def ranking_metrics(scores: torch.Tensor, labels: torch.Tensor, groups: torch.Tensor) -> dict[str, float]:
    """MAP and MRR over groups (questions) that hold at least one positive."""
    aps, rrs = [], []
    for g in torch.unique(groups).tolist():  # per question, once per evaluation (not a hot path)
        mask = groups == g
        order = torch.argsort(scores[mask], descending=True, stable=True)
        rel = labels[mask][order].tolist()
        if not any(rel):
            continue
        hits, precisions = 0, []
        for rank, r in enumerate(rel, start=1):
            if r:
                hits += 1
                precisions.append(hits / rank)
        aps.append(sum(precisions) / hits)
        rrs.append(1.0 / (rel.index(1) + 1))
    if not aps:
        return {"map": math.nan, "mrr": math.nan}
    return {"map": sum(aps) / len(aps), "mrr": sum(rrs) / len(rrs)}
