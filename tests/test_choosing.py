"""The README's "Which attention should I use?" table: ``results/choosing.json`` is what
``docs/scripts/choosing_table.py`` derives from the registry and the committed records today, so a changed record,
default or capability shows up here, and the README's generated block (checked by ``report --docs --check``)
shows the same rows."""

from __future__ import annotations

import json
from pathlib import Path

from docs_scripts import load_docs_script

ROOT = Path(__file__).resolve().parents[1]


def test_the_committed_table_is_what_the_records_give():
    from clusterformer.attention import names

    committed = json.loads((ROOT / "results" / "choosing.json").read_text())
    assert sorted(row["mechanism"] for row in committed) == sorted(names())  # every registered mechanism, once
    assert load_docs_script("choosing_table").build_table() == committed


def test_every_cell_is_measured_or_says_so():
    for row in json.loads((ROOT / "results" / "choosing.json").read_text()):
        for key, value in row.items():
            assert isinstance(value, str) and value.strip(), (row["mechanism"], key)
