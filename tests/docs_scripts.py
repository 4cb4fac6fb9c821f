"""The scripts under ``docs/scripts`` (run by hand to measure the docs' tables, not part of the package), loaded as
modules so that tests can call their functions."""

import importlib.util
from pathlib import Path
from types import ModuleType

DOCS_SCRIPTS = Path(__file__).resolve().parents[1] / "docs" / "scripts"


def load_docs_script(path: str | Path) -> ModuleType:
    """``docs/scripts/<path>.py`` (a bare name) or the file at ``path``, executed as a fresh module: its work runs only
    under ``if __name__ == "__main__"``."""
    path = Path(path)
    if path.suffix != ".py":
        path = DOCS_SCRIPTS / f"{path}.py"
    spec = importlib.util.spec_from_file_location(f"docs_script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
