"""Budgets and the key-recall probe. Every mechanism states two numbers (``keys_read``: the logits a query computes,
summaries, centroids, page bounds and scored candidates included; ``keys_mixed``: the keys whose values reach its
output, a summary mixing all its members), each the maximum over the queries, and each is held here to a probe:
keys mixed to the weight that flows to each key's value (``attention_rows``: the gradient through values equal to
the input; ``cache_rows``: one-hot values), keys read to the logits a ``LogitSpy`` sees computed and used.
``for_budget`` meeting a budget; the probe against explicit weights and a hand-built case; ``compare
--keys-per-query``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from clusterformer.attention import build, names
from clusterformer.attention.diagnostics import (
    LogitSpy,
    attention_rows,
    attention_to_sources,
    cache_rows,
    key_recall,
    logits_read,
    step_logits,
)
from clusterformer.attention.registry import causal_semantics, get, make_options
from clusterformer.cli import main
from clusterformer.models import EncoderConfig, TokenClassifier
from docs_scripts import load_docs_script
from seeds import fixed_seed

CACHE_READERS = {name for name in names() if get(name).interface_mode == "cache"}
CASES = [(name, causal, extra) for name in sorted(set(names()) - CACHE_READERS) for causal in (False, True)
         if not causal or causal_semantics(name, {}) != "refused"
         for extra in ([{"num_clusters": 4}, {"num_clusters": 4, "summaries": False}] if name == "cluster-select"
                       else [{}, {"cluster_on": "query-key"}, {"cluster_on": "query-key", "query_clusters": 2},
                             {"cluster_on": "query-key", "query_clusters": 2, "head_clusters": "shared"},
                             {"cluster_on": "query-key", "query_clusters": 3, "reach_split": "fill"}]
                       if name == "neural-clustering" else [{}])]
# a query somewhere mixes exactly its budget (strict causal neural-clustering: only once a cluster has filled its
# blocks, which random clusters of ~6 tokens at N = 90 do not); cluster-select with its summaries mixes every key
TIGHT = {("full", False), ("full", True), ("sliding-window", False), ("sliding-window", True),
         ("neural-clustering", False), ("cluster-select", False), ("cluster-select", True)}
# every logit these compute enters one softmax with its own key's value: the logits the spy counts over all queries
# equal the keys the probe finds mixed, so each query reads exactly the keys it mixes
READ_AS_MIXED = {"full", "sliding-window", "cluster-former"}


def _mixed(layer, x, causal: bool) -> torch.Tensor:
    """(B, N, H): how many keys' values reach each query with a non-zero weight, counted by the probe."""
    B, N, _ = x.shape
    weights = attention_rows(layer, x, torch.arange(N).expand(B, N), causal=causal)  # (B, N, H, N)
    return (weights > 0).sum(-1)


@pytest.mark.parametrize(("name", "causal", "extra"), CASES)
def test_queries_mix_and_read_at_most_their_budget(name, causal, extra):
    """At N = 90 with the options ``for_budget(20)`` gives (when the mechanism has one): the keys whose values reach
    a query (the probe: weight through the values, a summary's spread over its members) never exceed
    ``keys_mixed``, and reach it where TIGHT says; ``keys_read`` (the budget ``for_budget`` meets) is <= 20 and at
    least ``keys_mixed`` where no summary or centroid mixes more than it reads."""
    torch.manual_seed(fixed_seed())
    N = 90
    defaults = make_options(name, extra)
    try:
        options = {**extra, **defaults.for_budget(20, N, causal)}
    except ValueError as error:
        assert "no option that sets" in str(error) and defaults.keys_read(N, causal) == N
        options = dict(extra)
    made = make_options(name, options)
    read, mixed = made.keys_read(N, causal), made.keys_mixed(N, causal)
    assert made.keys_per_query(N, causal) == read
    assert read <= 20 or options == extra
    layer = build(name, dim=16, heads=2, **options).eval()
    seen = _mixed(layer, torch.randn(2, N, 16), causal)
    assert int(seen.max()) <= mixed
    if (name, causal) in TIGHT:
        assert int(seen.max()) == mixed
    if options != extra:
        assert read >= 20 // 2, "the budget's options use most of the budget"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("query_clusters", "reach_split"), [(1, "equal"), (2, "equal"), (3, "equal"), (3, "fill")])
def test_query_key_runs_reach_their_budget_when_clusters_are_large(causal, query_clusters, reach_split):
    """neural-clustering with ``cluster_on="query-key"``: with few, large clusters (9 without a mask, 2 under a
    strict causal one, over 90 tokens) some query reaches ``keys_read`` exactly and none passes it -- a run of
    reach // query_clusters keys from each of its nearest clusters, as many runs as there are clusters (3 asked of
    2 clusters read 2 runs), or with reach_split="fill" the whole reach over them."""
    torch.manual_seed(fixed_seed())
    N = 90
    options = {"cluster_on": "query-key", "query_clusters": query_clusters, "num_clusters": 9, "causal_clusters": 2,
               "causal_chunk_size": 5, "reach_split": reach_split}
    if causal:
        options.pop("num_clusters")
    layer = build("neural-clustering", dim=16, heads=2, **options).eval()
    made = make_options("neural-clustering", options)
    seen = _mixed(layer, torch.randn(2, N, 16), causal)
    assert made.keys_read(N, causal) == made.keys_mixed(N, causal) == int(seen.max())


@pytest.mark.parametrize(("name", "causal"), [(name, causal) for name in sorted(READ_AS_MIXED)
                                              for causal in (False, True)])
def test_keys_read_are_the_keys_mixed_where_every_logit_is_attended(name, causal):
    """The spy's logits over every query and head equal the keys the value probe finds mixed: as each mixed key's
    logit is read, each query reads exactly the keys it mixes, and ``keys_read`` = ``keys_mixed``, reached."""
    torch.manual_seed(fixed_seed())
    N, options = 64, {"window": 12, "stride": 6} if name != "full" else {}
    layer = build(name, dim=8, heads=2, **options).eval()
    x = torch.randn(1, N, 8)
    seen = _mixed(layer, x, causal)
    assert logits_read(layer, x, causal) == int(seen.sum())
    made = make_options(name, options)
    assert made.keys_read(N, causal) == made.keys_mixed(N, causal)
    if name != "cluster-former" or not causal:  # its causal windows are not strict: the bound need not be met
        assert int(seen.max()) == made.keys_read(N, causal)


@pytest.mark.parametrize("name", ["lsh", "routing", "kmeans"])
def test_logits_of_the_bucket_mechanisms_stay_within_keys_read(name):
    """The bucket mechanisms read a few logits they do not mix (a shared-QK query's own key, pushed out unless it
    is alone): over N queries the spy's count lies between the keys mixed and N x ``keys_read``. (The clustered
    mechanisms' centroid queries compute the logits every query of their cluster shares: not per query.)"""
    torch.manual_seed(fixed_seed())
    N = 64
    options = make_options(name, {}).for_budget(20, N)
    layer = build(name, dim=8, heads=1, **options).eval()
    x = torch.randn(1, N, 8)
    total = logits_read(layer, x)
    assert int(_mixed(layer, x, False).sum()) <= total <= N * make_options(name, options).keys_read(N)


STEP_CASES = [  # (mechanism, options, the last query reaches both budgets)
    ("full", {}, True), ("sliding-window", {"window": 42, "stride": 21}, True), ("neural-clustering", {}, False),
    ("lsh", {}, False), ("routing", {}, False), ("kmeans", {}, False),
    ("cluster-select", {}, False),  # k-means groups: some clusters of untrained centroids stay empty
    ("cluster-select", {"grouping": "position"}, True),  # every page holds keys: 16 summaries and 16 bounds
    ("cluster-select", {"grouping": "position", "summaries": False}, True),
    ("cluster-select", {"grouping": "position", "selection": "summaries"}, True),  # + the 2 ranking summaries
    ("cluster-select", {"summaries": False, "selection": "scores"}, True),  # the centroids are no keys
    ("cluster-select", {"summaries": False, "members": "score"}, False),
    # 2 groups, both selected: every key outside the window is scored, and both bounds: N + 2
    ("cluster-select", {"grouping": "position", "num_clusters": 2, "summaries": False, "members": "score"}, True),
    ("cluster-select", {"num_clusters": 8, "position_splits": 4, "split_size": 32, "selection": "summaries"}, False),
    ("cluster-select", {"grouping": "position", "sink": 0, "own_group": False}, True),
]


@pytest.mark.parametrize(("name", "options", "tight"), STEP_CASES)
def test_a_decoding_query_reads_and_mixes_at_most_its_budget(name, options, tight):
    """The last query of 294 tokens, as a cached decoding step (one head): the logits the spy sees it use (keys,
    summaries, group bounds, members scored) are at most ``keys_read``, the keys whose values reach it (the value
    probe) at most ``keys_mixed``; both exactly where the query reaches them."""
    torch.manual_seed(fixed_seed())
    N = 294  # 41 + 7 x 21 + ...: the last query closes a window of 42
    if name == "cluster-select":
        options = {"window": 32, "cluster_keys": 8, **options}
    layer = build(name, dim=8, heads=1, **options).eval()
    x = torch.randn(1, N, 8)
    read = step_logits(layer, x)
    mixed = int((attention_rows(layer, x, torch.tensor([[N - 1]]), causal=True) > 0).sum())
    made = make_options(name, options)
    assert read <= made.keys_read(N, True) and mixed <= made.keys_mixed(N, True)
    if tight:
        assert (read, mixed) == (made.keys_read(N, True), made.keys_mixed(N, True))


CACHE_CASES = [
    ("sink-window", {"budget": 40}), ("sink-window", {"budget": 0.2, "sink": 0}),
    ("oracle", {"budget": 40}), ("oracle", {"budget": 0.05}),
    ("quest", {"budget": 40, "page_size": 8}), ("quest", {"budget": 0.1}), ("quest", {"budget": 37, "page_size": 5}),
    ("cluster-retrieval", {"budget": 100, "num_clusters": 8, "window": 16}),
    ("cluster-retrieval", {"budget": 100, "num_clusters": 8, "window": 16, "rerank": 1}),
    ("cluster-retrieval", {"budget": 60, "num_clusters": 8, "window": 16, "rerank": 2, "selection": "head"}),
    ("cluster-retrieval", {"budget": 100, "num_clusters": 8, "window": 16, "estimate_remainder": True}),
    ("cluster-retrieval", {"budget": 0.5, "num_clusters": 8, "window": 16}),  # 4 x 134 candidates > the index
]


@pytest.mark.parametrize(("name", "options"), CACHE_CASES)
def test_cache_readers_read_and_mix_exactly_their_budget(name, options):
    """A decoding step's query over a cache of 300 keys: the keys whose one-hot values reach its output are
    exactly ``keys_mixed``, and the logits the spy sees it use (keys, centroids, page bounds, re-ranked
    candidates) exactly ``keys_read`` -- cluster retrieval's default ``rerank=4`` scores 4x its retrieved keys,
    the oracle every key."""
    torch.manual_seed(fixed_seed())
    n, D = 300, 8
    layer = build(name, dim=D, heads=1, **options, **({"kernel": "torch"} if name == "cluster-retrieval" else {}))
    q, k = torch.randn(1, 1, 1, D), torch.randn(1, 1, n, D)
    spy = LogitSpy()
    weights = cache_rows(layer.eval(), q, k, scale=1.0, spy=spy)  # scale 1: a key ranked and attended, one value
    made = make_options(name, options)
    assert int((weights > 0).sum()) == made.keys_mixed(n)
    assert len(spy.logits) == made.keys_read(n)
    assert abs(float(weights.sum()) - 1) < 1e-12


@pytest.mark.parametrize(("name", "options", "length", "read", "mixed"), [
    ("full", {}, 1024, 1024, 1024),
    ("sliding-window", {"window": 128, "stride": 64}, 1024, 192, 192),  # the two windows holding a query
    ("sliding-window", {"window": 42, "stride": 21}, 1024, 63, 63),
    ("neural-clustering", {}, 1024, 64, 64),  # k = 32, chunks of 32, the own and one look-back chunk
    ("neural-clustering", {}, 100, 20, 20),
    ("lsh", {}, 1024, 512, 512),  # 4 rounds x 2 chunks of 64
    ("routing", {}, 1024, 128, 128),
    ("kmeans", {}, 1024, 128, 128),
    ("clustered", {}, 1024, 1024, 1024),  # centroid queries read every key
    # window, sink, 2 x 32 members, 16 summaries and 16 bounds read; the summaries mix every key
    ("cluster-select", {}, 1024, 64 + 1 + 64 + 16 + 16, 1024),
    ("cluster-select", {"summaries": False, "selection": "scores"}, 1024, 129, 129),  # the centroids are no keys
    # every member of the selected groups scored: at most every key, and then the 2 selected groups' bounds
    ("cluster-select", {"summaries": False, "members": "score"}, 1024, 1024 + 2, 129),
    ("cluster-select", {"selection": "summaries"}, 1024, 129 + 16 + 2, 1024),  # + the 2 ranking summaries
    ("oracle", {}, 4096, 4096, 410),
    ("sink-window", {}, 4096, 410, 410),
    ("quest", {}, 4096, 400 + 255, 400),  # own page, 24 pages; 255 bounds ranked
    ("cluster-retrieval", {}, 4096, 4 + 64 + 4 * 342 + 256, 410),
])
def test_default_budgets(name, options, length, read, mixed):
    made = make_options(name, options)
    assert (made.keys_read(length), made.keys_mixed(length)) == (read, mixed)
    assert made.keys_per_query(length) == read


def test_the_recorded_grids_are_counted_as_the_library_counts():
    """results/budgets/recorded-grids.json (docs/scripts/recorded_budgets.py): every entry's keys read and mixed are
    its recorded options' at its length and causal form, the most over its layers -- rerun the script when a count
    changes. The causal sliding windows of the MQAR grids read 84 of the 126 keys they were labelled with."""
    path = Path(__file__).resolve().parents[2] / "results" / "budgets" / "recorded-grids.json"
    rows = json.loads(path.read_text())
    assert rows and {"grid", "entry", "options", "length", "causal", "label_keys", "keys_read", "keys_mixed"} <= set(
        rows[0])
    for row in rows:
        made = [make_options(name, options) for name, options in row["layers"]]
        assert row["keys_read"] == max(o.keys_read(row["length"], row["causal"]) for o in made), row
        assert row["keys_mixed"] == max(o.keys_mixed(row["length"], row["causal"]) for o in made), row
    windows = [r for r in rows if r["grid"].endswith("mqar-1024-k128") and r["entry"] == "sliding-window"]
    assert [(r["label_keys"], r["keys_read"], r["keys_mixed"]) for r in windows] == [(126, 84, 84)]


def test_the_budgets_record_counts_every_committed_budgeted_grid():
    """Every committed compare grid run at one budget (a ``keys_per_query`` in its summary, or a name ``-kB``) has
    its rows in results/budgets/recorded-grids.json: a grid committed without rerunning the script is caught here."""
    root = Path(__file__).resolve().parents[2]
    script = load_docs_script("recorded_budgets")
    results = root / "results"
    budgeted = {str(path.parent.relative_to(results)) for path in results.rglob("summary.json")
                if script.budgeted(json.loads(path.read_text()), path.parent)}
    recorded = {row["grid"] for row in json.loads((results / "budgets" / "recorded-grids.json").read_text())}
    assert budgeted and not budgeted - recorded, sorted(budgeted - recorded)


def test_causal_windows_read_one_window():
    """Causal sliding windows of 42 every 21: a query sees its keys of the first window holding it, at most 42
    (not the 63 of the two windows), reached at N = 90; ``for_budget`` gives the window of the budget."""
    torch.manual_seed(fixed_seed())
    options = make_options("sliding-window", {"window": 42, "stride": 21})
    assert (options.keys_read(90, True), options.keys_read(90)) == (42, 63)
    seen = _mixed(build("sliding-window", dim=8, heads=1, window=42, stride=21).eval(), torch.randn(1, 90, 8), True)
    assert int(seen.max()) == 42
    assert options.for_budget(42, 90, causal=True) == {"window": 42, "stride": 21}
    assert options.for_budget(63, 90) == {"window": 42, "stride": 21}


def test_for_budget_errors():
    with pytest.raises(ValueError, match="no option that sets"):
        make_options("full", {}).for_budget(64, 1024)
    with pytest.raises(ValueError, match="below one chunk"):
        make_options("lsh", {}).for_budget(4, 1024)  # 4 rounds x 2 chunks need >= 8 keys
    with pytest.raises(ValueError, match="keys"):
        make_options("neural-clustering", {}).for_budget(0, 1024)


def test_probe_equals_the_explicit_attention_weights():
    """Full attention in float64: the probe's weights are softmax(q k^T / sqrt(d)) at the asked positions."""
    torch.manual_seed(fixed_seed())
    layer = build("full", dim=24, heads=3).double().eval()
    x = torch.randn(2, 37, 24, dtype=torch.float64)
    queries, sources = torch.randint(0, 37, (2, 19)), torch.randint(0, 37, (2, 19))  # 19 > head_dim: 3 passes
    for causal in (False, True):
        q, k, _ = layer.qkv(x)
        scores = q @ k.transpose(-1, -2) / math.sqrt(8)
        if causal:
            scores = scores.masked_fill(torch.ones(37, 37, dtype=torch.bool).triu(1), -math.inf)
        p = scores.softmax(-1)  # (B, H, N, N)
        expected = p[torch.arange(2).unsqueeze(1), :, queries, sources]  # (B, Q, H)
        got = attention_to_sources(layer, x, queries, sources, causal=causal)
        assert torch.allclose(got.weight, expected, atol=1e-12, rtol=0)
        rows = p[torch.arange(2).unsqueeze(1), :, queries]  # (B, Q, H, N)
        assert torch.equal(got.argmax, rows.argmax(-1) == sources.unsqueeze(-1))  # the row's largest, from softmax
        other = (sources + 1) % 37  # two acceptable keys: the weight on the pair is the sum
        pair = attention_to_sources(layer, x, queries, torch.stack([sources, other], -1), causal=causal)
        either = p[torch.arange(2).unsqueeze(1), :, queries, other]
        assert torch.allclose(pair.weight, expected + either, atol=1e-12, rtol=0)
        argmax = rows.argmax(-1)
        assert torch.equal(pair.argmax, (argmax == sources.unsqueeze(-1)) | (argmax == other.unsqueeze(-1)))
        assert not bool(got.argmax.all())  # random sources: mostly not the largest ...
        best = rows[:, :, 0].argmax(-1)  # ... and each row's largest in head 0 always is
        assert bool(attention_to_sources(layer, x, queries, best, causal=causal).argmax[:, :, 0].all())


def test_probe_on_a_hand_built_window():
    """Sliding windows of 4 every 2 over 16 tokens: query 9 lies in windows [6, 10) and [8, 12), so it sees keys
    6..11 and nothing else; neural-clustering with contiguous groups and 4 clusters: chunks of 4, query 9 in chunk 2
    sees chunks 1 and 2 (keys 4..11)."""
    torch.manual_seed(fixed_seed())
    x = torch.randn(1, 16, 8)
    window = build("sliding-window", dim=8, heads=2, window=4, stride=2).eval()
    nc = build("neural-clustering", dim=8, heads=2, num_clusters=4, grouping="contiguous").eval()
    for layer, seen in ((window, set(range(6, 12))), (nc, set(range(4, 12)))):
        weights = attention_to_sources(layer, x, torch.full((1, 16), 9), torch.arange(16).unsqueeze(0)).weight
        assert {j for j in range(16) if bool((weights[0, j] > 0).all())} == seen
        assert not bool((weights[0, [j for j in range(16) if j not in seen]] > 0).any())


def test_coverage_counts_the_needed_keys_a_query_sees():
    """The histogram's query needs several keys: on the hand-built window above (query 9 sees keys 6..11), of the
    needed keys (7, 10, 2, 14) it sees two, a share of 1/2; padding that repeats a needed key (masked) changes
    nothing, and a query needing only keys it sees covers them all. The weight sums the real entries only."""
    torch.manual_seed(fixed_seed())
    x = torch.randn(1, 16, 8, dtype=torch.float64)
    layer = build("sliding-window", dim=8, heads=2, window=4, stride=2).double().eval()
    queries = torch.tensor([[9, 9, 9]])
    sources = torch.tensor([[[7, 10, 2, 14, 7, 7], [7, 10, 2, 14, 2, 2], [11, 6, 11, 11, 11, 11]]])
    mask = torch.tensor([[[True] * 4 + [False] * 2, [True] * 4 + [False] * 2, [True, True] + [False] * 4]])
    found = attention_to_sources(layer, x, queries, sources, source_mask=mask)
    assert found.coverage[0].tolist() == [[0.5, 0.5], [0.5, 0.5], [1.0, 1.0]]
    alone = attention_to_sources(layer, x, torch.full((1, 4), 9), torch.tensor([[7, 10, 11, 6]]))
    w = alone.weight[0]  # (4, H): the single keys' weights
    assert torch.allclose(found.weight[0, 0], w[0] + w[1], atol=1e-14, rtol=0)  # not 3 x w[0] from the padding
    assert torch.allclose(found.weight[0, 2], w[2] + w[3], atol=1e-14, rtol=0)
    assert torch.equal(alone.coverage[0], (w > 0).double())  # one needed key: seen or not
    with pytest.raises(ValueError, match="source_mask must be a bool"):
        attention_to_sources(layer, x, queries, sources, source_mask=mask[..., :3])
    with pytest.raises(ValueError, match="at least one needed key"):
        attention_to_sources(layer, x, queries, sources, source_mask=mask & False)


@pytest.mark.parametrize("name", ["neural-clustering", "routing"])
def test_probe_on_shared_qk_clustering_equals_its_dense_weights(name):
    """A mechanism that clusters its shared QK (routing, neural-clustering ``cluster_on="shared-qk"``) gets the
    probe's queries and keys from the same projection: with one cluster and a chunk holding every key, its weights
    are the shared-QK dense ones (unit keys, a query's own key excluded)."""
    torch.manual_seed(fixed_seed())
    N = 12
    options = ({"num_clusters": 1, "cluster_on": "shared-qk"} if name == "neural-clustering"
               else {"num_clusters": 1, "chunk_size": N, "look_back": 0})
    layer = build(name, dim=8, heads=2, **options).double().eval()
    x = torch.randn(1, N, 8, dtype=torch.float64)
    qk, _, _ = layer.qkv(x)
    scores = qk @ torch.nn.functional.normalize(qk, dim=-1).transpose(-1, -2) / math.sqrt(4)
    p = scores.masked_fill(torch.eye(N, dtype=torch.bool), -math.inf).softmax(-1)  # (1, H, N, N)
    got = attention_to_sources(layer, x, torch.arange(N).repeat_interleave(N).unsqueeze(0),
                               torch.arange(N).repeat(N).unsqueeze(0))  # (1, N * N, H)
    assert torch.allclose(got.weight[0].view(N, N, 2).permute(2, 0, 1), p[0], atol=1e-12, rtol=0)


def test_key_recall_walks_every_layer_and_keeps_the_model_unchanged():
    torch.manual_seed(fixed_seed())
    model = TokenClassifier(EncoderConfig(vocab_size=20, dim=16, heads=2, depth=2, dropout=0.0,
                                          attention="sliding-window", attention_options={"window": 4, "stride": 2}),
                            num_classes=20)
    tokens = torch.randint(1, 20, (3, 16))
    state = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    queries = torch.full((3, 2), 9)
    sources = torch.tensor([[7, 2]] * 3)  # 7 is in query 9's windows, 2 is not
    result = key_recall(model, tokens, queries, sources)
    assert set(result) == {"encoder.blocks.0.attn", "encoder.blocks.1.attn"} and model.training
    for found in result.values():
        assert bool((found.weight[:, 0] > 0).all()) and not bool((found.weight[:, 1] > 0).any())
        assert not bool(found.argmax[:, 1].any())  # a key outside the attended set is never the largest
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    with pytest.raises(ValueError, match="sources must hold positions"):
        key_recall(model, tokens, queries, torch.full((3, 2), 16))
    with pytest.raises(ValueError, match="no attention layer"):
        key_recall(torch.nn.Linear(2, 2), tokens, queries, sources)


def test_compare_sets_one_budget_for_every_entry(tmp_path, capsys):
    lines = [f"{i % 2} {'good fine great' if i % 2 else 'bad poor awful'} film number {i}" for i in range(32)]
    (tmp_path / "train.txt").write_text("\n".join(lines) + "\n")
    (tmp_path / "test.txt").write_text("\n".join(lines[:8]) + "\n")
    out = tmp_path / "cmp"
    assert main(["compare", "--tasks", "text-classification", "--attention",
                 "full,neural-clustering,sliding-window,lsh", "--seeds", "0", "--keys-per-query", "8", "--out",
                 str(out), "--", "--train-file", str(tmp_path / "train.txt"), "--test-file",
                 str(tmp_path / "test.txt"), "--max-steps", "1", "--batch-size", "8", "--dim", "16", "--heads", "2",
                 "--depth", "1", "--max-len", "16"]) == 0
    task = out / "text-classification"
    config = lambda label: json.loads((task / label / "seed0" / "metrics.json").read_text())  # noqa: E731
    assert config("neural-clustering")["config"]["attention_options"] == {"num_clusters": 4}  # 2 chunks of 4
    assert config("sliding-window")["config"]["attention_options"] == {"window": 4, "stride": 2}
    assert config("lsh")["config"]["attention_options"] == {"chunk_size": 1}  # 4 rounds x 2 chunks
    summary = json.loads((out / "summary.json").read_text())
    keys = {label: row["keys_per_query"] for label, row in summary["tasks"]["text-classification"]["mechanisms"]
            .items()}
    assert keys == {"full": 16, "neural-clustering": 8, "sliding-window": 6, "lsh": 8}
    rows = summary["tasks"]["text-classification"]["mechanisms"]
    assert {label: (row["keys_read"], row["keys_mixed"]) for label, row in rows.items()} == {
        label: (n, n) for label, n in keys.items()}  # none of these mixes more keys than it reads
    assert "| keys read | keys mixed |" in (out / "summary.md").read_text()
    assert "full: no option sets it" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["compare", "--tasks", "mr", "--attention", "lsh", "--keys-per-query", "4", "--out", str(out)])
    assert "--keys-per-query 4 for 'lsh'" in capsys.readouterr().err


def test_probe_tells_a_key_read_as_the_answer_from_one_averaged_into_a_summary():
    """Hand-built, causal, N = 12, q = k = x (identity projections, one head of 2 channels): key 0 scores highest
    against query 11. Full attention gives it the row's largest weight. cluster-select with summaries (pages of 1
    position in 2 groups, a 2-key window, 1 cluster of 1 key) selects group 0 (its summary holds key 0) and reads
    its nearest member, key 8, alone; key 0 is averaged into the summary of {0, 2, 4, 6} with logit
    q . mean / sqrt(2) + log 4, so its weight is e^(1 / sqrt(2)) / Z -- positive (recalled) but below key 10's.
    With key 10 silenced (x_10 = 0) that summary is the heaviest part of the row, yet its four members share it
    equally: key 0 ties with keys 2, 4, 6 and is still not the argmax."""
    s = math.sqrt(2)
    x = torch.zeros(1, 12, 2, dtype=torch.float64)
    x[0, 0, 0], x[0, 10, 0], x[0, 11, 0] = 4.0, 2.0, 1.0
    query, keys = torch.tensor([[11, 11]]), torch.tensor([[0, 10]])
    options = {"summaries": True, "selection": "summaries", "grouping": "position", "num_clusters": 2, "select": 1,
               "cluster_keys": 1, "window": 2, "own_group": False}
    layers = {}
    for name, extra in (("full", {}), ("cluster-select", options)):
        layer = build(name, dim=2, heads=1, bias=False, **extra).double().eval()
        with torch.no_grad():
            layer.to_qkv.weight.copy_(torch.eye(2, dtype=torch.float64).repeat(3, 1))
        layers[name] = layer
    argmax = {name: attention_to_sources(layer, x, query, keys, causal=True).argmax[0, :, 0].tolist()
              for name, layer in layers.items()}
    assert argmax == {"full": [True, False], "cluster-select": [False, True]}
    found = attention_to_sources(layers["cluster-select"], x, query, keys, causal=True)
    # key 10 and 11 in the window, key 8 alone, the summaries of {0, 2, 4, 6} and of {1, 3, 5, 7, 9}
    z = math.exp(2 / s) + math.exp(1 / s) + 1 + 4 * math.exp(1 / s) + 5
    assert abs(float(found.weight[0, 0, 0]) - math.exp(1 / s) / z) < 1e-12
    assert abs(float(found.weight[0, 1, 0]) - math.exp(2 / s) / z) < 1e-12
    x[0, 10, 0] = 0.0
    rows = attention_rows(layers["cluster-select"], x, torch.tensor([[11]]), causal=True)[0, 0, 0]  # (N,)
    assert rows.argmax().item() in (0, 2, 4, 6) and torch.equal(rows[[0, 2, 4, 6]], rows[[0, 0, 0, 0]])
    assert not attention_to_sources(layers["cluster-select"], x, torch.tensor([[11]]), torch.tensor([[0]]),
                                    causal=True).argmax.any()
    assert attention_to_sources(layers["full"], x, torch.tensor([[11]]), torch.tensor([[0]]), causal=True).argmax.all()
