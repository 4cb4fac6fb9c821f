"""Datasets of the papers' tasks, read from local copies of the public originals (``--data-dir``).

See ``../shared/data/README.md`` in this project for the files; :func:`resolve_data_dir` says where they are
looked for. Nothing here downloads.
"""

from . import classification
from .classification import *  # noqa: F403  (the classification tasks' loaders, as that module lists them)
from .paths import resolve_data_dir
from .tokenize import ByteTokenizer, WordTokenizer

__all__ = ["ByteTokenizer", "WordTokenizer", "resolve_data_dir"]
__all__ += classification.__all__
