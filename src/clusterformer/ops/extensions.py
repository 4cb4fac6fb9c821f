"""The library's C++ kernels (``ops/csrc``): built on first use, for this CPU, or reported unavailable.

Each :class:`CppExtension` compiles one source with ``torch.utils.cpp_extension.load`` the first time it is needed
(about 30 s, once per machine and source: the build is cached under ``TORCH_EXTENSIONS_DIR``, default
~/.cache/torch_extensions) with the CPU's vector width (AVX2 with FMA, or AVX-512) and OpenMP. Without a C++
compiler or ninja, after a failed build, or with ``CLUSTERFORMER_NO_EXTENSIONS=1``, :meth:`CppExtension.load`
returns None and :attr:`CppExtension.error` says why; every caller then runs its PyTorch composition of the same
function. The headers the sources share (``csrc/*.h``) enter the build as a define of their digest
(:func:`header_digest`): torch's build cache hashes the sources and the flags, so an edit to a header rebuilds every
extension as an edit to its source does. A build lock older than ten minutes, which an interrupted build leaves and
torch would wait on forever, is removed with a warning (:func:`clear_stale_lock`).
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from pathlib import Path
from typing import Any

import torch

__all__ = ["CppExtension", "build_flags", "header_digest"]

CSRC = Path(__file__).with_name("csrc")


def build_flags() -> tuple[str, list[str]]:
    """The build's name suffix and compiler flags for this CPU: vector instructions as wide as torch itself uses
    here, and the reassociation that lets the compiler vectorise the dot products (no -ffast-math: the kernels
    test for -inf)."""
    capability = torch.backends.cpu.get_cpu_capability()  # "DEFAULT", "AVX2", "AVX512", ... (x86) or others
    flags = ["-O3", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
    if capability == "AVX512":
        flags += ["-mavx512f", "-mavx512dq", "-mavx2", "-mfma"]
    elif capability == "AVX2":
        flags += ["-mavx2", "-mfma"]
    return capability.lower(), flags


def header_digest() -> str:
    """A digest of the headers of ``ops/csrc`` (names and contents), which every build is given as the define
    ``CLUSTERFORMER_HEADERS``: it changes the build's flags, and so rebuilds the extensions, whenever a header does."""
    digest = hashlib.sha256()
    for header in sorted(CSRC.glob("*.h")):
        digest.update(header.name.encode())
        digest.update(header.read_bytes())
    return digest.hexdigest()[:16]


class CppExtension:
    """One C++ source of ``ops/csrc``, compiled on first :meth:`load` (thread-safe; one attempt per process).

    Args:
        stem: the source's file name without ``.cpp``; the build is named ``clusterformer_<stem>_<cpu>``.
        what: what the kernel is, for the one line printed before a first build.
    """

    def __init__(self, stem: str, what: str) -> None:
        self.stem, self.what = stem, what
        self.source = CSRC / f"{stem}.cpp"
        self._lock = threading.Lock()
        self._module: Any = None
        self.error: str | None = None  # why the kernel is not available; None when it is, or was not tried

    def load(self) -> Any:
        """The compiled module, built on first call; None (and the reason in :attr:`error`) when it cannot be."""
        with self._lock:
            if self._module is not None or self.error is not None:
                return self._module
            if os.environ.get("CLUSTERFORMER_NO_EXTENSIONS", "") not in ("", "0"):
                self.error = "disabled by CLUSTERFORMER_NO_EXTENSIONS"
                return None
            try:
                from torch.utils.cpp_extension import load, verify_ninja_availability

                verify_ninja_availability()
                suffix, flags = build_flags()
                name = f"clusterformer_{self.stem}_{suffix}"
                directory = _build_directory(name)
                clear_stale_lock(directory)
                if not (directory / f"{name}.so").exists():  # a first build takes a while: say so
                    print(f"clusterformer: compiling {self.what} for this CPU ({suffix}), once; about 30 s",
                          file=sys.stderr, flush=True)
                # -fopenmp: at::parallel_for is an inline OpenMP loop in torch's builds, serial without it. The
                # libgomp it links is torch's own, already loaded under the same soname: one OpenMP runtime.
                self._module = load(name=name, sources=[str(self.source)],
                                    extra_cflags=[*flags, "-fopenmp", f"-DCLUSTERFORMER_HEADERS={header_digest()}"],
                                    extra_ldflags=["-fopenmp"], verbose=False)
            except Exception as exc:  # no compiler, no ninja, a failed build: the PyTorch compositions remain
                text = str(exc).strip()
                self.error = f"{type(exc).__name__}: {text.splitlines()[-1] if text else exc}"
            return self._module

    def available(self) -> bool:
        """Whether the kernel is built (building it now if it was not)."""
        return self.load() is not None


STALE_LOCK_S = 600.0  # a build takes about 30 s: a lock this old was left by a build that did not finish


def clear_stale_lock(directory: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove ``directory``'s build lock when it is older than ``max_age_s``, saying so; True when removed.

    ``torch.utils.cpp_extension.load`` waits, silently and without end, for the ``lock`` file of a build that
    another process holds. A build interrupted (Ctrl-C, a killed job) leaves the file behind, and every later
    first use of the kernel then hangs at import. A lock older than any build is taken as such a leftover."""
    import time
    import warnings

    lock = directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:  # no lock: nothing to clear
        return False
    if age < max_age_s:
        return False
    warnings.warn(f"removing {lock}: a build lock {age:.0f} s old, left by an interrupted build of this kernel "
                  "(torch would wait for it forever)", RuntimeWarning, stacklevel=2)
    lock.unlink(missing_ok=True)
    return True


def _build_directory(name: str) -> Path:
    """Where ``torch.utils.cpp_extension.load`` builds ``name``: TORCH_EXTENSIONS_DIR, else its cache directory
    (~/.cache/torch_extensions/py311_cpu)."""
    from torch.utils import cpp_extension

    try:
        return Path(cpp_extension._get_build_directory(name, verbose=False))
    except Exception:  # a private helper: without it, assume a first build
        return Path(os.devnull)
