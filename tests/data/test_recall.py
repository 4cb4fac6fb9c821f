"""The recall tasks' generators (MQAR, passkey, histogram, multivalue, maxvalue): answers re-derived by independent
readers, per-sequence seeds, gap distributions, bad options; and ``train --task ...`` through the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from clusterformer.cli import main
from clusterformer.data.recall import (
    HistogramSpec,
    MQARSpec,
    MultiValueSpec,
    PasskeySpec,
    generate_recall,
    read_histogram,
    read_mqar,
    read_multivalue,
    read_passkey,
)


@pytest.mark.parametrize("spec", [MQARSpec(length=64, num_pairs=4, vocab_size=64),
                                  MQARSpec(length=130, num_pairs=7, vocab_size=40, gap="power", min_gap=9),
                                  MQARSpec(length=1024, num_pairs=32)])
def test_mqar_answers_match_an_independent_reader(spec):
    batch = generate_recall(spec, seed=5, split="test", start=0, count=20)
    assert batch.ids.shape == batch.targets.shape == (20, spec.length)
    assert int(batch.ids.min()) >= 1 and int(batch.ids.max()) < spec.vocab_size  # 0 is padding: never a token
    for b in range(20):
        tokens = batch.ids[b].tolist()
        labelled = {p: int(t) for p, t in enumerate(batch.targets[b].tolist()) if t != -100}
        assert read_mqar(tokens, spec) == labelled  # every query found, nothing else labelled
        assert len(labelled) == spec.num_pairs
        for q, s in zip(batch.queries[b].tolist(), batch.sources[b].tolist(), strict=True):
            assert tokens[s] == labelled[q] and tokens[s - 1] == tokens[q]  # the source is the value of q's key
            assert q - s > spec.min_gap  # at least min_gap noise tokens between the pair and the query


@pytest.mark.parametrize("spec", [PasskeySpec(length=40, digits=3, vocab_size=32),
                                  PasskeySpec(length=700, digits=5, min_gap=300)])
def test_passkey_answers_match_an_independent_reader(spec):
    batch = generate_recall(spec, seed=1, split="train", start=3, count=20)
    for b in range(20):
        tokens = batch.ids[b].tolist()
        labelled = {p: int(t) for p, t in enumerate(batch.targets[b].tolist()) if t != -100}
        assert read_passkey(tokens, spec) == labelled and len(labelled) == spec.digits
        assert tokens.count(PasskeySpec.MARKER) == 1 and tokens.count(PasskeySpec.QUESTION) == 1
        assert all(tokens[s] == labelled[q] for q, s in zip(batch.queries[b].tolist(), batch.sources[b].tolist(),
                                                              strict=True))
        assert min(batch.queries[b]) - max(batch.sources[b]) > spec.min_gap


@pytest.mark.parametrize("spec", [HistogramSpec(length=40, max_count=3, num_queries=4, vocab_size=16),  # raised
                                  HistogramSpec(length=300, max_count=5, num_queries=9, vocab_size=200),
                                  HistogramSpec(length=1024)])
def test_histogram_answers_match_an_independent_reader(spec):
    batch = generate_recall(spec, seed=2, split="test", start=0, count=20)
    assert batch.sources.shape == batch.source_mask.shape == (20, spec.num_queries, spec.max_count)
    seen = []
    for b in range(20):
        tokens = batch.ids[b].tolist()
        labelled = {p: int(t) for p, t in enumerate(batch.targets[b].tolist()) if t != -100}
        assert read_histogram(tokens) == labelled and len(labelled) == spec.num_queries
        assert tokens[0] == HistogramSpec.BOS and tokens.count(HistogramSpec.BOS) == 1
        assert tokens.index(HistogramSpec.SEPARATOR) == spec.context + 1 and tokens.count(HistogramSpec.SEPARATOR) == 1
        queried = tokens[spec.context + 2:]
        assert len(set(queried)) == spec.num_queries and min(queried) >= HistogramSpec.FIRST_TYPE
        context = tokens[1:spec.context + 1]
        counts = {t: context.count(t) for t in set(context)}
        assert min(counts.values()) >= 1 and max(counts.values()) <= spec.max_count  # every type's count in 1..C
        assert min(context) >= HistogramSpec.FIRST_TYPE
        for m, q in enumerate(batch.queries[b].tolist()):  # the sources: every occurrence of q's type, once
            real = batch.sources[b, m][batch.source_mask[b, m]].tolist()
            assert sorted(real) == [p for p in range(spec.context + 1) if tokens[p] == tokens[q]]
            assert len(real) == labelled[q] and tokens[batch.sources[b, m, 0]] == tokens[q]  # padding repeats one
        seen += labelled.values()
    assert set(seen) == set(range(1, spec.max_count + 1))  # every count is asked


@pytest.mark.parametrize("prefix", [False, True])
def test_histogram_every_position_matches_an_independent_reader(prefix):
    """Weiss et al.'s hist: every position but BOS and the separator is labelled with its token's count in the
    sequence, or up to itself (the causal form); the sources are exactly those occurrences. A vocabulary of 60
    types for 192 context tokens and counts up to 4: the counts are raised to fill it."""
    spec = HistogramSpec(length=200, max_count=4, num_queries=6, vocab_size=63, labels="every", prefix=prefix)
    batch = generate_recall(spec, seed=3, split="train", start=5, count=6)
    assert batch.queries.shape == (6, 198) and batch.sources.shape == (6, 198, 5)
    counts = []
    for b in range(6):
        tokens = batch.ids[b].tolist()
        labelled = {p: int(t) for p, t in enumerate(batch.targets[b].tolist()) if t != -100}
        assert read_histogram(tokens, "every", prefix) == labelled and len(labelled) == 198
        for m, q in enumerate(batch.queries[b].tolist()):
            real = batch.sources[b, m][batch.source_mask[b, m]].tolist()
            assert sorted(real) == [p for p in range(200) if tokens[p] == tokens[q] and (p <= q or not prefix)]
            assert q in real  # a position counts itself
        counts += labelled.values()
    assert max(counts) == spec.max_count + 1  # a queried type: its count in the context and its query
    assert (min(counts) == 1) and (prefix or sorted(set(counts)) == list(range(1, spec.max_count + 2)))


def test_histogram_occurrences_are_spread():
    """A type's occurrences are scattered over the context, not in one place: the farthest of a query's needed
    keys is on average well beyond half the context, so neither a window nor a few contiguous pages hold them."""
    spec = HistogramSpec(length=1024)
    batch = generate_recall(spec, seed=0, split="test", start=0, count=16)
    big = batch.source_mask.sum(-1) >= 4
    real = batch.sources.masked_fill(~batch.source_mask, 10**6)
    spread = batch.sources.masked_fill(~batch.source_mask, -1).amax(-1) - real.amin(-1)
    assert spread[big].float().mean() > spec.context / 2


@pytest.mark.parametrize("spec", [MultiValueSpec(length=301, aggregate="majority", max_count=5, num_queries=9,
                                                 values=4, vocab_size=200),
                                  MultiValueSpec(length=300, aggregate="max", max_count=5, num_queries=9, values=6,
                                                 vocab_size=200),
                                  MultiValueSpec(length=120, aggregate="majority", max_count=4, num_queries=5,
                                                 values=3, vocab_size=24),  # 14 keys for 56 pairs: counts raised
                                  MultiValueSpec(length=1024, aggregate="max")])
def test_multivalue_answers_match_an_independent_reader(spec):
    """Each query's label is the majority (or the largest) of the values its key's pairs carry, read back from the
    tokens alone; its sources are exactly those values' positions; each key has 1..C pairs; every answer occurs."""
    batch = generate_recall(spec, seed=4, split="test", start=0, count=24)
    assert batch.sources.shape == batch.source_mask.shape == (24, spec.num_queries, spec.max_count)
    separator = spec.length - spec.num_queries - 1
    answers = []
    for b in range(24):
        tokens = batch.ids[b].tolist()
        labelled = {p: int(t) for p, t in enumerate(batch.targets[b].tolist()) if t != -100}
        assert read_multivalue(tokens, spec) == labelled and len(labelled) == spec.num_queries
        assert tokens[0] == MultiValueSpec.BOS and tokens[separator] == MultiValueSpec.SEPARATOR
        assert tokens.count(MultiValueSpec.SEPARATOR) == 1 and tokens.count(MultiValueSpec.BOS) == 1
        keys = [t for t in tokens[1:separator:2] if t != MultiValueSpec.FILLER]
        assert min(keys) >= spec.first_key and max(keys) < spec.vocab_size
        counts = {k: keys.count(k) for k in set(keys)}
        assert min(counts.values()) >= 1 and max(counts.values()) <= spec.max_count
        values = tokens[2:separator:2]
        assert all(spec.FIRST_VALUE <= v < spec.first_key for v in values)
        assert len(set(tokens[separator + 1:])) == spec.num_queries
        for m, q in enumerate(batch.queries[b].tolist()):
            real = batch.sources[b, m][batch.source_mask[b, m]].tolist()
            assert sorted(real) == [p for p in range(2, separator, 2) if tokens[p - 1] == tokens[q]]
        answers += labelled.values()
    assert set(answers) == set(range(spec.values))  # every value is an answer


@pytest.mark.parametrize("aggregate", ["majority", "max"])
@pytest.mark.parametrize("prefix", [False, True])
def test_multivalue_every_value_matches_an_independent_reader(aggregate, prefix):
    """labels="every": each value token of the context is a query too, labelled with its key's majority (ties to the
    smallest) or largest value over the key's pairs -- up to and including it in the causal form (``prefix``); its
    sources are exactly those pairs' values."""
    spec = MultiValueSpec(length=301, aggregate=aggregate, max_count=5, num_queries=9, values=4, vocab_size=200,
                          labels="every", prefix=prefix)
    batch = generate_recall(spec, seed=6, split="train", start=2, count=12)
    separator = spec.length - spec.num_queries - 1
    assert batch.queries.shape == (12, spec.query_count) and spec.query_count == spec.pairs + spec.num_queries
    for b in range(12):
        tokens = batch.ids[b].tolist()
        labelled = {p: int(t) for p, t in enumerate(batch.targets[b].tolist()) if t != -100}
        assert read_multivalue(tokens, spec) == labelled and len(labelled) == spec.query_count
        for m, q in enumerate(batch.queries[b].tolist()):
            key = tokens[q] if q > separator else tokens[q - 1]
            real = batch.sources[b, m][batch.source_mask[b, m]].tolist()
            assert sorted(real) == [p for p in range(2, separator, 2)
                                    if tokens[p - 1] == key and (p <= q or not prefix or q > separator)]


@pytest.mark.parametrize("aggregate", ["majority", "max"])
@pytest.mark.parametrize(("labels", "prefix"), [("queries", False), ("every", False), ("every", True)])
def test_fused_multivalue_matches_an_independent_reader(aggregate, labels, prefix):
    """fused=True: each pair is one token; its key and value decode from the token alone (the reader's own
    arithmetic), the labels are the same aggregates, and a query's sources are exactly its key's pair tokens (up to
    it in the causal form)."""
    spec = MultiValueSpec(length=131, aggregate=aggregate, max_count=5, num_queries=7, values=3, vocab_size=150,
                          labels=labels, prefix=prefix, fused=True)
    assert spec.pairs == 131 - 7 - 2 and spec.keys == (150 - 4 - 3) // 4
    batch = generate_recall(spec, seed=3, split="test", start=5, count=16)
    separator = spec.length - spec.num_queries - 1
    answers = []
    for b in range(16):
        tokens = batch.ids[b].tolist()
        labelled = {p: int(t) for p, t in enumerate(batch.targets[b].tolist()) if t != -100}
        assert read_multivalue(tokens, spec) == labelled and len(labelled) == spec.query_count
        assert tokens[separator] == MultiValueSpec.SEPARATOR and MultiValueSpec.FILLER not in tokens
        context = tokens[1:separator]
        assert min(context) >= spec.first_pair and max(context) < spec.first_pair + spec.keys * spec.values
        assert all(spec.first_key <= t < spec.first_pair for t in tokens[separator + 1:])
        key_of = {p: (t - spec.first_pair) // spec.values for p, t in enumerate(tokens) if 0 < p < separator}
        assert max(list(key_of.values()).count(k) for k in set(key_of.values())) <= spec.max_count
        for m, q in enumerate(batch.queries[b].tolist()):
            key = tokens[q] - spec.first_key if q > separator else key_of[q]
            real = batch.sources[b, m][batch.source_mask[b, m]].tolist()
            assert sorted(real) == [p for p in range(1, separator)
                                    if key_of[p] == key and (p <= q or not prefix or q > separator)]
        answers += labelled.values()
    assert set(answers) == set(range(spec.values))


def test_multivalue_needs_every_pair():
    """The answer is not readable from one pair: for keys with 3 or more pairs, a single pair's value (the first
    in the context) disagrees with the answer often, and the pairs are spread over the context."""
    for aggregate in ("majority", "max"):
        spec = MultiValueSpec(length=1024, aggregate=aggregate)
        batch = generate_recall(spec, seed=0, split="test", start=0, count=16)
        many = batch.source_mask.sum(-1) >= 3
        first_value = batch.ids.gather(1, batch.sources[..., 0]) - spec.FIRST_VALUE
        answer = batch.targets.gather(1, batch.queries)
        assert (first_value != answer)[many].float().mean() > 0.2
        real = batch.sources.masked_fill(~batch.source_mask, 10**6)
        spread = batch.sources.masked_fill(~batch.source_mask, -1).amax(-1) - real.amin(-1)
        assert spread[many].float().mean() > spec.length / 3


def test_each_sequence_has_its_own_seed():
    spec = MQARSpec(length=64, num_pairs=4, vocab_size=64)
    whole = generate_recall(spec, seed=0, split="test", start=0, count=10)
    alone = generate_recall(spec, seed=0, split="test", start=7, count=1)  # sequence 7, regenerated on its own
    assert torch.equal(whole.ids[7], alone.ids[0]) and torch.equal(whole.targets[7], alone.targets[0])
    assert not torch.equal(whole.ids[0], whole.ids[1])
    other_split = generate_recall(spec, seed=0, split="train", start=0, count=10)
    other_seed = generate_recall(spec, seed=1, split="test", start=0, count=10)
    assert not torch.equal(whole.ids, other_split.ids) and not torch.equal(whole.ids, other_seed.ids)


def test_gap_distributions():
    """Uniform slots put most queries far from their pair at N = 1,024; Zoology's power law puts them near."""
    uniform = generate_recall(MQARSpec(length=1024, num_pairs=32), seed=0, split="test", start=0, count=64)
    power = generate_recall(MQARSpec(length=1024, num_pairs=32, gap="power"), seed=0, split="test", start=0, count=64)
    far = generate_recall(MQARSpec(length=1024, num_pairs=32, min_gap=256), seed=0, split="test", start=0, count=8)
    distance = lambda b: (b.queries - b.sources).float()  # noqa: E731
    assert (distance(uniform) > 256).float().mean() > 0.7
    assert distance(power).median() < distance(uniform).median() / 2
    assert distance(far).min() > 256


@pytest.mark.parametrize(("kind", "options", "match"), [
    (MQARSpec, {"length": 63}, "even"),
    (MQARSpec, {"length": 64, "num_pairs": 20}, "do not fit"),
    (MQARSpec, {"length": 256, "num_pairs": 20, "vocab_size": 50}, "vocab_size"),
    (MQARSpec, {"gap": "zipf"}, "gap"),
    (MQARSpec, {"power_a": 0}, "power_a"),
    (PasskeySpec, {"length": 10, "digits": 5}, "length"),
    (PasskeySpec, {"vocab_size": 18, "digits": 5}, "vocab_size"),
    (HistogramSpec, {"length": 100, "num_queries": 16, "max_count": 8}, "length"),
    (HistogramSpec, {"vocab_size": 20, "num_queries": 32}, "vocab_size"),
    (HistogramSpec, {"max_count": 0}, "max_count"),
    (HistogramSpec, {"labels": "all"}, "labels"),
    (HistogramSpec, {"vocab_size": 100, "max_count": 8}, "vocab_size"),  # 98 types x 8 < 990 context tokens
    (HistogramSpec, {"prefix": True}, "prefix"),
    (MultiValueSpec, {"aggregate": "mean"}, "aggregate"),
    (MultiValueSpec, {"values": 1}, "values"),
    (MultiValueSpec, {"length": 100, "num_queries": 8, "max_count": 8}, "length"),
    (MultiValueSpec, {"vocab_size": 60}, "vocab_size"),  # 48 keys x 8 pairs < 495 pairs
    (MultiValueSpec, {"vocab_size": 400, "fused": True}, "vocab_size"),
    (MultiValueSpec, {"fused": "no"}, "fused"),  # 1,006 pairs need 126 keys x 9 tokens
    (MultiValueSpec, {"length": 70, "num_queries": 8, "max_count": 8, "fused": True}, "length"),
    (MultiValueSpec, {"labels": "all"}, "labels"),
    (MultiValueSpec, {"prefix": True}, "prefix"),
])
def test_bad_specs_name_the_option(kind, options, match):
    with pytest.raises(ValueError, match=match):
        kind(**options)


@pytest.mark.parametrize("form", ["causal", "bidirectional"])
def test_train_histogram_through_the_cli(tmp_path, form):
    out = tmp_path / "run"
    options = {"form": form, "num_queries": 3, "max_count": 4, "vocab_size": 64, "labels": "every",
               "test_sequences": 8, "recall_sequences": 4}
    assert main(["train", "--task", "histogram", "--attention", "cluster-select", "--max-len", "64", "--task-options",
                 json.dumps(options), "--limit", "32", "--max-steps", "2", "--batch-size", "8", "--dim", "32",
                 "--out", str(out), "--no-progress"]) == 0
    m = json.loads((out / "metrics.json").read_text())["metrics"]
    assert m["test_queries"] == 8 * 62 and 0 <= m["accuracy"] <= 1 and 0 <= m["accuracy_end"] <= 1
    for layer in m["key_recall"].values():  # the share of the needed keys seen; all of them: a smaller share
        assert 0 <= layer["key_coverage_all"] <= layer["key_coverage"] <= layer["key_coverage_best_head"] <= 1
        assert layer["key_coverage"] <= layer["key_recall"]  # seeing some of them is at least seeing all
    assert main(["eval", "--checkpoint", str(out)]) == 0


@pytest.mark.parametrize(("task", "form"), [("multivalue", "causal"), ("maxvalue", "bidirectional")])
def test_train_multivalue_through_the_cli(tmp_path, task, form):
    out = tmp_path / "run"
    options = {"form": form, "num_queries": 3, "max_count": 4, "values": 5, "vocab_size": 64, "test_sequences": 8,
               "recall_sequences": 4, "labels": "every"}
    assert main(["train", "--task", task, "--attention", "cluster-select", "--max-len", "64", "--task-options",
                 json.dumps(options), "--limit", "32", "--max-steps", "2", "--batch-size", "8", "--dim", "32",
                 "--out", str(out), "--no-progress"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    m = metrics["metrics"]
    assert m["test_queries"] == 8 * (3 + 29) and 0 <= m["accuracy"] <= 1 and 0 <= m["accuracy_end"] <= 1
    assert metrics["task"] == task
    for layer in m["key_recall"].values():
        assert 0 <= layer["key_coverage_all"] <= layer["key_coverage"] <= 1
    assert main(["eval", "--checkpoint", str(out)]) == 0


@pytest.mark.parametrize("form", ["causal", "bidirectional"])
def test_train_mqar_through_the_cli(tmp_path, form):
    out = tmp_path / "run"
    options = {"form": form, "num_pairs": 4, "vocab_size": 64, "test_sequences": 8, "recall_sequences": 4}
    assert main(["train", "--task", "mqar", "--attention", "neural-clustering", "--max-len", "64", "--task-options",
                 json.dumps(options), "--limit", "32", "--max-steps", "3", "--batch-size", "8", "--dim", "32",
                 "--out", str(out), "--no-progress"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    m = metrics["metrics"]
    assert m["test_queries"] == 8 * 4 and 0 <= m["accuracy"] <= 1
    assert set(m["key_recall"]) == {"encoder.blocks.0.attn", "encoder.blocks.1.attn"}
    assert all(0 <= v["key_recall"] <= v["key_recall_any_head"] <= 1 for v in m["key_recall"].values())
    # the needed key can carry a head's largest weight only where the head sees it
    assert all(0 <= v["key_argmax"] <= min(v["key_argmax_any_head"], v["key_recall"])
               and v["key_argmax_any_head"] <= 1 for v in m["key_recall"].values())
    # the budget: strict causal: (look_back + 1) * causal_chunk_size = 32; else k = 8, chunks of 8, two of them
    assert metrics["keys_per_query"] == (32 if form == "causal" else 16)
    assert main(["eval", "--checkpoint", str(out)]) == 0


def test_train_passkey_and_bad_task_options(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--task", "passkey", "--attention", "sliding-window", "--max-len", "48", "--task-options",
                 '{"digits": 2, "test_sequences": 4, "recall_sequences": 0}', "--limit", "16", "--max-steps", "2",
                 "--batch-size", "8", "--dim", "32", "--out", str(out), "--no-progress"]) == 0
    assert "key_recall" not in json.loads((out / "metrics.json").read_text())["metrics"]
    for options, match in [('{"pairs": 4}', "unknown task option 'pairs'"), ('{"form": "left"}', "form"),
                           ("[1]", "JSON object")]:
        with pytest.raises(SystemExit):
            main(["train", "--task", "mqar", "--task-options", options, "--max-steps", "1",
                  "--out", str(tmp_path / "bad")])
        assert match in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--task", "listops", "--task-options", '{"form": "causal"}', "--max-steps", "1",
              "--out", str(tmp_path / "bad")])
    message = "task 'listops' takes no task_options (they are for mqar, passkey, histogram, multivalue, maxvalue, mlm)"
    assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the causal form needs a causal mechanism
        main(["train", "--task", "mqar", "--attention", "clustered", "--max-steps", "1",
              "--out", str(tmp_path / "bad")])
    assert "cannot be causal" in capsys.readouterr().err


class _Oracle:
    """A predict that answers every query right (from the test set's own targets), or always wrong."""

    def __init__(self, task, right: bool) -> None:
        self.task, self.right, self.model, self.device = task, right, None, torch.device("cpu")

    def __call__(self, ids, pad):
        index = next(i for i in range(len(self.task.test.ids)) if torch.equal(self.task.test.ids[i], ids[0]))
        targets = self.task.test.targets[index:index + len(ids)].clamp(min=0)
        if not self.right:
            targets = (targets + 1) % self.task.vocab_size
        return torch.nn.functional.one_hot(targets, self.task.vocab_size).float()


def test_evaluation_scores_query_positions_across_batches():
    """An oracle scores 1 and an always-wrong predictor 0 whatever the evaluation batch size (the test set spans
    several batches); the near / far split adds up."""
    from clusterformer.train.recall import prepare_recall

    task = prepare_recall("mqar", 64, 16, {"num_pairs": 4, "vocab_size": 64, "test_sequences": 10,
                                           "recall_sequences": 0, "far": 20})
    for batch_size in (3, 10):
        right = task.evaluate(_Oracle(task, True), batch_size)
        assert right["accuracy"] == right["accuracy_far"] == right["accuracy_near"] == 1.0
        assert right["test_queries"] == 40 and 0 < right["far_fraction"] < 1
        assert task.evaluate(_Oracle(task, False), batch_size)["accuracy"] == 0.0


def test_init_continues_a_run_of_the_same_task_at_another_length_and_mechanism(tmp_path):
    """--init PATH of an MQAR run: the whole model (encoder and head) continues at a longer max_len with another
    mechanism -- every tensor the checkpoint has is loaded exactly, the new mechanism's own (cluster-select's
    centroids) start fresh and are reported; a different size, vocabulary or task is refused, naming it."""
    from clusterformer.train import TrainConfig, run_training
    from clusterformer.train.loop import _set_up

    common = dict(task="mqar", dim=32, depth=2, heads=2, batch_size=8, limit=32, log_every=1, progress=False,
                  task_options={"num_pairs": 4, "vocab_size": 64, "test_sequences": 4, "recall_sequences": 0})
    short = tmp_path / "short"
    run_training(TrainConfig(out=str(short), attention="full", max_len=64, max_steps=2, **common))
    saved = {name: value for name, value in torch.load(short / "checkpoint.pt", weights_only=False)["model"].items()
             if isinstance(value, torch.Tensor)}  # full attention's extra state (no generator) is None

    long = dict(common, out=str(tmp_path / "long"), max_len=128, max_steps=1, lr=1e-3, init=str(short))
    run = _set_up(TrainConfig(attention="cluster-select", attention_options={"window": 16, "cluster_keys": 8}, **long),
                  None)
    state = run.model.state_dict()
    assert set(saved) < set(state) and len(saved) > 10
    for name, value in saved.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0)
    report = run.init_report
    assert report["kind"] == "continue" and report["pretrained_max_len"] == 64 and report["skipped"] == []
    assert sorted(report["fresh"]) == sorted(set(state) - set(saved)) and report["fresh"]
    assert all(name.endswith(("centroids", "_extra_state")) for name in report["fresh"])  # centroids, generator
    assert report["unused"] == []  # full attention's empty extra state is nothing left behind
    result = run_training(TrainConfig(attention="cluster-select", attention_options={"window": 16, "cluster_keys": 8},
                                      **dict(long, out=str(tmp_path / "long2"))))
    assert result["init"]["transferred"] == len(saved) and 0 <= result["metrics"]["accuracy"] <= 1
    same = _set_up(TrainConfig(attention="full", **dict(long, out=str(tmp_path / "long3"))), None)  # length only
    assert same.init_report["skipped"] == same.init_report["fresh"] == [] == same.init_report["unused"]
    # mixed layers: the Cluster-Former stack (cluster_layers) and a layer-wise mix continue the same checkpoint
    for mix in ({"attention": "cluster-former", "cluster_layers": (-1,), "allow_non_strict_causal": True,
                 "attention_options": {"window": 16, "stride": 8, "num_clusters": 2}},
                {"attention": "full", "layer_attention": {1: ["cluster-select", {"window": 16, "cluster_keys": 8}]}}):
        mixed = _set_up(TrainConfig(**mix, **dict(long, out=str(tmp_path / "mixed"))), None)
        state = mixed.model.state_dict()
        for name, value in saved.items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=0)
        assert mixed.init_report["skipped"] == [] and mixed.init_report["fresh"], mix
        assert all(".1." in name for name in mixed.init_report["fresh"]), "only the changed layer starts fresh"

    with pytest.raises(ValueError, match="dim: pretrained 32, here 48"):
        _set_up(TrainConfig(attention="full", **dict(long, dim=48)), None)
    wider = dict(long, task_options={**common["task_options"], "vocab_size": 80})
    with pytest.raises(ValueError, match="lacks or shapes differently"):  # another vocabulary: ids mean otherwise
        _set_up(TrainConfig(attention="full", **wider), None)
    with pytest.raises(ValueError, match="of task 'mqar'"):
        _set_up(TrainConfig(attention="full", **dict(long, task="passkey", task_options={"digits": 2})), None)
