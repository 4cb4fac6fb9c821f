"""`clusterformer bench prefill`: the records it writes and their report (no timing is asserted). A tiny random
Llama and a whitespace tokenizer stand in for SmolLM2."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

from clusterformer import hf  # noqa: E402
from clusterformer.bench.prefill import PrefillBenchConfig, run_prefill_benchmark  # noqa: E402
from clusterformer.cli import main  # noqa: E402


class _WordTokenizer:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + sum(map(ord, w)) % 90 for w in text.split()]}


@pytest.fixture
def tiny_model(monkeypatch, tmp_path):
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = transformers.LlamaForCausalLM(config).eval()
    monkeypatch.setattr(hf, "load_pretrained", lambda name: (model, _WordTokenizer()))
    (tmp_path / "wikitext-2").mkdir()
    (tmp_path / "wikitext-2" / "wiki.valid.tokens").write_text("the cat sat on a mat . " * 60, encoding="utf-8")
    return tmp_path


def test_records_cover_every_length_and_method(tiny_model, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["bench", "prefill", "--lengths", "96,200", "--repeats", "2", "--budget", "0.25",
                 "--methods", "cluster-retrieval:prefill_block=32,clusters=4;sink-window", "--data-dir",
                 str(tiny_model), "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    methods = ["dense", "cluster-retrieval:prefill_block=32,clusters=4", "sink-window", "no-attention"]
    assert [(r["length"], r["method"]) for r in records] == [(n, m) for n in (96, 200) for m in methods]
    assert all(r["median_s"] > 0 and r["repeats"] == 2 and r["budget"] == 0.25 for r in records)
    assert all(r["speedup_vs_dense"] == 1.0 for r in records if r["method"] == "dense")
    assert main(["bench", "report", "--json", str(out)]) == 0
    assert "no-attention" in capsys.readouterr().out


def test_bad_configuration(tiny_model):
    with pytest.raises(ValueError, match="always timed"):
        PrefillBenchConfig(lengths=[64], methods=["dense"])
    with pytest.raises(ValueError, match="repeats"):
        PrefillBenchConfig(lengths=[64], repeats=0)
    with pytest.raises(ValueError, match="fewer than"):
        run_prefill_benchmark(PrefillBenchConfig(lengths=[5000], data_dir=str(tiny_model)))
    with pytest.raises(ValueError, match="data_dir"):
        run_prefill_benchmark(PrefillBenchConfig(lengths=[64], data_dir=str(tiny_model / "missing")))
