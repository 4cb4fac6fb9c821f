"""Running code in a fresh interpreter with the C++ kernels turned off (``CLUSTERFORMER_NO_EXTENSIONS=1``): a
process that has loaded a kernel cannot unload it, so the fallback paths are tested in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys


def run_without_extensions(code: str) -> str:
    """Run ``code`` with ``python -c`` and the kernels off; its standard output (a failure raises, with its
    stderr)."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "CLUSTERFORMER_NO_EXTENSIONS": "1"})
    if result.returncode:
        raise AssertionError(f"the subprocess failed:\n{result.stderr}")
    return result.stdout
