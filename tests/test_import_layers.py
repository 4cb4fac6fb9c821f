"""Imports flow one way, downwards in docs/ARCHITECTURE.md's layout: no module imports a package listed above its
own, at the top of a file or inside a function (a lazy import is still a dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "clusterformer"
# top to bottom, as docs/ARCHITECTURE.md lists them; a unit may import only units below it
ORDER = ["__main__", "cli", "apps", "train", "bench", "hf", "data", "models", "attention", "ops", "clustering",
         "masks", "distributed", "_checks", "_io", "_specs"]


def _imports(path: Path) -> set[str]:
    """The top-level units of clusterformer that the file at ``path`` imports, relative or absolute."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(parts[:-1])
            base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
            target = [*base, *(node.module.split(".") if node.module else [])]
            if target:
                found.add(target[0])
            elif node.level == len(parts):  # `from .. import x` at the package's top: x is the unit
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            found.update(n.split(".")[1] for n in names if n and n.startswith("clusterformer."))
    return found


def test_every_import_goes_down_the_layers():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts == ("__init__",):
            continue
        unit = parts[0]
        assert unit in ORDER, f"{unit} is not in the layer list: add it where docs/ARCHITECTURE.md places it"
        for target in _imports(path) - {unit}:
            if target in ORDER and ORDER.index(target) < ORDER.index(unit):
                upward.append(f"{path.relative_to(PACKAGE)} imports {target}, a layer above {unit}")
    assert not upward, "\n".join(upward)
