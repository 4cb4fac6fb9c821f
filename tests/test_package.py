"""The package's shape: what its core imports."""

from __future__ import annotations

import subprocess
import sys

from docs_scripts import DOCS_SCRIPTS, load_docs_script


def test_the_core_imports_nothing_but_torch():
    """The library core pulls in no package that ``import torch`` does not (the applications that need
    numpy, scikit-learn or transformers live in clusterformer.apps and clusterformer.hf)."""
    code = ("import sys, torch; base = set(sys.modules); "
            "import clusterformer.attention, clusterformer.ops, clusterformer.clustering, clusterformer.models; "
            "print(sorted({m.split('.')[0] for m in set(sys.modules) - base}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['clusterformer']"


def test_the_documented_example_of_a_new_mechanism_works():
    """docs/ARCHITECTURE.md shows how to add a mechanism; run that code as written (in a fresh process, so the
    registry of the other tests is untouched) and check the new mechanism against full attention where they agree
    (one chunk holds every key) and that the registry, the layer and hf see it."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "ARCHITECTURE.md").read_text()
    example = doc.split("### Adding a mechanism", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    check = """
import torch
from clusterformer.attention import build, names
from clusterformer.hf import patchable
assert "local" in names() and "local" in patchable()
torch.manual_seed(0)
x = torch.randn(2, 40, 256, dtype=torch.float64)
pad = torch.zeros(2, 40, dtype=torch.bool); pad[1, 30:] = True
one_chunk = build("local", dim=256, heads=4, chunk_size=64).double()
full = build("full", dim=256, heads=4).double()
full.load_state_dict(one_chunk.state_dict())
for causal in (False, True):
    torch.testing.assert_close(one_chunk(x, pad, causal), full(x, pad, causal), rtol=0, atol=1e-12)
small = build("local", dim=256, heads=4, chunk_size=8).double()
small.load_state_dict(one_chunk.state_dict())
assert not torch.allclose(small(x, pad), full(x, pad))
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", example + check], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_every_docs_script_imports_against_the_current_api():
    """The scripts under docs/scripts that measured the docs' tables must still run: each is imported (its work
    is under ``if __name__ == "__main__"``), so a renamed or moved name they use fails here, not in a reader's hands."""
    scripts = sorted(DOCS_SCRIPTS.glob("*.py"))
    assert len(scripts) >= 5
    for path in scripts:
        assert 'if __name__ == "__main__":' in path.read_text(), f"{path.name} runs on import"
        load_docs_script(path)


def test_option_swap_reevaluates_a_run_as_trained_and_with_another_ranking(tmp_path):
    """docs/scripts/option_swap.py: without options it gives the run's recorded test accuracy (the rebuilt model is
    the trained one); with ``selection=summaries`` it evaluates the same weights (trained with the default, the
    bound) with the summaries' ranking, which is recorded in the line it prints and changes the outputs of some
    query."""
    import json

    import torch

    from clusterformer.train import TrainConfig, run_training
    from clusterformer.train.loop import load_trained

    script = load_docs_script("option_swap")
    out = tmp_path / "run"
    run_training(TrainConfig(task="mqar", out=str(out), max_len=64, max_steps=3, batch_size=4, dim=16, heads=2,
                             depth=1, attention="cluster-select",
                             attention_options={"num_clusters": 4, "select": 2, "cluster_keys": 4, "window": 8},
                             task_options={"num_pairs": 4, "vocab_size": 32, "test_sequences": 16,
                                           "recall_sequences": 4}))
    recorded = json.loads((out / "metrics.json").read_text())["metrics"]["accuracy"]
    assert f"'accuracy': {round(recorded, 4)}" in script.option_swap(str(out), {})
    swapped = script.option_swap(str(out), {"selection": "summaries"})
    assert "'selection': 'summaries'" in swapped
    trained, task, _, _ = load_trained(out)
    assert trained.encoder.blocks[0].attn.inner.options.selection == "bound"
    means, _, _, _ = load_trained(out, adjust=lambda c: c.attention_options.update(selection="summaries"))
    ids = task.test.ids[:4]
    with torch.no_grad():
        assert (trained(ids) - means(ids)).abs().max() > 1e-6, "the swapped ranking must change some output"


def test_group_sizes_on_a_hand_built_grouping():
    """docs/scripts/group_sizes.py: 6 real keys (2 padding, whose ids must not count) in groups 0, 0, 0, 1, 1, 2 on
    head 0 and all apart on head 1, reach 2: the largest group holds 1/2 and 1/6 (mean 1/3), 3 and 6 groups are
    used (4.5), 3 of the 12 keys lie in a group of more than 2."""

    import torch

    script = load_docs_script("group_sizes")
    groups = torch.tensor([[[0, 0, 0, 1, 1, 2, 0, 0], [0, 1, 2, 3, 4, 5, 0, 0]]])
    real = torch.tensor([[True] * 6 + [False] * 2])
    stats = script.sizes(groups, real, reach=2)
    assert abs(stats["largest_share"] - 1 / 3) < 1e-6 and stats["groups_used"] == 4.5
    assert stats["beyond_reach"] == 0.25


def test_cluster_probe_statistics_and_agreement_on_hand_built_groupings():
    """docs/scripts/cluster_probe.py: on one text of 6 real tokens (2 padding) in groups 0, 0, 0, 1, 1, 2: the
    largest group holds 1/2, 3 groups are used, the entropy is that of (1/2, 1/3, 1/6) over log 3; a relabelling
    agrees fully (NMI 1), a grouping that splits every group the other way agrees less."""
    import math

    import torch

    script = load_docs_script("cluster_probe")
    groups = torch.tensor([[[0, 0, 0, 1, 1, 2, -1, -1]]])
    stats = script.statistics(groups)
    p = torch.tensor([1 / 2, 1 / 3, 1 / 6], dtype=torch.float64)
    assert stats["largest"] == 0.5 and stats["used"] == 3 and stats["of"] == 3
    assert abs(stats["entropy"] - float(-(p * p.log()).sum()) / math.log(3)) < 1e-12
    relabelled = torch.tensor([[[2, 2, 2, 0, 0, 1, 5, 5]]])  # padding's id does not matter: -1 in the first
    assert abs(script.agreement(groups, relabelled) - 1.0) < 1e-12
    crossed = torch.tensor([[[0, 1, 2, 0, 1, 0, -1, -1]]])
    assert script.agreement(groups, crossed) < 0.5


def test_recall_by_heads_splits_queries_by_the_heads_that_see_their_key(tmp_path):
    """docs/scripts/recall_by_heads.py: full attention gives every query's needed key to both heads; a causal window
    of 4 over values at least 16 tokens back gives it to none. Either way the accuracy over the split is the run's
    recorded test accuracy (the same 16 test sequences)."""
    import json

    from clusterformer.train import TrainConfig, run_training

    script = load_docs_script("recall_by_heads")
    for attention, options, expected in (("full", {}, {"0": 0.0, "1": 0.0, "2": 1.0}),
                                         ("sliding-window", {"window": 4, "stride": 2}, {"0": 1.0})):
        out = tmp_path / attention
        run_training(TrainConfig(task="mqar", out=str(out), max_len=64, max_steps=3, batch_size=4, dim=16, heads=2,
                                 depth=1, attention=attention, attention_options=options,
                                 task_options={"num_pairs": 4, "vocab_size": 32, "min_gap": 16,
                                               "test_sequences": 16, "recall_sequences": 4}))
        result = script.probe(str(out), sequences=16, layer=None)
        shares = {count: row["share"] for count, row in result["by_heads_seeing_the_key"].items()}
        assert shares == expected, (attention, shares)
        recorded = json.loads((out / "metrics.json").read_text())["metrics"]["accuracy"]
        assert abs(result["accuracy"] - recorded) < 1e-9
        split = sum(row["share"] * row["accuracy"] for row in result["by_heads_seeing_the_key"].values()
                    if row["accuracy"] is not None)
        assert abs(split - recorded) < 1e-9


def test_query_key_reach_splits_the_missed_keys_into_cut_runs_and_other_clusters(tmp_path):
    """docs/scripts/query_key_reach.py: as trained, the accuracy is the run's recorded one; a query reads a subset of
    its clusters' earlier keys, so whole clusters read the needed key at least as often as the trained reach and as
    fill; runs of one key each are cut (some needed key lies in the query's clusters but is not read), runs as long
    as the sequence are not; a run that is not query-key neural-clustering is refused."""
    import json

    import pytest

    from clusterformer.train import TrainConfig, run_training

    script = load_docs_script("query_key_reach")
    common = {"task": "mqar", "max_len": 64, "max_steps": 3, "batch_size": 4, "dim": 16, "heads": 2, "depth": 1,
              "task_options": {"num_pairs": 4, "vocab_size": 32, "min_gap": 16, "test_sequences": 16,
                               "recall_sequences": 4}}
    cuts = {}
    for chunk in (1, 8, 64):
        out = tmp_path / f"chunk{chunk}"
        run_training(TrainConfig(out=str(out), attention="neural-clustering", **common,
                                 attention_options={"cluster_on": "query-key", "query_clusters": 2,
                                                    "causal_clusters": 3, "causal_chunk_size": chunk}))
        result = script.probe(str(out), sequences=16, layer=None)
        recorded = json.loads((out / "metrics.json").read_text())["metrics"]["accuracy"]
        assert result["options"] == {"cluster_on": "query-key", "query_clusters": 2, "causal_clusters": 3,
                                     "causal_chunk_size": chunk}  # the run's own, not a probe setting's
        settings = result["settings"]
        assert abs(settings["as trained"]["accuracy"] - recorded) < 1e-9
        whole = settings["whole clusters"]["key_read"]
        assert whole >= settings["as trained"]["key_read"] and whole >= settings["fill"]["key_read"]
        cuts[chunk] = result["missed_cut_from_a_run"]
        parts = settings["as trained"]["key_read"] + cuts[chunk] + result["missed_in_another_cluster"]
        assert abs(parts - 1.0) < 1e-12  # each pair reads its key, or misses it in one of the two ways
        if chunk == 8:  # 16 keys over two clusters: equal shares, water-filled, or every earlier key of both
            assert settings["as trained"]["key_read"] < settings["fill"]["key_read"] < whole, settings
    assert cuts[1] > 0 and cuts[64] == 0
    out = tmp_path / "full"
    run_training(TrainConfig(out=str(out), attention="full", **common))
    with pytest.raises(ValueError, match="RUN_DIR"):
        script.probe(str(out), sequences=16, layer=None)
