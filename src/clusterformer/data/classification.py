"""Text classification data: MR, CR, SUBJ, MPQA (10-fold CV), 20NEWS (by-date split), IMDB (train/test), and
any ``label<space>text`` or ``label<TAB>text`` file.

Every loader returns plain Python lists (texts and integer labels); tokenisation is separate
(:mod:`clusterformer.data.tokenize`). A missing or malformed file raises ``ValueError`` naming the file and
what was expected.
"""

from __future__ import annotations

import tarfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .._checks import check_int
from .paths import resolve_data_dir

__all__ = [
    "CLASSIFICATION_TASKS",
    "ClassificationData",
    "kfold_indices",
    "load_20news",
    "load_classification_task",
    "load_imdb",
    "load_labeled_file",
    "load_sentence_task",
]

# Sentence tasks without an official split: file under the data directory (see its README).
SENTENCE_FILES = {"mr": "mr/rt-polarity.all", "cr": "cr/custrev.all", "subj": "subj/subj.all",
                  "mpqa": "mpqa/mpqa.all"}
CLASSIFICATION_TASKS = (*SENTENCE_FILES, "20news", "imdb")


@dataclass
class ClassificationData:
    """Texts and labels; ``test_*`` empty for tasks evaluated by cross-validation."""

    name: str
    train_texts: list[str]
    train_labels: list[int]
    test_texts: list[str]
    test_labels: list[int]
    label_names: list[str]

    @property
    def num_classes(self) -> int:
        return len(self.label_names)


def _read_text(path: Path) -> str:
    """UTF-8 when the bytes are valid UTF-8, else Latin-1 (MR and SUBJ are Latin-1)."""
    if not path.is_file():
        raise ValueError(f"expected a file at {str(path)!r}, found {'a directory' if path.exists() else 'nothing'}")
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def load_labeled_file(path: str | Path, limit: int | None = None) -> tuple[list[str], list[int], list[str]]:
    """Lines ``label<space>text`` or ``label<TAB>text`` (UTF-8 or Latin-1). Lines are split on "\\n" only (MR and
    SUBJ hold \\x85 bytes that ``str.splitlines`` would treat as breaks); blank lines are skipped.

    A line with a label and no text is an example with empty text (CR and MPQA hold a few; their official sizes
    count them). Labels may be integers or names; names are mapped to 0..C-1 in sorted order. Returns (texts, labels,
    label_names). ``limit`` keeps the first ``limit`` examples (for tests and quick runs)."""
    path = Path(path)
    texts, raw = [], []
    for number, line in enumerate(_read_text(path).split("\n"), start=1):
        line = line.rstrip("\r")
        if not line.strip():
            continue
        sep = "\t" if "\t" in line and " " not in line.split("\t", 1)[0] else " "  # TSV or "label text"
        label, _, text = line.partition(sep)
        if not label.strip():
            raise ValueError(f"{path}:{number}: expected 'label<space>text' or 'label<TAB>text', got {line[:60]!r}")
        raw.append(label.strip())
        texts.append(text.strip())
        if limit is not None and len(texts) >= limit:
            break
    if not texts:
        raise ValueError(f"{path} holds no examples (expected lines 'label<space>text')")
    if all(r.lstrip("-").isdigit() for r in raw):
        values = sorted({int(r) for r in raw})
        if values != list(range(len(values))):
            raise ValueError(f"{path}: integer labels must be 0..C-1, got {values[:10]}")
        return texts, [int(r) for r in raw], [str(v) for v in values]
    names = sorted(set(raw))
    index = {n: i for i, n in enumerate(names)}
    return texts, [index[r] for r in raw], names


def load_sentence_task(name: str, data_dir: str | Path | None = None, limit: int | None = None) -> ClassificationData:
    """MR, CR, SUBJ or MPQA: all examples in ``train_*`` (the protocol is 10-fold CV, :func:`kfold_indices`).
    The files list one class, then the other: shuffle (the folds do)."""
    if name not in SENTENCE_FILES:
        raise ValueError(f"unknown sentence task {name!r}; expected one of {', '.join(SENTENCE_FILES)}")
    texts, labels, names = load_labeled_file(resolve_data_dir(data_dir) / SENTENCE_FILES[name], limit=None)
    if limit is not None:  # a seeded, class-balanced-ish slice (the file lists one class, then the other)
        order = [i for _, half in kfold_indices(len(texts), 2, seed=0) for i in half][:limit]
        texts, labels = [texts[i] for i in order], [labels[i] for i in order]
    return ClassificationData(name, texts, labels, [], [], names)


def _tar_documents(path: Path, split_prefix: str, encoding: str, limit: int | None):
    """Files under ``split_prefix/<label>/`` of a tar.gz: yields (label folder, text), in archive order."""
    if not path.is_file():
        raise ValueError(f"expected the archive {str(path)!r}; see the data README for where it comes from")
    counts: dict[str, int] = {}
    try:
        with tarfile.open(path, "r:gz") as archive:
            for member in archive:
                parts = member.name.split("/")
                if not member.isfile() or len(parts) < 3 or "/".join(parts[:-2]) != split_prefix:
                    continue
                label = parts[-2]
                if limit is not None and counts.get(label, 0) >= limit:
                    continue
                counts[label] = counts.get(label, 0) + 1
                yield label, archive.extractfile(member).read().decode(encoding)
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise ValueError(f"{path} is not a readable .tar.gz archive ({exc})") from None


def load_20news(data_dir: str | Path | None = None, limit_per_class: int | None = None) -> ClassificationData:
    """20 Newsgroups by-date: train 11,314 / test 7,532, labels = sorted group names (Latin-1, headers kept)."""
    path = resolve_data_dir(data_dir) / "20news" / "20news-bydate.tar.gz"
    splits = {}
    for split in ("train", "test"):
        docs = list(_tar_documents(path, f"20news-bydate-{split}", "latin-1", limit_per_class))
        if not docs:
            raise ValueError(f"{path} has no documents under 20news-bydate-{split}/<group>/")
        splits[split] = docs
    names = sorted({label for label, _ in splits["train"]})
    index = {n: i for i, n in enumerate(names)}
    tr, te = splits["train"], splits["test"]
    return ClassificationData("20news", [t for _, t in tr], [index[g] for g, _ in tr],
                              [t for _, t in te], [index[g] for g, _ in te], names)


def load_imdb(data_dir: str | Path | None = None, limit_per_class: int | None = None) -> ClassificationData:
    """IMDB reviews: train 25,000 / test 25,000, neg = 0, pos = 1 (UTF-8; ``<br />`` tags kept)."""
    path = resolve_data_dir(data_dir) / "imdb" / "aclImdb_train_test.tar.gz"
    out = {}
    for split in ("train", "test"):
        docs = [(g, t) for g, t in _tar_documents(path, f"aclImdb/{split}", "utf-8", limit_per_class)
                if g in ("neg", "pos")]
        if not docs:
            raise ValueError(f"{path} has no reviews under aclImdb/{split}/{{neg,pos}}/")
        out[split] = docs
    index = {"neg": 0, "pos": 1}
    tr, te = out["train"], out["test"]
    return ClassificationData("imdb", [t for _, t in tr], [index[g] for g, _ in tr],
                              [t for _, t in te], [index[g] for g, _ in te], ["neg", "pos"])


def load_classification_task(name: str, data_dir: str | Path | None = None,
                             limit: int | None = None) -> ClassificationData:
    """Any of :data:`CLASSIFICATION_TASKS`; ``limit`` = examples (sentence tasks) or documents per class."""
    if name in SENTENCE_FILES:
        return load_sentence_task(name, data_dir, limit)
    if name == "20news":
        return load_20news(data_dir, limit)
    if name == "imdb":
        return load_imdb(data_dir, limit)
    raise ValueError(f"unknown classification task {name!r}; expected one of {', '.join(CLASSIFICATION_TASKS)}")


def kfold_indices(n: int, k: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """``k`` (train, test) index lists of a seeded random permutation of ``range(n)``; fold i tests on every
    k-th example of the permutation starting at i, so fold sizes differ by at most one."""
    check_int("n", n, minimum=1)
    check_int("k", k, minimum=2)
    if k > n:
        raise ValueError(f"k must be <= n, got k={k}, n={n}")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    folds = []
    for i in range(k):
        test = order[i::k]
        held = set(test)
        folds.append(([j for j in order if j not in held], test))
    return folds
