"""Where the real datasets are (``$CLUSTERFORMER_DATA``, else ``../shared/data`` beside the checkout), and the mark
that skips a test without them."""

import os
from pathlib import Path

import pytest

SHARED = Path(os.environ.get("CLUSTERFORMER_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data")
needs_data = pytest.mark.skipif(not (SHARED / "README.md").is_file(), reason=f"real datasets not found at {SHARED}")
