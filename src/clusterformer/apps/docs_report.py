"""Generated blocks in the docs: every results table and figure in README.md and docs/ is rendered from committed
records by ``clusterformer report --docs`` (and checked by ``clusterformer report --docs --check``, which CI runs).

A block is an HTML comment that names what to render, the rendered lines, and a closing comment::

    <!-- report: KIND ARG... [--option value ...] -->
    (generated lines, replaced on write)
    <!-- /report -->

The marker's words are split as a shell line (``shlex``: quote a value with spaces). An option takes every word up
to the next ``--option``. Paths are relative to the repository root (the directory ``report --docs`` runs in, or
``--root``). The generated lines are the rendering between two blank lines. KINDs:

``compare DIR [--tasks t1,t2] [--entries e1,e2] [--columns c1,c2]``
    the per-task table of a comparison grid (DIR holds the ``summary.json`` of ``clusterformer compare``), as its
    ``summary.md`` shows it; several tasks: one table each under a bold title. ``--entries`` picks rows (in that
    order), ``--columns`` columns by header: the exact header or a unique prefix of it (``score``, ``time vs full``).
``grids DIR DIR ... [--tasks t1,t2]``
    the table of ``clusterformer report --grids`` across grids (entries as rows, a column per grid and task).
``bench FILE [--lengths 4096,16384] [--names n1,n2] [--pass forward|forward+backward]``
    a layer benchmark (``clusterformer bench attention --json``) as each mechanism's time relative to full
    attention's at each length (full's row: its time in ms); default: every length and name, forward+backward.
    ``--layout rows [--columns ...]``: instead, ``clusterformer bench report``'s table (a row per mechanism and
    length: times, memory, speed-ups over full), rows picked by ``--names`` / ``--lengths``, columns as for compare.
``records FILE --columns a,b.c [--where key=value ...] [--headers "A,B C"] [--format a=.3f,b.c=.1%] [--path f.g]``
    a generic table, one row per record of a JSON list, of a JSON object's values (its keys as field ``_key``) or of
    JSON lines (``--path``: of the list or object at that field of the file); nested fields with dots; ``--where``
    keeps the records whose field prints as that value (strings as they are, other values as JSON:
    ``causal=true``); a field missing from a record prints "—"; a float without ``--format``: 4 significant digits.
``figure pareto --grids DIR ... --out docs/img/NAME.png [--alt TEXT]``
    score against training-step time relative to full attention's in the same grid, a panel per task, every entry
    of every grid (a colour per mechanism, a marker per grid) with its seeds' scores and mean ± std, the Pareto
    front drawn and its entries named; the block is the image's markdown line.
``figure speed FILE --out docs/img/NAME.png [--alt TEXT]``
    the layer benchmark's time and memory against N (``bench.plot``).

Rendering is deterministic (record order or sorted, fixed number formats), so ``--check`` is stable. ``--check``
writes nothing: it prints a unified diff of each block that differs and exits 1; for a figure it checks that its
records and its image exist (images are not compared byte for byte). A marker whose records are missing or
malformed, an unknown KIND or option, or a marker without its closing comment is an error naming the file and line.
A marker inside fenced code (``` or ~~~) is text, not a block, so a page can show the syntax.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shlex
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Block", "DocsReportError", "DocsResult", "check_docs", "default_docs", "find_blocks", "load_records",
           "load_summary", "render", "render_bench", "render_bench_rows", "render_compare", "render_grids",
           "render_records", "update_docs", "write_docs"]

OPEN = re.compile(r"^\s*<!--\s*report:\s*(?P<spec>.*?)\s*-->\s*$")
CLOSE = re.compile(r"^\s*<!--\s*/report\s*-->\s*$")
FENCE = re.compile(r"^\s{0,3}(?P<fence>`{3,}|~{3,})")
NONE = "—"


class DocsReportError(ValueError):
    """A marker that cannot be rendered: its message names the file and line."""


@dataclass(frozen=True)
class Block:
    """One generated block of a markdown file: the marker's words, its line (1-based) and the lines between the
    opening and the closing comment (``start``: the index of the first, ``end``: of the closing comment)."""

    path: Path
    line: int
    spec: str
    start: int
    end: int


# ---------------------------------------------------------------------------------------------------- parsing


def find_blocks(path: Path, lines: list[str]) -> list[Block]:
    """Every block of ``lines`` (the file ``path``), in order; an unclosed or nested marker raises naming its line.
    Markers inside fenced code (``` or ~~~) are text, not blocks (so the syntax can be shown)."""
    blocks, opened, fence = [], None, None
    for i, line in enumerate(lines):
        marker = FENCE.match(line)
        if marker and opened is None and (fence is None or marker["fence"].startswith(fence)):
            fence = None if fence else marker["fence"]
            continue
        if fence:
            continue
        if OPEN.match(line):
            if opened is not None:
                raise DocsReportError(f"{path}:{i + 1}: a report marker inside the block opened at line "
                                      f"{opened + 1}; close it first with <!-- /report -->")
            opened = i
        elif CLOSE.match(line):
            if opened is None:
                raise DocsReportError(f"{path}:{i + 1}: <!-- /report --> without an opening report marker")
            blocks.append(Block(path, opened + 1, OPEN.match(lines[opened])["spec"], opened + 1, i))
            opened = None
    if opened is not None:
        raise DocsReportError(f"{path}:{opened + 1}: report marker without its closing <!-- /report -->")
    return blocks


def _parse(spec: str) -> tuple[str, list[str], dict[str, list[str]]]:
    """KIND, its positional words and its options (each: the words up to the next option)."""
    try:
        words = shlex.split(spec)
    except ValueError as exc:
        raise ValueError(f"cannot split the marker's words: {exc}") from None
    if not words:
        raise ValueError("empty report marker: expected <!-- report: KIND ARG... -->")
    kind, positional, options, current = words[0], [], {}, None
    for word in words[1:]:
        if word.startswith("--") and len(word) > 2:
            current = word[2:]
            if current in options:
                raise ValueError(f"option --{current} given twice")
            options[current] = []
        elif current is None:
            positional.append(word)
        else:
            options[current].append(word)
    return kind, positional, options


def _options(kind: str, options: dict[str, list[str]], allowed: dict[str, str]) -> dict[str, Any]:
    """Check ``options`` against ``allowed`` (name -> "one", "list" (comma-separated or several words) or "many"
    (several words)) and return them parsed."""
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"{kind}: unknown option(s) {', '.join('--' + u for u in unknown)}; expected "
                         f"{', '.join('--' + a for a in allowed) or 'none'}")
    parsed: dict[str, Any] = {}
    for name, words in options.items():
        if not words:
            raise ValueError(f"{kind}: --{name} needs a value")
        if allowed[name] == "one":
            if len(words) != 1:
                raise ValueError(f"{kind}: --{name} takes one value, got {len(words)} (quote a value with spaces)")
            parsed[name] = words[0]
        elif allowed[name] == "list":
            parsed[name] = [item.strip() for word in words for item in word.split(",") if item.strip()]
        else:
            parsed[name] = list(words)
    return parsed


# ---------------------------------------------------------------------------------------------------- records


def _resolve(root: Path, text: str) -> Path:
    path = Path(text)
    return path if path.is_absolute() else root / path


def load_summary(path: str | Path) -> tuple[str, dict]:
    """(grid name, summary) of a comparison directory or its ``summary.json``; ValueError naming the path when it
    is neither or is not a summary."""
    path = Path(path)
    file = path / "summary.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"{str(path)!r} is neither a comparison directory with summary.json nor a summary.json file")
    try:
        summary = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(summary, dict) or not isinstance(summary.get("tasks"), dict):
        raise ValueError(f"{file}: not a comparison summary (no 'tasks')")
    return (path if path.is_dir() else path.parent).name, summary


def load_records(path: str | Path, within: str | None = None) -> list[dict]:
    """The records of a JSON list, of a JSON object's values (each with its key as ``_key``; an object holding a
    ``records`` list: that list) or of JSON lines; ``within``: of the list or object at that dotted field of the
    file's JSON (``summary.accuracy.passkey``); ValueError naming the file otherwise."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no such record file: {str(path)!r}")
    text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is neither JSON nor JSON lines: {exc}") from None
    if within:
        data = _field(data, within) if isinstance(data, dict) else _MISSING
        if data is _MISSING:
            raise ValueError(f"{path}: no field {within!r} (--path)")
    if isinstance(data, dict):
        if isinstance(data.get("records"), list):
            data = data["records"]
        else:
            data = [{"_key": key, **value} if isinstance(value, dict) else {"_key": key, "value": value}
                    for key, value in data.items()]
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ValueError(f"{path}: expected a list of JSON objects (records), an object of them, or JSON lines")
    return data


_MISSING = object()


def _field(record: dict, name: str) -> Any:
    """``record``'s field ``name``, dots into nested objects; ``_MISSING`` when absent."""
    value: Any = record
    for part in name.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return _MISSING
    return value


def _text(value: Any, spec: str | None = None) -> str:
    """A cell: ``format(value, spec)`` with a spec, else strings as they are, floats to 4 significant digits, other
    values as sorted JSON; missing or null: "—"."""
    if value is _MISSING or value is None:
        return NONE
    if spec is not None:
        try:
            return format(value, spec)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"cannot format {value!r} with {spec!r}: {exc}") from None
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        return f"{value:.4g}"
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: Iterable[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- renderers


def render_records(records: list[dict], columns: list[str], where: list[str] | None = None,
                   headers: list[str] | None = None, formats: dict[str, str] | None = None) -> str:
    """One row per record (those that every ``where`` "key=value" matches), one column per field."""
    if not columns:
        raise ValueError("records: --columns needs at least one field")
    if headers is not None and len(headers) != len(columns):
        raise ValueError(f"records: --headers names {len(headers)} columns, --columns {len(columns)}")
    formats = formats or {}
    unknown = sorted(set(formats) - set(columns))
    if unknown:
        raise ValueError(f"records: --format names fields that are not columns: {', '.join(unknown)}")
    for condition in where or []:
        key, sep, wanted = condition.partition("=")
        if not sep or not key:
            raise ValueError(f"records: --where {condition!r} is not key=value")
        records = [r for r in records if _text(_field(r, key)) == wanted]
    if not records:
        raise ValueError("records: no record left" + (f" after --where {' '.join(where)}" if where else ""))
    for column in columns:
        if all(_field(r, column) is _MISSING for r in records):
            raise ValueError(f"records: no record has the field {column!r}; fields of the first: "
                             f"{', '.join(sorted(records[0]))}")
    rows = [[_text(_field(r, c), formats.get(c)) for c in columns] for r in records]
    return _table(headers or columns, rows)


def _markdown_tables(text: str) -> list[list[str]]:
    """The runs of table lines in markdown ``text``."""
    tables, current = [], []
    for line in text.splitlines():
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    if current:
        tables.append(current)
    return tables


def _split_row(line: str) -> list[str]:
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def _pick_columns(header: list[str], wanted: list[str], what: str) -> list[int]:
    """Indices of the columns ``wanted`` names: the exact header (case-insensitive) or a unique prefix of one."""
    picked = []
    for name in wanted:
        lower = name.lower()
        exact = [i for i, h in enumerate(header) if h.lower() == lower]
        matches = exact or [i for i, h in enumerate(header) if h.lower().startswith(lower)]
        if len(matches) != 1:
            raise ValueError(f"{what}: --columns {name!r} matches {'no' if not matches else 'several'} column(s) of "
                             f"{' | '.join(header)}")
        picked.append(matches[0])
    return picked


def _select_columns(table: list[str], columns: list[str], what: str) -> list[str]:
    """The markdown ``table`` (header, rule, rows) with only ``columns`` (see :func:`_pick_columns`), in that order."""
    picked = _pick_columns(_split_row(table[0]), columns, what)
    lines = ["| " + " | ".join(cells[i] for i in picked) + " |" for cells in (_split_row(line) for line in table)]
    lines[1] = "|" + "---|" * len(picked)
    return lines


def render_compare(summary: dict, tasks: list[str] | None = None, entries: list[str] | None = None,
                   columns: list[str] | None = None) -> str:
    """The per-task table(s) of a comparison summary, rendered by ``apps.compare.summary_markdown`` (so they are
    the tables of its summary.md), with rows and columns picked."""
    from .compare import summary_markdown

    blocks = summary["tasks"]
    tasks = tasks or list(blocks)
    missing = [t for t in tasks if t not in blocks]
    if missing:
        raise ValueError(f"compare: no task {', '.join(missing)} in the grid; it has {', '.join(blocks)}")
    out = []
    for task in tasks:
        block = dict(blocks[task])
        rows = block["mechanisms"]
        if entries:
            absent = [e for e in entries if e not in rows]
            if len(absent) == len(entries):
                raise ValueError(f"compare: no entry {', '.join(absent)} on {task}; it has {', '.join(rows)}")
            block["mechanisms"] = {e: rows[e] for e in entries if e in rows}
        one = {**summary, "tasks": {task: block}}
        tables = _markdown_tables(summary_markdown(one))
        if not tables:
            raise ValueError(f"compare: the summary of {task} has no table")
        table = tables[-1]  # the task's own (the overview comes first)
        text = "\n".join(_select_columns(table, columns, "compare") if columns else table)
        out.append(text if len(tasks) == 1 else f"**{task}** ({block['metric']}, {block['better']} is better)\n\n"
                   + text)
    return "\n\n".join(out)


def render_grids(grids: list[tuple[str, dict]], tasks: list[str] | None = None) -> str:
    """``report --grids``' table across grids (``apps.compare.grids_table``), optionally of some tasks only."""
    from .compare import grids_table

    if tasks:
        present = {t for _, s in grids for t in s["tasks"]}
        missing = [t for t in tasks if t not in present]
        if missing:
            raise ValueError(f"grids: no grid has task {', '.join(missing)}")
        grids = [(name, {**s, "tasks": {t: b for t, b in s["tasks"].items() if t in tasks}}) for name, s in grids]
        grids = [(name, s) for name, s in grids if s["tasks"]]
    return grids_table(grids)


PASSES = {"forward": "fwd_ms", "forward+backward": "fwd_bwd_ms"}


def render_bench(records: list[dict], lengths: list[int] | None = None, names: list[str] | None = None,
                 pass_: str = "forward+backward", baseline: str = "full") -> str:
    """Each mechanism's time relative to ``baseline``'s at each length (``baseline``'s own row: its time in ms),
    from one benchmark run's records."""
    if pass_ not in PASSES:
        raise ValueError(f"bench: --pass must be one of {', '.join(PASSES)}, got {pass_!r}")
    key = PASSES[pass_]
    table: dict[tuple[str, int], dict] = {}
    for r in records:
        if "name" not in r or "length" not in r:
            raise ValueError("bench: a record without 'name' and 'length' (not a layer benchmark)")
        if (r["name"], r["length"]) in table:
            raise ValueError(f"bench: two records of {r['name']} at N = {r['length']}")
        table[(r["name"], r["length"])] = r
    all_names = list(dict.fromkeys(r["name"] for r in records))
    names = names or ([baseline] if baseline in all_names else []) + [n for n in all_names if n != baseline]
    lengths = lengths or sorted({r["length"] for r in records})
    for name in names:
        if name not in all_names:
            raise ValueError(f"bench: no records of {name!r}; the file has {', '.join(all_names)}")
    for length in lengths:
        if not any(r["length"] == length for r in records):
            raise ValueError(f"bench: no records at N = {length}")
    rows = []
    for name in names:
        cells = [name]
        for length in lengths:
            r, b = table.get((name, length)), table.get((baseline, length))
            if r is None:
                cells.append(NONE)
            elif "error" in r:
                cells.append("failed")
            elif name == baseline:
                cells.append(f"1.00 ({r[key]:,.1f} ms)")
            elif b is None or "error" in b or not b.get(key):
                cells.append(f"{r[key]:,.1f} ms")
            else:
                cells.append(f"{r[key] / b[key]:.2f}")
        rows.append(cells)
    what = "fwd+bwd" if pass_ == "forward+backward" else "fwd"
    return _table([f"{what} time / {baseline}'s"] + [f"N = {n:,}" for n in lengths], rows)


def render_bench_rows(records: list[dict], lengths: list[int] | None = None, names: list[str] | None = None,
                      columns: list[str] | None = None) -> str:
    """``clusterformer bench report``'s table (``bench.report.attention_table``: one row per mechanism and length,
    times, memory, speed-ups over full in the same run), with rows and columns picked."""
    from ..bench.report import attention_table

    table = _markdown_tables(attention_table(records))[0]
    all_names = {r.get("name") for r in records}
    for name in names or []:
        if name not in all_names:
            raise ValueError(f"bench: no records of {name!r}")
    rows = [line for line in table[2:] if (not names or _split_row(line)[0] in names)
            and (not lengths or _split_row(line)[1] in {str(n) for n in lengths})]
    if not rows:
        raise ValueError("bench: no row left at these --names and --lengths")
    table = table[:2] + rows
    return "\n".join(_select_columns(table, columns, "bench") if columns else table)


def _image_line(out: Path, doc: Path, alt: str) -> str:
    return f"![{alt}]({Path(os.path.relpath(out, doc.parent)).as_posix()})"


# ---------------------------------------------------------------------------------------------------- dispatch


def _ints(values: list[str], what: str) -> list[int]:
    try:
        return [int(v.replace("_", "")) for v in values]
    except ValueError:
        raise ValueError(f"{what} takes integers, got {','.join(values)}") from None


def render(spec: str, root: Path, doc: Path, figures: bool = True) -> str:
    """The generated text of one marker ``spec`` of the file ``doc``; paths relative to ``root``. ``figures``:
    draw a figure's image (else only check that its records and image exist)."""
    kind, positional, raw = _parse(spec)
    if kind == "compare":
        opts = _options(kind, raw, {"tasks": "list", "entries": "list", "columns": "list"})
        if len(positional) != 1:
            raise ValueError(f"compare takes one comparison directory, got {len(positional)}")
        _, summary = load_summary(_resolve(root, positional[0]))
        return render_compare(summary, opts.get("tasks"), opts.get("entries"), opts.get("columns"))
    if kind == "grids":
        opts = _options(kind, raw, {"tasks": "list"})
        if not positional:
            raise ValueError("grids takes one or more comparison directories")
        return render_grids([load_summary(_resolve(root, p)) for p in positional], opts.get("tasks"))
    if kind == "bench":
        opts = _options(kind, raw, {"lengths": "list", "names": "list", "pass": "one", "layout": "one",
                                    "columns": "list"})
        if len(positional) != 1:
            raise ValueError(f"bench takes one benchmark JSON file, got {len(positional)}")
        lengths = _ints(opts["lengths"], "bench: --lengths") if "lengths" in opts else None
        records = load_records(_resolve(root, positional[0]))
        layout = opts.get("layout", "ratios")
        if layout == "rows":
            if "pass" in opts:
                raise ValueError("bench: --pass goes with --layout ratios (rows show both passes)")
            return render_bench_rows(records, lengths, opts.get("names"), opts.get("columns"))
        if layout != "ratios":
            raise ValueError(f"bench: --layout must be ratios or rows, got {layout!r}")
        if "columns" in opts:
            raise ValueError("bench: --columns goes with --layout rows")
        return render_bench(records, lengths, opts.get("names"), opts.get("pass", "forward+backward"))
    if kind == "records":
        opts = _options(kind, raw, {"columns": "list", "where": "many", "headers": "list", "format": "many",
                                    "path": "one"})
        if len(positional) != 1:
            raise ValueError(f"records takes one record file, got {len(positional)}")
        if "columns" not in opts:
            raise ValueError("records needs --columns")
        formats = {}  # field=spec pairs, split at the commas before a "field=" (a spec may hold a comma: ",.1f")
        for item in (i for word in opts.get("format", []) for i in re.split(r",(?=[\w.]+=)", word) if i):
            name, sep, fmt = item.partition("=")
            if not sep:
                raise ValueError(f"records: --format {item!r} is not field=spec")
            formats[name] = fmt
        return render_records(load_records(_resolve(root, positional[0]), opts.get("path")), opts["columns"],
                              opts.get("where"), opts.get("headers"), formats)
    if kind == "figure":
        return _figure(positional, raw, root, doc, figures)
    raise ValueError(f"unknown report kind {kind!r}; expected one of {', '.join(KINDS)}")


KINDS = ("compare", "grids", "bench", "records", "figure")


def _figure(positional: list[str], raw: dict[str, list[str]], root: Path, doc: Path, draw: bool) -> str:
    if not positional or positional[0] not in ("pareto", "speed"):
        raise ValueError(f"figure takes pareto or speed, got {' '.join(positional) or 'nothing'}")
    which, args = positional[0], positional[1:]
    if which == "pareto":
        opts = _options("figure pareto", raw, {"grids": "many", "out": "one", "alt": "one"})
        if args or "grids" not in opts:
            raise ValueError("figure pareto takes --grids DIR ... (and no other words)")
        grids = [load_summary(_resolve(root, p)) for p in opts["grids"]]
    else:
        opts = _options("figure speed", raw, {"out": "one", "alt": "one"})
        if len(args) != 1:
            raise ValueError(f"figure speed takes one benchmark JSON file, got {len(args)}")
        records = load_records(_resolve(root, args[0]))
    if "out" not in opts:
        raise ValueError(f"figure {which} needs --out PATH.png")
    out = _resolve(root, opts["out"])
    if draw:
        from ..bench.plot import plot_attention_benchmark, plot_pareto

        if which == "pareto":
            plot_pareto(grids, out)
        else:
            plot_attention_benchmark(records, out)
    elif not out.is_file():
        raise ValueError(f"figure {which}: the image {opts['out']} does not exist; run `clusterformer report --docs`")
    return _image_line(out, doc, opts.get("alt", out.stem))


# ---------------------------------------------------------------------------------------------------- files


def default_docs(root: Path) -> list[Path]:
    """README.md and every docs/**/*.md under ``root``, sorted."""
    docs = [root / "README.md"] if (root / "README.md").is_file() else []
    return docs + sorted((root / "docs").rglob("*.md")) if (root / "docs").is_dir() else docs


def _expand(paths: Iterable[str | Path], root: Path) -> list[Path]:
    files = []
    for p in paths:
        path = _resolve(root, str(p))
        if path.is_dir():
            files += sorted(path.rglob("*.md"))
        elif path.is_file():
            files.append(path)
        else:
            raise DocsReportError(f"--docs: no such file or directory: {str(p)!r}")
    return files


@dataclass
class DocsResult:
    """What a pass over the docs found: blocks rendered, the diffs of blocks that differ, the errors, the files
    rewritten."""

    blocks: int = 0
    diffs: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    written: list[Path] = field(default_factory=list)


def update_docs(paths: Iterable[str | Path] | None = None, root: str | Path = ".", check: bool = False,
                log: Callable[[str], None] | None = None) -> DocsResult:
    """Render every block of the markdown files ``paths`` (default: README.md and docs/**/*.md under ``root``);
    ``check``: write nothing, collect the diffs; else rewrite the files whose blocks changed (and draw figures).
    A block that cannot be rendered keeps its lines and adds an error naming its file and line."""
    root = Path(root)
    files = default_docs(root) if paths is None else _expand(paths, root)
    result = DocsResult()
    for file in files:
        text = file.read_text()
        lines = text.split("\n")
        try:
            blocks = find_blocks(_shown(file, root), lines)
        except DocsReportError as exc:
            result.errors.append(str(exc))
            continue
        new_lines, last = [], 0
        for block in blocks:
            result.blocks += 1
            old = lines[block.start:block.end]
            try:
                body = render(block.spec, root, file, figures=not check)
                new = ["", *body.split("\n"), ""]
            except (ValueError, KeyError, TypeError) as exc:
                message = str(exc) if isinstance(exc, ValueError) else f"malformed record: {type(exc).__name__} {exc}"
                result.errors.append(f"{_shown(file, root)}:{block.line}: report {block.spec}: {message}")
                new = old
            if new != old:
                name = f"{_shown(file, root)}:{block.line}"
                result.diffs.append("\n".join(difflib.unified_diff(old, new, f"{name} (in the file)",
                                                                   f"{name} (from its records)", lineterm="")))
            new_lines += lines[last:block.start] + new
            last = block.end
        new_lines += lines[last:]
        if not check and new_lines != lines:
            file.write_text("\n".join(new_lines))
            result.written.append(file)
            if log is not None:
                log(f"wrote {_shown(file, root)}")
    return result


def _shown(file: Path, root: Path) -> Path:
    try:
        return file.resolve().relative_to(root.resolve())
    except ValueError:
        return file


def write_docs(paths: Iterable[str | Path] | None = None, root: str | Path = ".",
               log: Callable[[str], None] | None = None) -> DocsResult:
    """Rewrite every block (and draw every figure) of ``paths``."""
    return update_docs(paths, root, check=False, log=log)


def check_docs(paths: Iterable[str | Path] | None = None, root: str | Path = ".") -> DocsResult:
    """Render every block of ``paths`` and compare, writing nothing."""
    return update_docs(paths, root, check=True)
