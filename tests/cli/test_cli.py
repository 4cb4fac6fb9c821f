"""The command line: one module per command, the benchmarks' commands, clear errors, the demo."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from clusterformer.cli import main


def test_bench_cli_writes_records_and_plot(tmp_path, capsys):
    out, plot = tmp_path / "b.json", tmp_path / "b.png"
    code = main(["bench", "attention", "--names", "full,neural-clustering", "--lengths", "64,96", "--repeats", "1",
                 "--warmup", "0", "--json", str(out), "--plot", str(plot)])
    assert code == 0
    records = json.loads(out.read_text())
    assert len(records) == 4
    keys = {"name", "length", "batch", "heads", "head_dim", "device", "fwd_ms", "fwd_bwd_ms", "peak_mem_mb"}
    for record in records:
        assert keys <= set(record)
        assert record["fwd_ms"] > 0 and record["fwd_bwd_ms"] > 0 and record["peak_mem_mb"] >= 0
        assert record["kept_tensor_mb"] < record["peak_tensor_mb"], record
    for record in records:
        if record["name"] == "full":  # after the forward: q, k, v and the output, 4-5 inputs' worth
            unit_mb = record["length"] * 256 * 4 / 2**20  # B 1, N, dim 256, float32 (the gradients, after, are more)
            assert 3.5 < record["kept_tensor_mb"] / unit_mb < 6, record
    assert {r["name"] for r in records} == {"full", "neural-clustering"}
    assert [r["fwd_bwd_aux_ms"] is None for r in records if r["name"] == "full"] == [True, True]
    assert plot.stat().st_size > 1000
    assert "[4/4] neural-clustering N=96" in capsys.readouterr().err  # progress


def test_bench_padded_batches(tmp_path, capsys):
    """--padding: sequence b of the batch right-padded by padding * N * b / (B - 1) tokens; recorded."""
    from clusterformer.bench.attention import padding_mask

    assert padding_mask(3, 10, 0.0) is None
    assert (~padding_mask(3, 10, 0.6)).sum(1).tolist() == [10, 7, 4]
    assert (~padding_mask(1, 10, 0.3)).sum(1).tolist() == [7]
    out = tmp_path / "p.json"
    assert main(["bench", "attention", "--names", "lsh", "--lengths", "64", "--batch", "2", "--padding", "0.5",
                 "--repeats", "1", "--warmup", "0", "--json", str(out)]) == 0
    (record,) = json.loads(out.read_text())
    assert record["padding"] == 0.5 and record["batch"] == 2 and record["fwd_ms"] > 0
    with pytest.raises(SystemExit):
        main(["bench", "attention", "--names", "lsh", "--lengths", "64", "--padding", "1.5"])
    assert "padding must be < 1.0" in capsys.readouterr().err


def test_bench_reversible_and_report_cli(tmp_path, capsys):
    out = tmp_path / "rev.json"
    code = main(["bench", "reversible", "--depths", "1,2", "--attention", "lsh", "--length", "32", "--dim", "16",
                 "--heads", "2", "--repeats", "1", "--json", str(out)])
    assert code == 0
    records = json.loads(out.read_text())
    assert [(r["depth"], r["reversible"]) for r in records] == [(1, False), (1, True), (2, False), (2, True)]
    assert all(r["fwd_bwd_ms"] > 0 and r["attention"] == "lsh" for r in records)
    capsys.readouterr()
    assert main(["bench", "report", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert table.startswith("| depth |") and len(table.splitlines()) == 4
    bench = tmp_path / "att.json"
    main(["bench", "attention", "--names", "full,lsh", "--lengths", "32", "--repeats", "1", "--warmup", "0",
          "--json", str(bench)])
    capsys.readouterr()
    main(["bench", "report", "--json", str(bench)])
    rows = capsys.readouterr().out.splitlines()
    assert rows[2].startswith("| full | 32 |") and rows[2].endswith("| 1.0x | 1.0x |")
    assert rows[3].startswith("| lsh | 32 |")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "attention", "--names", "full,bogus"], "unknown attention name"),
        (["bench", "report", "--json", "/nonexistent.json"], "is not a file"),
        (["bench", "reversible", "--attention", "bogus"], "unknown attention name"),
        (["bench", "attention", "--lengths", "0"], "expected positive integers"),
        (["bench", "attention", "--options", '{"full": {"look_back": 1}}', "--lengths", "8"], "unknown option"),
    ],
)
def test_cli_rejects_bad_arguments_clearly(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_module_entry_point_lists_mechanisms():
    result = subprocess.run([sys.executable, "-m", "clusterformer", "list"], capture_output=True, text=True,
                            check=True)
    assert "neural-clustering" in result.stdout and "causal_mode = 'strict'" in result.stdout
    # every mechanism any entry point runs, the AttentionInterface's cache readers included, with their vocabulary
    assert "cluster-retrieval" in result.stdout and "sink-window" in result.stdout
    assert "num_clusters = 256" in result.stdout and "budget = 0.1" in result.stdout


def test_demo_runs_end_to_end_on_a_tiny_budget(tmp_path):
    from clusterformer.apps.demo import DemoConfig, majority_marker_batch, run_demo

    tokens, labels = majority_marker_batch(64, 40, torch.Generator().manual_seed(0))
    a, b = (tokens == 40).sum(1), (tokens == 41).sum(1)
    assert torch.equal(labels, (a > b).long()) and (a != b).all() and (a >= 1).all() and (b >= 1).all()
    lines = []
    summary = run_demo(tmp_path, DemoConfig(length=32, train_steps=2, batch=4, eval_examples=8, dim=16,
                                            bench_lengths=(32,), also=()), log=lines.append)
    assert {r["attention"] for r in summary["training"]} == {"full", "neural-clustering"}
    assert [r["keys_per_query"] for r in summary["training"]] == [32, 12]  # k = 6: two chunks of 6
    assert (tmp_path / "demo.json").exists() and (tmp_path / "bench.png").exists()
    table = "\n".join(lines).splitlines()
    assert any(line.split()[:1] == ["32"] and line.count("x)") == 2 and "(1.00x)" in line for line in table)
    below = summary["training"][1]["accuracy"] < summary["training"][0]["accuracy"] - 0.02
    assert below == any("Why neural-clustering is below full here" in line for line in lines)


def test_demo_trains_cluster_select_with_its_defaults(tmp_path, monkeypatch):
    """cluster-select is in the demo by default (benchmark, training, and a line that says whether it reached full's
    accuracy, decided by the numbers); ``--with ""`` leaves it out; an unknown name is refused."""
    from clusterformer.apps import demo
    from clusterformer.apps.demo import DemoConfig, run_demo

    lines = []
    summary = run_demo(tmp_path, DemoConfig(length=160, train_steps=2, batch=2, eval_examples=4, dim=16,
                                            bench_lengths=(32,)), log=lines.append)
    runs = summary["training"]
    assert [r["attention"] for r in runs] == ["full", "neural-clustering", "cluster-select"]
    assert {r["name"] for r in summary["benchmark"]} == {"full", "neural-clustering", "cluster-select"}
    # keys read: window, 2 clusters x 32 keys, sink, 16 summaries, 16 group bounds ranked
    assert runs[2]["keys_per_query"] == 64 + 2 * 32 + 1 + 16 + 16
    reached = runs[2]["accuracy"] >= runs[0]["accuracy"] - 0.02
    verdict = [line for line in "\n".join(lines).splitlines() if line.startswith("cluster-select reads")]
    assert len(verdict) == 1 and ("at full's accuracy" in verdict[0]) == reached
    assert ("below full's here" in verdict[0]) == (not reached)
    for refused in ("quest", "full", "no-such-mechanism"):  # a cache reader, one of the base, an unknown name
        with pytest.raises(ValueError, match="the demo can add"):
            DemoConfig(also=(refused,))
    assert "lsh" in demo.addable() and "sink-window" not in demo.addable()
    with pytest.raises(SystemExit, match="--with"):
        main(["demo", "--out", str(tmp_path / "x"), "--with", "quest"])
    seen = []
    monkeypatch.setattr(demo, "run_demo", lambda out, config, log: seen.append(config))
    main(["demo", "--out", str(tmp_path / "y"), "--with", ""])
    main(["demo", "--out", str(tmp_path / "z")])
    assert [config.also for config in seen] == [(), ("cluster-select",)]


def test_every_command_has_its_own_module_and_help():
    """Each command adds its own parser; the package docstring lists every one of them."""
    from clusterformer import cli

    parser = cli.build_parser()
    commands = parser._subparsers._group_actions[0].choices
    assert set(commands) == {"list", "bench", "train", "eval", "generate", "translate", "data", "report", "compare",
                             "approx", "longctx", "cluster", "demo"}
    assert len(cli.COMMANDS) == len(commands)
    for name in commands:
        assert f"\n  {name} " in cli.__doc__, name


def test_list_shows_aliases_and_resolved_defaults(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "chunk_size = 64  (alias bucket_size)" in out and "num_clusters = 100  (alias clusters)" in out
    # defaults resolved at construction say what they become with nothing given (cluster-select's version 2)
    assert "selection = 'auto'  (resolves to 'bound')" in out and "own_group = None  (resolves to True)" in out
    assert "sink = None  (resolves to 1)" in out and "window = 64\n" in out


def test_generate_streams_a_continuation_from_a_checkpoint(tmp_path, capsys):
    """`clusterformer generate` rebuilds a character LM from its run directory alone and streams."""
    (tmp_path / "tinyshakespeare").mkdir()
    (tmp_path / "tinyshakespeare" / "input.txt").write_text("to be or not to be, that is the question\n" * 40)
    run = tmp_path / "run"
    assert main(["train", "--task", "shakespeare-char", "--attention", "neural-clustering", "--attention-options",
                 '{"causal_chunk_size": 4, "causal_clusters": 3}', "--max-len", "16", "--dim", "16", "--depth", "1",
                 "--heads", "2", "--max-steps", "3", "--data-dir", str(tmp_path), "--out", str(run),
                 "--no-progress"]) == 0
    capsys.readouterr()
    outputs = []
    for extra in ([], ["--no-cache"]):
        assert main(["generate", "--checkpoint", str(run), "--prompt", "to be", "--max-new-tokens", "30",
                     "--temperature", "0.8", "--top-k", "5", "--seed", "3", *extra]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]  # the cache changes the cost, not the text
    text = outputs[0].rstrip("\n")
    assert text.startswith("to be") and len(text) == 5 + 30 and set(text) <= set("to bernhaqusi,\n")
    with pytest.raises(SystemExit):
        main(["generate", "--checkpoint", str(run), "--prompt", "to be{", "--max-new-tokens", "3"])
    assert "vocabulary lacks: ['{']" in capsys.readouterr().err


def test_bench_decode_records_time_per_token_and_cache_memory(tmp_path, capsys):
    out = tmp_path / "d.json"
    assert main(["bench", "decode", "--names", "full,neural-clustering", "--contexts", "40,200", "--steps", "3",
                 "--warmup", "1", "--repeats", "2", "--heads", "2", "--head-dim", "8", "--json", str(out), "--options",
                 '{"neural-clustering": {"causal_chunk_size": 4, "causal_clusters": 2}}']) == 0
    records = json.loads(out.read_text())
    assert [(r["name"], r["context"]) for r in records] == [("full", 40), ("neural-clustering", 40), ("full", 200),
                                                            ("neural-clustering", 200)]
    assert all(r["ms_per_token"] > 0 and r["prefill_ms"] > 0 for r in records)
    cache = {(r["name"], r["context"]): r["cache_mb"] for r in records}
    assert cache[("full", 200)] > 4 * cache[("full", 40)]  # every key
    assert cache[("neural-clustering", 200)] == cache[("neural-clustering", 40)]  # rings of fixed size
    err = capsys.readouterr().err
    assert "[4/4] neural-clustering context=200" in err and "| full | 200 |" in err
    assert main(["bench", "report", "--json", str(out)]) == 0
    assert "speed-up vs full" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "decode", "--names", "clustered", "--contexts", "16"])
    assert "no cached decoding" in capsys.readouterr().err


def _tiny_multi30k(root) -> None:
    """A few De-En pairs in Multi30k's file layout (gzip, one sentence per line)."""
    import gzip

    pairs = [("ein hund läuft", "a dog runs"), ("zwei katzen schlafen", "two cats sleep"),
             ("ein mann liest ein buch", "a man reads a book"), ("kinder spielen im park", "children play in the park")]
    (root / "multi30k").mkdir(parents=True)
    for split, n in (("train", 40), ("test_2016_flickr", 4)):
        for side, lang in ((0, "de"), (1, "en")):
            lines = [pairs[i % 4][side] for i in range(n)]
            with gzip.open(root / "multi30k" / f"{split}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")


def test_train_multi30k_then_translate_from_stdin(tmp_path, capsys, monkeypatch):
    """train --task multi30k writes BLEU with sacrebleu's signature; translate reads stdin, batched."""
    import io

    pytest.importorskip("sacrebleu")
    _tiny_multi30k(tmp_path)
    run = tmp_path / "run"
    assert main(["train", "--task", "multi30k", "--attention", "neural-clustering", "--decoder-attention-options",
                 '{"causal_chunk_size": 4, "causal_clusters": 3}', "--max-len", "16", "--dim", "16", "--depth", "1",
                 "--heads", "2", "--max-steps", "2", "--batch-size", "8", "--vocab-size", "320", "--beam", "2",
                 "--data-dir", str(tmp_path), "--out", str(run), "--no-progress"]) == 0
    metrics = json.loads((run / "metrics.json").read_text())
    assert 0.0 <= metrics["metrics"]["bleu"] <= 100.0 and metrics["metrics"]["sacrebleu"].startswith("nrefs:1|")
    assert metrics["config"]["decoder_attention"] is None  # neural-clustering is strict: it decodes itself
    capsys.readouterr()
    outputs = []
    for extra in ([], ["--no-cache"]):
        monkeypatch.setattr("sys.stdin", io.StringIO("ein hund läuft\nkinder spielen im park\nein mann\n"))
        assert main(["translate", "--checkpoint", str(run), "--beam", "3", "--batch-size", "2", *extra]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].count("\n") == 3
    monkeypatch.setattr("sys.stdin", io.StringIO("ein hund\n\nzwei katzen\n"))
    with pytest.raises(SystemExit):
        main(["translate", "--checkpoint", str(run)])
    assert "line 2 of the input is empty" in capsys.readouterr().err


def test_translation_refuses_what_it_cannot_do(tmp_path, capsys):
    _tiny_multi30k(tmp_path)
    common = ["--max-len", "16", "--dim", "16", "--depth", "1", "--heads", "2", "--max-steps", "1",
              "--data-dir", str(tmp_path), "--no-progress"]
    with pytest.raises(SystemExit):
        main(["train", "--task", "multi30k", "--decoder-attention", "clustered", "--out", str(tmp_path / "a"), *common])
    assert "decoder_attention 'clustered' is not strictly causal" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--task", "mr", "--decoder-attention", "full", "--out", str(tmp_path / "b"), *common])
    assert "--decoder-attention is for the translation task" in capsys.readouterr().err
    (tmp_path / "tinyshakespeare").mkdir()
    (tmp_path / "tinyshakespeare" / "input.txt").write_text("to be or not to be\n" * 40)
    assert main(["train", "--task", "shakespeare-char", "--out", str(tmp_path / "lm"), *common]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["translate", "--checkpoint", str(tmp_path / "lm")])
    assert "is a 'shakespeare-char' run; translate needs a translation model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--checkpoint", str(tmp_path / "nothing"), "--prompt", "to"])
    assert "no checkpoint at" in capsys.readouterr().err
    paper = ["--attention", "neural-clustering", "--attention-options", '{"causal_mode": "paper"}',
             "--allow-non-strict-causal"]
    assert main(["train", "--task", "shakespeare-char", "--out", str(tmp_path / "lm2"), *paper, *common]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["generate", "--checkpoint", str(tmp_path / "lm2"), "--prompt", "to"])
    assert "pass --no-cache" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(tmp_path / "lm2"), "--prompt", "to", "--no-cache",
                 "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("to")


def test_train_takes_a_mechanisms_options_in_its_spec_as_compare_does(tmp_path, capsys):
    common = ["--task", "mqar", "--max-len", "64", "--task-options",
              '{"num_pairs": 4, "vocab_size": 64, "test_sequences": 4, "recall_sequences": 0}', "--limit", "16",
              "--max-steps", "1", "--batch-size", "8", "--dim", "32", "--no-progress"]
    out = tmp_path / "spec"
    assert main(["train", *common, "--attention", "cluster-select:select=1,window=8,own_group=true",
                 "--attention-options", '{"cluster_keys": 4}', "--out", str(out)]) == 0
    config = json.loads((out / "metrics.json").read_text())["config"]
    assert config["attention"] == "cluster-select"
    assert config["attention_options"] == {"select": 1, "window": 8, "own_group": True, "cluster_keys": 4}
    for spec, options, message in [
        ("cluster-select:select=1", '{"select": 2}', "--attention 'cluster-select:select=1' and --attention-options "
                                                     "both set select"),
        ("cluster-select:select", None, "must be key=value"),
        ("bogus:select=1", None, "unknown attention name(s) 'bogus'"),
        ("cluster-select:bogus=1", None, "bogus"),
    ]:
        with pytest.raises(SystemExit):
            main(["train", *common, "--attention", spec, *(["--attention-options", options] if options else []),
                  "--out", str(tmp_path / "bad")])
        assert message in capsys.readouterr().err


def test_all_names_every_trainable_mechanism():
    """``--names all`` / ``--attention all`` list the mechanisms with a layer of their own, not the readers of a
    decoder's cache (which train would refuse one by one, after the grid started)."""
    from clusterformer.attention.registry import get, names
    from clusterformer.cli._args import name_list

    listed = name_list("all")
    assert listed and all(get(name).kind == "sequence" for name in listed)
    assert set(names()) - set(listed) == {name for name in names() if get(name).kind == "cache"} != set()
