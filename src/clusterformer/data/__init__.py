"""Datasets of the papers' tasks, read from local copies of the public originals (``--data-dir``).

See ``../shared/data/README.md`` in this project for the files; :func:`resolve_data_dir` says where they are
looked for. Nothing here downloads.
"""

from .classification import (
    CLASSIFICATION_TASKS,
    ClassificationData,
    kfold_indices,
    load_20news,
    load_classification_task,
    load_imdb,
    load_labeled_file,
    load_sentence_task,
)
from .paths import resolve_data_dir
from .tokenize import ByteTokenizer, WordTokenizer

__all__ = [
    "CLASSIFICATION_TASKS",
    "ByteTokenizer",
    "ClassificationData",
    "WordTokenizer",
    "kfold_indices",
    "load_20news",
    "load_classification_task",
    "load_imdb",
    "load_labeled_file",
    "load_sentence_task",
    "resolve_data_dir",
]
