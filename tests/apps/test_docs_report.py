"""The docs' generated blocks (``clusterformer report --docs [--check]``): each renderer on a tiny record, the
write / check round trip, the errors that name a file and line, and the check over the repository's own docs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from clusterformer.apps.compare import summary_markdown
from clusterformer.apps.docs_report import (
    find_blocks,
    load_records,
    render,
    render_bench,
    render_compare,
    render_grids,
    render_records,
    update_docs,
)
from clusterformer.cli import main

REPO = Path(__file__).resolve().parents[2]


def _row(mean: float, time: float | None, scores: dict | None = None) -> dict:
    row = {"metric": "accuracy", "mean": mean, "std": 0.01, "n": 2, "scores": scores or {"seed0": mean - 0.01,
                                                                                          "seed1": mean + 0.01},
           "seconds_per_epoch": 10.0 * (time or 1.0), "peak_rss_mb": 100.0, "keys_per_query": 64}
    if time is not None:
        row["time_vs_full"] = time
    return row


def _summary(tasks: dict[str, dict[str, tuple[float, float | None]]]) -> dict:
    return {"units": "seeds", "test": "sign-flip", "runs_finished": 4, "wall_seconds": 3600.0, "machines": ["cpu"],
            "entries": {"nc": {"attention": "neural-clustering", "options": {}, "train_args": []}},
            "tasks": {task: {"metric": "accuracy", "better": "higher",
                             "mechanisms": {name: _row(*values) for name, values in rows.items()}}
                      for task, rows in tasks.items()}}


def _grid(root: Path, name: str, summary: dict) -> Path:
    (root / name).mkdir(parents=True)
    (root / name / "summary.json").write_text(json.dumps(summary))
    return root / name


BENCH = [{"name": "full", "length": 1024, "fwd_ms": 10.0, "fwd_bwd_ms": 40.0, "peak_mem_mb": 8.0},
         {"name": "full", "length": 4096, "fwd_ms": 160.0, "fwd_bwd_ms": 640.0, "peak_mem_mb": 16.0},
         {"name": "lsh", "length": 1024, "fwd_ms": 5.0, "fwd_bwd_ms": 30.0, "peak_mem_mb": 4.0},
         {"name": "lsh", "length": 4096, "error": "out of memory"},
         {"name": "routing", "length": 4096, "fwd_ms": 20.0, "fwd_bwd_ms": 64.0, "peak_mem_mb": 4.0}]


def test_records_renders_one_row_per_record_with_nested_fields_filters_and_formats(tmp_path):
    records = [{"name": "a", "n": 1, "stats": {"ms": 1.23456, "ok": True}},
               {"name": "b", "n": 2, "stats": {"ms": 20.5, "ok": False}},
               {"name": "c", "n": 3, "stats": {"ok": True}}]
    table = render_records(records, ["name", "stats.ms", "stats.ok"], where=["stats.ok=true"],
                           headers=["mechanism", "ms", "ok"], formats={"stats.ms": ".2f"})
    assert table.splitlines() == ["| mechanism | ms | ok |", "|---|---|---|", "| a | 1.23 | true |", "| c | — | true |"]
    assert render_records(records, ["name", "stats.ms"]).splitlines()[3] == "| b | 20.5 |"  # default: 4 digits
    for path, text in ((tmp_path / "list.json", json.dumps(records)),
                       (tmp_path / "lines.jsonl", "\n".join(json.dumps(r) for r in records) + "\n")):
        path.write_text(text)
        assert [r["name"] for r in load_records(path)] == ["a", "b", "c"]
    (tmp_path / "object.json").write_text(json.dumps({"x": {"v": 1}, "y": {"v": 2}}))
    assert render_records(load_records(tmp_path / "object.json"), ["_key", "v"]).splitlines()[2:] == ["| x | 1 |",
                                                                                                      "| y | 2 |"]
    for kwargs, message in (({"columns": ["nope"]}, "no record has the field 'nope'"),
                            ({"columns": ["name"], "headers": ["A", "B"]}, "--headers names 2 columns"),
                            ({"columns": ["name"], "where": ["name=zzz"]}, "no record left"),
                            ({"columns": ["name"], "where": ["name"]}, "is not key=value"),
                            ({"columns": ["name"], "formats": {"n": ".1f"}}, "not columns"),
                            ({"columns": ["name"], "formats": {"name": ".1f"}}, "cannot format 'a'")):
        with pytest.raises(ValueError, match=message):
            render_records(records, **kwargs)


def test_bench_renders_time_relative_to_full_per_length():
    table = render_bench(BENCH).splitlines()
    assert table[0] == "| fwd+bwd time / full's | N = 1,024 | N = 4,096 |"
    assert table[2:] == ["| full | 1.00 (40.0 ms) | 1.00 (640.0 ms) |", "| lsh | 0.75 | failed |",
                         "| routing | — | 0.10 |"]
    forward = render_bench(BENCH, lengths=[4096], names=["routing", "full"], pass_="forward").splitlines()
    assert forward[0] == "| fwd time / full's | N = 4,096 |" and forward[2:] == ["| routing | 0.12 |",
                                                                                    "| full | 1.00 (160.0 ms) |"]
    for kwargs, message in (({"names": ["kmeans"]}, "no records of 'kmeans'"), ({"lengths": [2048]}, "N = 2048"),
                            ({"pass_": "backward"}, "--pass must be one of")):
        with pytest.raises(ValueError, match=message):
            render_bench(BENCH, **kwargs)
    with pytest.raises(ValueError, match="two records of lsh"):
        render_bench([*BENCH, BENCH[2]])


def test_compare_renders_the_summary_markdown_per_task_table_with_rows_and_columns_picked():
    summary = _summary({"listops": {"full": (0.5, 1.0), "nc": (0.4, 0.5), "lsh": (0.3, 2.0)},
                        "imdb": {"full": (0.6, 1.0), "nc": (0.7, 0.25)}})
    whole = render_compare(summary, tasks=["listops"])
    expected = [line for line in summary_markdown({**summary, "tasks": {"listops": summary["tasks"]["listops"]}})
                .splitlines() if line.startswith("|")][-5:]  # its own code, the task's table: head + 3 rows
    assert whole.splitlines() == expected
    picked = render_compare(summary, tasks=["listops"], entries=["lsh", "full"], columns=["mechanism", "score",
                                                                                          "time vs full"])
    assert picked.splitlines() == ["| mechanism | score (mean ± std, n) | time vs full |", "|---|---|---|",
                                   "| lsh | 0.3000 ± 0.0100 (2) | 2.00 |", "| full | 0.5000 ± 0.0100 (2) | 1.00 |"]
    both = render_compare(summary, columns=["mechanism", "score"])
    assert both.startswith("**listops** (accuracy, higher is better)\n\n| mechanism |")
    assert "**imdb** (accuracy, higher is better)\n\n| mechanism | score (mean ± std, n) |\n|---|---|\n| full |" in both
    for kwargs, message in (({"tasks": ["mqar"]}, "no task mqar"), ({"entries": ["kmeans"]}, "no entry kmeans"),
                            ({"columns": ["s"]}, "matches several"), ({"columns": ["zzz"]}, "matches no")):
        with pytest.raises(ValueError, match=message):
            render_compare(summary, **kwargs)


def test_grids_renders_report_grids_table_optionally_for_some_tasks(tmp_path, capsys):
    short = _grid(tmp_path, "short", _summary({"listops": {"full": (0.5, 1.0), "nc": (0.4, 0.5)},
                                               "imdb": {"full": (0.6, 1.0)}}))
    long = _grid(tmp_path, "long", _summary({"listops": {"full": (0.3, 1.0), "nc": (0.6, 0.25)}}))
    text = render(f"grids {short} {long}", tmp_path, tmp_path / "doc.md")
    assert main(["report", "--grids", str(short), str(long)]) == 0
    assert capsys.readouterr().out.strip() == text  # the same table as report --grids
    some = render_grids([("short", json.loads((short / "summary.json").read_text()))], tasks=["listops"])
    assert some.splitlines()[0].startswith("| entry | listops accuracy | avg accuracy (1 columns) |")
    with pytest.raises(ValueError, match="no grid has task mqar"):
        render(f"grids {short} --tasks mqar", tmp_path, tmp_path / "doc.md")


def test_figures_draw_their_image_and_check_only_that_it_and_its_records_exist(tmp_path):
    (tmp_path / "bench.json").write_text(json.dumps(BENCH))
    grid = _grid(tmp_path, "grid", _summary({"listops": {"full": (0.5, 1.0), "nc": (0.4, 0.5), "lsh": (0.6, 2.0)}}))
    doc = tmp_path / "docs" / "page.md"
    for spec, image in (("figure speed bench.json --out docs/img/speed.png --alt 'time against N'", "speed.png"),
                        (f"figure pareto --grids {grid.name} --out docs/img/pareto.png", "pareto.png")):
        with pytest.raises(ValueError, match="does not exist"):
            render(spec, tmp_path, doc, figures=False)
        line = render(spec, tmp_path, doc)
        assert line == (f"![time against N](img/{image})" if "speed" in spec else "![pareto](img/pareto.png)")
        assert (tmp_path / "docs" / "img" / image).stat().st_size > 1000
        assert render(spec, tmp_path, doc, figures=False) == line
    with pytest.raises(ValueError, match="no such record file"):
        render("figure speed missing.json --out docs/img/speed.png", tmp_path, doc, figures=False)
    with pytest.raises(ValueError, match="needs --out"):
        render("figure speed bench.json", tmp_path, doc)
    with pytest.raises(ValueError, match="takes pareto or speed"):
        render("figure histogram", tmp_path, doc)


DOC = """# Page

Text before.

<!-- report: bench figures/bench.json --lengths 1024 -->
<!-- /report -->

Between.

<!-- report: records figures/bench.json --columns name,length --where name=full -->
stale line
<!-- /report -->
"""


def test_write_then_check_round_trip_and_a_changed_number_fails_naming_the_file(tmp_path, capsys):
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "bench.json").write_text(json.dumps(BENCH))
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    page.write_text(DOC)
    (tmp_path / "README.md").write_text("no blocks\n")
    check = ["report", "--docs", "--check", "--root", str(tmp_path)]
    assert main(check) == 1  # the empty and the stale block differ
    out, err = capsys.readouterr()
    assert "docs/page.md:5 (from its records)" in out and "-stale line" in out
    assert "0 of 2 generated block(s) match their records, 2 differ" in err
    assert page.read_text() == DOC  # --check writes nothing
    assert main(["report", "--docs", "--root", str(tmp_path)]) == 0
    written = page.read_text()
    assert "| lsh | 0.75 |" in written and "stale line" not in written
    assert written.startswith("# Page\n\nText before.\n\n<!-- report: bench") and written.endswith("Between.\n\n"
           "<!-- report: records figures/bench.json --columns name,length --where name=full -->\n\n| name | length |\n"
           "|---|---|\n| full | 1024 |\n| full | 4096 |\n\n<!-- /report -->\n")
    capsys.readouterr()
    assert main(check) == 0
    assert "2 of 2 generated block(s) match their records, 0 differ" in capsys.readouterr().err
    assert main(["report", "--docs", "--root", str(tmp_path)]) == 0 and page.read_text() == written  # idempotent
    page.write_text(written.replace("| lsh | 0.75 |", "| lsh | 0.76 |"))  # one number changed by hand
    capsys.readouterr()
    assert main(check) == 1
    out, err = capsys.readouterr()
    assert "docs/page.md:5" in out and "-| lsh | 0.76 |" in out and "+| lsh | 0.75 |" in out
    assert "1 of 2 generated block(s) match their records, 1 differ" in err
    assert main(["report", "--docs", str(page), "--root", str(tmp_path)]) == 0 and page.read_text() == written


@pytest.mark.parametrize(("text", "message"), [
    ("<!-- report: nonsense a b -->\n<!-- /report -->\n", "doc.md:1: report nonsense a b: unknown report kind"),
    ("x\n<!-- report: records none.json --columns a -->\n<!-- /report -->\n", "doc.md:2: .*no such record file"),
    ("<!-- report: compare nowhere -->\n<!-- /report -->\n", "doc.md:1: .*neither a comparison directory"),
    ("<!-- report: bench b.json --colour red -->\n<!-- /report -->\n", "doc.md:1: .*unknown option.*--colour"),
    ("<!-- report: bench b.json -->\n", "doc.md:1: report marker without its closing"),
    ("<!-- /report -->\n", "doc.md:1: <!-- /report --> without an opening"),
    ("<!-- report: bench b.json -->\n<!-- report: bench b.json -->\n", "doc.md:2: a report marker inside"),
    ("<!-- report: bench b.json -->\n<!-- /report -->\n", "doc.md:1: .*not a layer benchmark"),
    ("<!-- report: records b.json --columns 'a -->\n<!-- /report -->\n", "doc.md:1: .*cannot split"),
])
def test_a_bad_marker_is_an_error_naming_file_and_line(tmp_path, capsys, text, message):
    (tmp_path / "b.json").write_text(json.dumps([{"x": 1}]))
    (tmp_path / "doc.md").write_text(text)
    result = update_docs(["doc.md"], tmp_path, check=True)
    assert len(result.errors) == 1 and not result.diffs
    assert re.search(message, result.errors[0]), result.errors[0]
    assert main(["report", "--docs", "doc.md", "--check", "--root", str(tmp_path)]) == 1
    assert "error: doc.md" in capsys.readouterr().err


def test_report_cli_refuses_mixed_modes(tmp_path, capsys):
    for argv, message in ((["report", "--docs", "--grids", str(tmp_path)], "--docs takes markdown files"),
                          (["report", str(tmp_path), "--check"], "--check goes with --docs"),
                          (["report", "--docs", "nowhere.md", "--root", str(tmp_path)], "no such file")):
        with pytest.raises(SystemExit):
            main(argv)
        assert message in capsys.readouterr().err


def test_find_blocks_returns_the_lines_between_the_markers():
    lines = ["a", "<!-- report: bench x.json --lengths 1 -->", "old", "<!-- /report -->", "b"]
    (block,) = find_blocks(Path("d.md"), lines)
    assert (block.line, block.spec, lines[block.start:block.end]) == (2, "bench x.json --lengths 1", ["old"])
    fenced = ["````markdown", "<!-- report: KIND ARG... -->", "```", "<!-- /report -->", "````", *lines]
    assert [b.line for b in find_blocks(Path("d.md"), fenced)] == [7]  # the syntax shown in code is not a block


def test_the_repository_docs_match_their_records(capsys):
    """README.md and docs/**/*.md: every generated block as its committed records give it (CI runs this; on a
    failure run `clusterformer report --docs` and commit, or fix the record)."""
    code = main(["report", "--docs", "--check", "--root", str(REPO)])
    out, err = capsys.readouterr()
    assert code == 0, out + err


def test_bench_rows_layout_is_bench_report_table_with_rows_and_columns_picked(tmp_path):
    from clusterformer.bench.report import attention_table

    (tmp_path / "b.json").write_text(json.dumps(BENCH))
    doc = tmp_path / "doc.md"
    assert render("bench b.json --layout rows", tmp_path, doc) == attention_table(BENCH)
    picked = render("bench b.json --layout rows --names lsh,full --lengths 1024 --columns mechanism,N,'fwd+bwd speed'",
                    tmp_path, doc)
    assert picked.splitlines() == ["| mechanism | N | fwd+bwd speed-up vs full |", "|---|---|---|",
                                   "| full | 1024 | 1.0x |", "| lsh | 1024 | 1.3x |"]  # the table's own row order
    for spec, message in (("bench b.json --layout rows --pass forward", "--pass goes with --layout ratios"),
                          ("bench b.json --columns N", "--columns goes with --layout rows"),
                          ("bench b.json --layout cols", "--layout must be ratios or rows"),
                          ("bench b.json --layout rows --lengths 2048", "no row left")):
        with pytest.raises(ValueError, match=message):
            render(spec, tmp_path, doc)


def test_pareto_front_keeps_the_entries_no_other_beats_on_both_time_and_score():
    from clusterformer.bench.plot import _pareto_front

    points = [(1.0, 0.5), (0.5, 0.4), (2.0, 0.6), (1.5, 0.45), (0.5, 0.3), (3.0, 0.6)]
    assert _pareto_front(points, higher=True) == [(0.5, 0.4), (1.0, 0.5), (2.0, 0.6)]
    assert _pareto_front(points, higher=False) == [(0.5, 0.3)]  # lower is better: the fastest is also the best
    assert _pareto_front([(1.0, 2.0), (2.0, 1.0), (0.5, 3.0)], higher=False) == [(0.5, 3.0), (1.0, 2.0), (2.0, 1.0)]


def test_records_reads_the_list_or_object_at_a_path_and_formats_with_commas(tmp_path):
    record = {"config": {"n": 3}, "summary": {"passkey": {"4096": {"dense": {"mean": 0.8333, "n": 1234},
                                                                    "oracle": {"mean": 0.7667, "n": 1234}}}}}
    (tmp_path / "r.json").write_text(json.dumps(record))
    text = render("records r.json --path summary.passkey.4096 --columns _key,mean,n --headers 'method,accuracy,n' "
                  "--format mean=.1%,n=,d", tmp_path, tmp_path / "doc.md")
    assert text.splitlines() == ["| method | accuracy | n |", "|---|---|---|", "| dense | 83.3% | 1,234 |",
                                 "| oracle | 76.7% | 1,234 |"]
    with pytest.raises(ValueError, match=r"no field 'summary\.recall'"):
        render("records r.json --path summary.recall --columns n", tmp_path, tmp_path / "doc.md")
