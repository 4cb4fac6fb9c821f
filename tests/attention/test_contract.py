"""What every registered mechanism promises: defaults build, one calling convention, padding invariance,
finite gradients, deterministic evaluation, strict causality where claimed, clear errors; and reversible
blocks whose recomputing backward equals ordinary backprop for every mechanism."""

from __future__ import annotations

import copy

import pytest
import torch

from clusterformer.attention import build, collect_aux_losses, describe, names, record_groups
from clusterformer.attention.registry import causal_semantics
from clusterformer.models import Encoder, EncoderConfig, cluster_former_config
from clusterformer.models import reversible as reversible_module
from clusterformer.models.reversible import TiedConnection
from reference import run_recorded
from seeds import fixed_seed

# Labels: every registered name, and variants of one with options that change what a query sees (each keeps
# every guarantee): label -> (mechanism, options at the small test sizes, options beside the defaults).
VARIANTS = {"neural-clustering+local_window": ("neural-clustering", {"num_clusters": 3, "local_window": 4},
                                               {"local_window": 32}),
            "neural-clustering+shared-qk": ("neural-clustering", {"num_clusters": 3, "cluster_on": "shared-qk"},
                                            {"cluster_on": "shared-qk"}),
            "neural-clustering+shared-qk+local_window": (
                "neural-clustering", {"num_clusters": 3, "cluster_on": "shared-qk", "local_window": 2},
                {"cluster_on": "shared-qk", "local_window": 32}),
            "neural-clustering+query-key": ("neural-clustering", {"num_clusters": 3, "cluster_on": "query-key",
                                                                  "causal_chunk_size": 3, "causal_clusters": 3},
                                            {"cluster_on": "query-key"}),
            "neural-clustering+query-key+2-clusters": (
                "neural-clustering", {"num_clusters": 3, "cluster_on": "query-key", "causal_chunk_size": 3,
                                      "causal_clusters": 3, "query_clusters": 2},
                {"cluster_on": "query-key", "query_clusters": 2}),
            "neural-clustering+query-key+ema": (
                "neural-clustering", {"num_clusters": 3, "cluster_on": "query-key", "causal_chunk_size": 3,
                                      "causal_clusters": 3, "centroid_update": "ema", "centroid_fit": "keys"},
                {"cluster_on": "query-key", "centroid_update": "ema", "centroid_fit": "keys"}),
            "neural-clustering+query-key+shared-heads": (
                "neural-clustering", {"num_clusters": 3, "cluster_on": "query-key", "causal_chunk_size": 3,
                                      "causal_clusters": 3, "centroid_update": "ema", "centroid_fit": "keys",
                                      "query_clusters": 2, "head_clusters": "shared"},
                {"cluster_on": "query-key", "centroid_update": "ema", "centroid_fit": "keys", "query_clusters": 2,
                 "head_clusters": "shared"}),
            "neural-clustering+query-key+fill": (
                "neural-clustering", {"num_clusters": 3, "cluster_on": "query-key", "causal_chunk_size": 3,
                                      "causal_clusters": 3, "centroid_update": "ema", "centroid_fit": "keys",
                                      "query_clusters": 3, "reach_split": "fill"},
                {"cluster_on": "query-key", "centroid_update": "ema", "centroid_fit": "keys", "query_clusters": 3,
                 "reach_split": "fill"}),
            "neural-clustering+prefix-assign": ("neural-clustering", {"num_clusters": 3, "causal_assign": "prefix",
                                                                      "local_window": 2},
                                                {"causal_assign": "prefix", "local_window": 32}),
            "cluster-select+random": ("cluster-select", {"num_clusters": 4, "select": 2, "cluster_keys": 2, "window": 4,
                                                      "selection": "random"}, {"selection": "random"}),
            "cluster-select-no-summaries": ("cluster-select", {"num_clusters": 4, "select": 2, "cluster_keys": 2,
                                                         "window": 4, "summaries": False},
                                         {"summaries": False}),  # the default reads summaries; this one does not
            "cluster-select+banded": ("cluster-select", {"num_clusters": 4, "select": 2, "cluster_keys": 2,
                                                      "window": 4, "summaries": True, "selection": "summaries",
                                                      "kernel": "banded"},
                                      {"summaries": True, "selection": "summaries", "kernel": "banded"}),
            "cluster-select+position": ("cluster-select", {"num_clusters": 4, "select": 2, "cluster_keys": 2,
                                                        "window": 4, "summaries": True, "selection": "summaries",
                                                        "grouping": "position"},
                                        {"summaries": True, "selection": "summaries", "grouping": "position"}),
            "cluster-select+random-groups": ("cluster-select", {"num_clusters": 4, "select": 2, "cluster_keys": 2,
                                                             "window": 4, "summaries": True,
                                                             "selection": "summaries", "grouping": "random"},
                                             {"summaries": True, "selection": "summaries", "grouping": "random"}),
            "cluster-select+position-splits": ("cluster-select", {"num_clusters": 3, "select": 2, "cluster_keys": 2,
                                                               "window": 4, "position_splits": 2, "split_size": 5},
                                               {"position_splits": 4, "split_size": 64}),
            "cluster-select+bound": ("cluster-select", {"num_clusters": 4, "select": 2, "cluster_keys": 2,
                                                     "window": 4, "selection": "bound", "bound_block": 3},
                                     {"selection": "bound"}),
            "cluster-select+own-group": ("cluster-select", {"num_clusters": 4, "select": 2, "cluster_keys": 2,
                                                         "window": 4, "selection": "bound", "bound_block": 3,
                                                         "own_group": True},
                                         {"selection": "bound", "own_group": True}),
            "cluster-select+sink": ("cluster-select", {"num_clusters": 4, "select": 2, "cluster_keys": 2,
                                                    "window": 4, "selection": "bound", "bound_block": 3,
                                                    "own_group": True, "sink": 1},
                                    {"selection": "bound", "own_group": True, "sink": 1}),
            "cluster-select+balance": ("cluster-select", {"num_clusters": 4, "select": 2, "cluster_keys": 2,
                                                       "window": 4, "balance": 0.5},
                                       {"balance": 0.5}),  # one training step moves every cluster's bias by 0.5
            "cluster-select+score-members": ("cluster-select", {"num_clusters": 3, "select": 2, "cluster_keys": 2,
                                                             "window": 4, "summaries": False, "members": "score",
                                                             "position_splits": 2, "split_size": 5},
                                             {"summaries": False, "members": "score"}),
            "neural-clustering+explore": ("neural-clustering", {"num_clusters": 3, "explore": 0.5}, {"explore": 0.5})}
ALL = [*names(), *VARIANTS]
NON_CAUSAL = {"clustered", "improved-clustered"}  # refuse causal=True with a ValueError
NOT_STRICT = {"cluster-former"}  # causal mask inside sorted windows (paper); documented as not strict
STRICT_CAUSAL = [n for n in ALL if n not in NON_CAUSAL | NOT_STRICT]
SMALL = {  # options that make the sparse structure bite at test sizes
    "lsh": {"chunk_size": 4, "causal_chunk_size": 3, "num_rounds": 2},
    "routing": {"chunk_size": 4, "causal_chunk_size": 3, "num_clusters": 3},
    "kmeans": {"chunk_size": 4, "causal_chunk_size": 3, "num_clusters": 3},
    "sliding-window": {"window": 6, "stride": 3},
    "cluster-former": {"window": 6, "stride": 3, "num_clusters": 3}, "clustered": {"num_clusters": 4},
    "improved-clustered": {"num_clusters": 4, "topk": 3}, "neural-clustering": {"num_clusters": 3}, "full": {},
    "cluster-select": {"num_clusters": 3, "select": 2, "cluster_keys": 2, "window": 4},
    # a sequence's attention to itself is full attention for these; their budgets bite on a decoder's cache
    # (tests/hf/test_interface.py, tests/ops/test_retrieval.py, tests/ops/test_topk_cache.py)
    "cluster-retrieval": {"budget": 4, "num_clusters": 2, "window": 2}, "sink-window": {"budget": 4},
    "oracle": {"budget": 4}, "quest": {"budget": 4, "page_size": 2},
}


def _mechanism(label):
    """The registered name behind a label."""
    return VARIANTS[label][0] if label in VARIANTS else label


def _small(name, **extra):
    torch.manual_seed(fixed_seed())
    options = VARIANTS[name][1] if name in VARIANTS else SMALL[name]
    return build(_mechanism(name), dim=16, heads=2, **{**options, **extra}).double()


def _default(name, dim, heads):
    """The mechanism with its defaults (a variant: with its own options on top)."""
    return build(_mechanism(name), dim=dim, heads=heads, **(VARIANTS[name][2] if name in VARIANTS else {}))


def test_every_mechanism_is_registered_and_documented():
    assert {"full", "neural-clustering", "clustered", "improved-clustered", "cluster-former", "sliding-window",
            "lsh", "routing", "kmeans"} <= set(ALL)
    for name in names():
        info = describe(name)
        assert info["summary"] and isinstance(info["options"], dict)
        layer = build(name, dim=64, heads=4)
        assert type(layer).__module__.startswith("clusterformer.attention.")
        assert type(layer).__doc__ or __import__(type(layer).__module__, fromlist=["x"]).__doc__


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("N", [1, 7, 40])
def test_defaults_build_and_calling_convention(name, N):
    layer = _default(name, dim=64, heads=4)
    x = torch.randn(2, N, 64)
    pad = torch.zeros(2, N, dtype=torch.bool)
    pad[1, N // 2 + 1:] = True
    y = layer(x, key_padding_mask=pad, causal=False)
    assert y.shape == x.shape and torch.isfinite(y).all()
    assert torch.all(y[pad] == 0)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("causal", [False, True])
def test_padding_invariance(name, causal):
    if causal and name in NON_CAUSAL:
        pytest.skip("refuses causal=True")
    layer = _small(name).eval()
    N = 23
    x = torch.randn(2, N, 16, dtype=torch.float64)
    pad = torch.zeros(2, N, dtype=torch.bool)
    pad[0, 17:] = True
    pad[1, ::4] = True  # padding in the middle too
    y = layer(x, key_padding_mask=pad, causal=causal)
    x2 = x.clone()
    x2[pad] = torch.randn(int(pad.sum()), 16, dtype=torch.float64) * 100
    y2 = layer(x2, key_padding_mask=pad, causal=causal)
    torch.testing.assert_close(y2[~pad], y[~pad], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("trained", [False, True])
def test_outputs_do_not_depend_on_the_batch(name, causal, trained):
    """A sequence alone, and right-padded (by two different amounts) in a batch beside longer sequences,
    with every mechanism's defaults: the same outputs on its real tokens (float64, eval). ``trained``: after
    one training forward, so that stateful mechanisms (centroids, memory bank) evaluate with learnt state."""
    if causal and name in NON_CAUSAL:
        pytest.skip("refuses causal=True")
    torch.manual_seed(fixed_seed())
    layer = _default(name, dim=32, heads=2).double()
    g = torch.Generator().manual_seed(fixed_seed())
    if trained:
        layer(torch.randn(3, 200, 32, dtype=torch.float64, generator=g))
        layer(torch.randn(3, 200, 32, dtype=torch.float64, generator=g))  # applies the first step's update
    layer.eval()
    L = 150
    x = torch.randn(1, L, 32, dtype=torch.float64, generator=g)
    alone = layer(x, causal=causal)
    worst = 0.0
    for N in (230, 700):
        others = torch.randn(2, N, 32, dtype=torch.float64, generator=g)
        batch = torch.cat([torch.cat([x, torch.zeros(1, N - L, 32, dtype=torch.float64)], 1), others])
        pad = torch.zeros(3, N, dtype=torch.bool)
        pad[0, L:] = True
        pad[2, N - 40:] = True
        y = layer(batch, key_padding_mask=pad, causal=causal)
        worst = max(worst, (y[0, :L] - alone[0]).abs().max().item())
    assert worst <= 1e-10, f"largest change on real tokens: {worst:.3g}"  # measured <= 1.7e-16


@pytest.mark.parametrize("name", ALL)
def test_finite_gradients_including_all_padding_rows(name):
    layer = _small(name)
    x = torch.randn(3, 19, 16, dtype=torch.float64, requires_grad=True)
    pad = torch.zeros(3, 19, dtype=torch.bool)
    pad[1, 10:] = True
    pad[2, :] = True  # a sequence that is all padding
    y, aux, _ = run_recorded(layer, x, key_padding_mask=pad)
    loss = y.pow(2).sum() + sum(v for v in aux.values() if torch.isfinite(v))
    loss.backward()
    assert torch.isfinite(x.grad).all()
    for p in layer.parameters():
        assert p.grad is None or torch.isfinite(p.grad).all()
    assert torch.all(y[2] == 0)


@pytest.mark.parametrize("name", ALL)
def test_evaluation_is_deterministic_and_training_runs(name):
    layer = _small(name)
    x = torch.randn(2, 30, 16, dtype=torch.float64)
    layer(x)  # a training step (stateful mechanisms update their state)
    layer.eval()
    torch.testing.assert_close(layer(x), layer(x), atol=0, rtol=0)


@pytest.mark.parametrize("name", STRICT_CAUSAL)
@pytest.mark.parametrize("N", [12, 29])
def test_strict_causal_no_future_leak(name, N):
    layer = _small(name, **({"causal_mode": "strict"} if name == "neural-clustering" else {})).eval()
    x = torch.randn(2, N, 16, dtype=torch.float64)
    y = layer(x, causal=True)
    for t in range(N - 1):
        changed = x.clone()
        changed[:, t + 1:] = torch.randn(2, N - t - 1, 16, dtype=torch.float64) * 3
        y2 = layer(changed, causal=True)
        torch.testing.assert_close(y2[:, : t + 1], y[:, : t + 1], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("name", STRICT_CAUSAL)
@pytest.mark.parametrize("trained", [False, True])
def test_strict_causal_prefix_gives_the_same_outputs_alone(name, trained):
    """Strict causal is autoregressive: with every mechanism's defaults, the first t tokens alone give the same
    outputs as inside a 300-token sequence, for t on and around the chunk, bucket and window boundaries of
    the defaults (16, 64, 128) -- nothing about the chunking may follow the length."""
    torch.manual_seed(fixed_seed())
    layer = _default(name, dim=32, heads=2).double()
    g = torch.Generator().manual_seed(fixed_seed())
    if trained:
        layer(torch.randn(3, 200, 32, dtype=torch.float64, generator=g), causal=True)
        layer(torch.randn(3, 200, 32, dtype=torch.float64, generator=g), causal=True)
    layer.eval()
    x = torch.randn(1, 300, 32, dtype=torch.float64, generator=g)
    whole = layer(x, causal=True)
    worst = 0.0
    for t in (1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 192, 299):
        worst = max(worst, (layer(x[:, :t], causal=True) - whole[:, :t]).abs().max().item())
    assert worst <= 1e-10, f"largest change of a prefix's outputs: {worst:.3g}"


@pytest.mark.parametrize(("name", "options"), [("cluster-former", {}), ("neural-clustering", {"causal_mode": "paper"})])
def test_paper_causal_modes_are_declared_and_really_not_strict(name, options):
    """Mechanisms whose causal mode is the papers' (masking inside groups built from the whole sequence)
    declare it, and the declaration is true: changing later tokens changes some earlier output. Training a
    language model refuses them (tests/train/test_train.py)."""
    assert causal_semantics(name, options) == "paper"
    layer = _small(name, **options).eval()
    x = torch.randn(2, 29, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(fixed_seed()))
    y = layer(x, causal=True)
    moved = 0.0
    for t in range(4, 28, 4):
        changed = x.clone()
        changed[:, t + 1:] = 3 * torch.randn(2, 28 - t, 16, dtype=torch.float64)
        moved = max(moved, (layer(changed, causal=True)[:, : t + 1] - y[:, : t + 1]).abs().max().item())
    assert moved > 1e-6


def test_declared_causal_semantics_match_the_test_lists():
    for name in ALL:
        assert causal_semantics(_mechanism(name), {}) == (
            "refused" if name in NON_CAUSAL else "paper" if name in NOT_STRICT else "strict"), name


@pytest.mark.parametrize(("name", "options", "match"), [
    ("lsh", {"n_buckets": 3}, "n_buckets"), ("lsh", {"n_hashes": 0}, "n_hashes"),
    ("lsh", {"bucket_size": "8"}, "bucket_size"),
    ("routing", {"decay": 1.0}, "decay"), ("routing", {"num_clusters": 0}, "num_clusters"),
    ("kmeans", {"n_rounds": 0}, "n_rounds"), ("kmeans", {"seed": -1}, "seed"),
    ("clustered", {"bits": 0}, "bits"), ("clustered", {"topk": 4}, "topk"), ("improved-clustered", {"topk": 0}, "topk"),
    ("sliding-window", {"stride": 9, "window": 8}, "stride"), ("cluster-former", {"memory_size": 0}, "memory_size"),
    ("cluster-former", {"update_every": 0}, "update_every"), ("cluster-former", {"bogus": 1}, "bogus"),
    ("neural-clustering", {"cluster_on": "query-key", "centroid_fit": "queries"}, "centroid_fit"),
    ("neural-clustering", {"centroid_fit": "keys"}, "centroid_fit='keys' needs cluster_on='query-key'"),
    ("neural-clustering", {"cluster_on": "query-key", "local_window": 4}, "local_window"),
    ("neural-clustering", {"query_clusters": 2}, "query_clusters=2 needs cluster_on='query-key'"),
    ("neural-clustering", {"head_clusters": "shared"}, "head_clusters='shared' needs cluster_on='query-key'"),
    ("neural-clustering", {"cluster_on": "query-key", "head_clusters": "every"}, "head_clusters"),
    ("neural-clustering", {"centroid_update": "ema"}, "centroid_update='ema' needs cluster_on='query-key'"),
    ("neural-clustering", {"cluster_on": "query-key", "centroid_update": "kmeans"}, "centroid_update"),
    ("neural-clustering", {"cluster_on": "query-key", "centroid_update": "ema", "centroid_decay": 1.0},
     "centroid_decay"),
    ("neural-clustering", {"cluster_on": "query-key", "query_clusters": 0}, "query_clusters"),
    ("neural-clustering", {"reach_split": "fill"}, "reach_split='fill' needs cluster_on='query-key'"),
    ("neural-clustering", {"cluster_on": "query-key", "reach_split": "even"}, "reach_split"),
])
def test_bad_options_give_clear_errors(name, options, match):
    with pytest.raises(ValueError, match=match):
        build(name, dim=16, heads=2, **options)


@pytest.mark.parametrize("name", ALL)
def test_bad_inputs_give_clear_errors(name):
    layer = _default(name, dim=16, heads=2)
    with pytest.raises(ValueError, match="x must have shape"):
        layer(torch.randn(1, 5, 8))
    with pytest.raises(ValueError, match="key_padding_mask"):
        layer(torch.randn(1, 5, 16), key_padding_mask=torch.zeros(1, 4, dtype=torch.bool))


def test_cluster_former_stack_builder():
    config = cluster_former_config(100, depth=4, cluster_layers=(1, 3), window=8, stride=4, num_clusters=3, dim=32,
                                   heads=2)
    model = Encoder(config)
    kinds = [type(b.attn.inner).__name__ for b in model.blocks]
    assert kinds == ["SlidingWindowAttention", "ClusterFormerAttention", "SlidingWindowAttention",
                     "ClusterFormerAttention"]
    out = model(torch.randint(1, 100, (2, 30)))
    assert out.shape == (2, 30, 32)
    with pytest.raises(ValueError, match="cluster_layers"):
        cluster_former_config(100, depth=2, cluster_layers=(2,))


# ---------------------------------------------------------------------------------------------------------
# Reversible blocks


def _reversible_pair(name, tied, dropout=0.1, tied_lipschitz=0.5):
    options = dict(VARIANTS[name][1] if name in VARIANTS else SMALL[name])
    if describe(_mechanism(name))["attention_dropout"]:
        options["dropout"] = dropout
    config = EncoderConfig(vocab_size=40, dim=16, depth=3, heads=2, dropout=dropout, attention=_mechanism(name),
                           attention_options=options, reversible=True, tied=tied, tied_lipschitz=tied_lipschitz)
    torch.manual_seed(fixed_seed())
    model = Encoder(config).double()
    if tied:  # leave the zero initialisation so H matters, but keep it a contraction
        for h in model.reversible.tied:
            torch.nn.init.normal_(h.net[2].weight, std=0.05)
    plain = copy.deepcopy(model)
    plain.reversible.recompute = False
    return model, plain


def _grads(model, tokens, pad, causal, seed):
    torch.manual_seed(seed)
    y, aux, _ = run_recorded(model, tokens, key_padding_mask=pad, causal=causal)
    loss = (y * torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype)).pow(2).sum() + sum(aux.values(), torch.zeros(()))
    loss.backward()
    return y.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("tied", [False, True])
def test_reversible_recompute_equals_ordinary_backprop(name, tied):
    model, plain = _reversible_pair(name, tied)
    tokens = torch.randint(1, 40, (2, 26))
    pad = torch.zeros(2, 26, dtype=torch.bool)
    pad[1, 20:] = True
    causal = name not in NON_CAUSAL
    seed = fixed_seed()
    y_rev, g_rev = _grads(model, tokens, pad, causal, seed)
    y_ref, g_ref = _grads(plain, tokens, pad, causal, seed)
    torch.testing.assert_close(y_rev, y_ref, atol=1e-12, rtol=0)
    assert g_rev.keys() == g_ref.keys() and len(g_ref) > 10
    for n in g_ref:
        torch.testing.assert_close(g_rev[n], g_ref[n], atol=1e-10, rtol=1e-10, msg=n)  # measured ~1e-14


@pytest.mark.parametrize("tied", [False, True])
def test_reversible_parameter_gradients_come_back_from_autograd_grad(tied):
    """The blocks' parameters are inputs of the reversible function: torch.autograd.grad(loss, params) returns
    their gradients (equal to ordinary backprop's) and leaves .grad alone -- no nested accumulation, which is
    what lets DDP's gradient hooks fire once per parameter."""
    model, plain = _reversible_pair("neural-clustering", tied)
    tokens = torch.randint(1, 40, (2, 26))
    _, g_ref = _grads(plain, tokens, None, False, 3)
    torch.manual_seed(3)
    y, aux, _ = run_recorded(model, tokens, causal=False)
    loss = (y * torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype)).pow(2).sum() + sum(aux.values(), torch.zeros(()))
    named = [(n, p) for n, p in model.named_parameters() if n in g_ref]
    grads = torch.autograd.grad(loss, [p for _, p in named])
    assert all(p.grad is None for p in model.parameters())
    assert len(named) == len(g_ref) > 10
    for (n, _), g in zip(named, grads, strict=True):
        torch.testing.assert_close(g, g_ref[n], atol=1e-10, rtol=1e-10, msg=n)


def test_reversible_check_fails_without_rng_replay(monkeypatch):
    """The equality above depends on replaying hashing and dropout: without it the gradients differ."""
    model, plain = _reversible_pair("lsh", tied=False, dropout=0.3)
    monkeypatch.setattr(reversible_module._RNGState, "restore", lambda self: None)
    tokens = torch.randint(1, 40, (2, 26))
    _, g_rev = _grads(model, tokens, None, True, 5)
    _, g_ref = _grads(plain, tokens, None, True, 5)
    assert any(not torch.allclose(g_rev[n], g_ref[n], atol=1e-10, rtol=1e-10) for n in g_ref)


def test_reversible_aux_losses_reach_the_loss():
    model, _plain = _reversible_pair("routing", tied=False, dropout=0.0)
    tokens = torch.randint(1, 40, (2, 26))
    with collect_aux_losses() as aux:
        model(tokens, causal=True)
    assert set(aux) == {"commitment"} and aux["commitment"].requires_grad
    assert aux.counts() == {"commitment": len(model.blocks)}


def test_tied_inversion_failure_is_reported():
    """The paper's unconstrained H (tied_lipschitz=None), far from a contraction: the backward says so."""
    model, _ = _reversible_pair("full", tied=True, dropout=0.0, tied_lipschitz=None)
    for h in model.reversible.tied:
        torch.nn.init.normal_(h.net[2].weight, std=5.0)  # far from a contraction
    y = model(torch.randint(1, 40, (1, 12)))
    with pytest.raises(RuntimeError, match="could not invert tied reversible block"):
        y.sum().backward()


def test_contractive_tied_connection_stays_invertible_with_large_weights():
    """With the default tied_lipschitz=0.5, H's Jacobian in x1 has spectral norm <= 0.5 whatever its weights (each
    token's Jacobian, by autograd, float64), H = 0 with scale 1 at initialisation, and the same large weights that
    break the paper's H leave the recomputing backward equal to ordinary backprop (1e-10)."""
    fresh = TiedConnection(6).double()
    assert fresh.scale() == 1.0 and bool((fresh(torch.randn(3, 6, dtype=torch.float64),
                                                torch.randn(3, 6, dtype=torch.float64)) == 0).all())
    g = torch.Generator().manual_seed(fixed_seed())
    h = TiedConnection(6).double()
    for layer in (h.net[0], h.net[2]):
        layer.weight.data = torch.randn(layer.weight.shape, generator=g, dtype=torch.float64) * 5.0
    x2 = torch.randn(6, dtype=torch.float64)
    for _ in range(8):
        x1 = torch.randn(6, generator=g, dtype=torch.float64) * 3.0
        jac = torch.autograd.functional.jacobian(lambda a: h(a, x2), x1)
        assert float(torch.linalg.matrix_norm(jac, 2)) <= 0.5 + 1e-12
    model, plain = _reversible_pair("full", tied=True, dropout=0.0)
    for block, twin in zip(model.reversible.tied, plain.reversible.tied, strict=True):
        torch.nn.init.normal_(block.net[2].weight, std=5.0)
        torch.nn.init.normal_(block.net[0].weight, std=2.0)
        twin.load_state_dict(block.state_dict())
    tokens = torch.randint(1, 40, (2, 14))
    y_rev, g_rev = _grads(model, tokens, None, False, 7)
    y_ref, g_ref = _grads(plain, tokens, None, False, 7)
    torch.testing.assert_close(y_rev, y_ref, atol=1e-12, rtol=0)
    for n in g_ref:
        torch.testing.assert_close(g_rev[n], g_ref[n], atol=1e-10, rtol=1e-10, msg=n)
    with pytest.raises(ValueError, match="lipschitz must be in"):
        TiedConnection(4, lipschitz=1.0)
    with pytest.raises(ValueError, match="tied_lipschitz must be < 1"):
        EncoderConfig(vocab_size=10, reversible=True, tied=True, tied_lipschitz=1.5)


def test_reversible_config_errors():
    with pytest.raises(ValueError, match="tied=True needs reversible=True"):
        EncoderConfig(vocab_size=10, tied=True)
    with pytest.raises(ValueError, match="centroid_flow"):
        EncoderConfig(vocab_size=10, attention="neural-clustering", centroid_flow=True, reversible=True)


def test_reversible_backward_publishes_once_and_keeps_no_graph():
    """The recompute in the backward publishes nothing (a collector open around forward and backward sees each
    block's losses once), and nothing the recompute builds outlives the backward on a module."""
    model, _ = _reversible_pair("neural-clustering", tied=False, dropout=0.0)
    with collect_aux_losses() as aux, record_groups() as groups:
        y = model(torch.randint(1, 40, (2, 26)))
        y.sum().backward()
    assert aux.counts() == {"clustering": len(model.blocks), "centroid_sorting": len(model.blocks)}
    assert set(groups) == {block.attn.inner for block in model.blocks}
    assert _tensors_with_graphs(model) == []


def _tensors_with_graphs(model) -> list[str]:
    """Names of non-parameter tensors held on modules (attributes, or inside dicts) that carry an autograd graph."""
    found = []
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            values = value.values() if isinstance(value, dict) else [value]
            if any(torch.is_tensor(v) and v.grad_fn is not None for v in values):
                found.append(f"{name}.{attr}")
    return found


@pytest.mark.parametrize("name", ALL)
def test_no_forward_output_is_stored_on_modules(name):
    """Auxiliary losses, groups and centroids of a forward go to collectors, never onto modules: after
    a training forward and backward, no module holds a tensor with an autograd graph."""
    layer = _small(name).train()
    x = torch.randn(2, 19, 16, dtype=torch.float64, requires_grad=True)
    y, aux, _ = run_recorded(layer, x)
    (y.sum() + sum(aux.values(), torch.zeros((), dtype=torch.float64))).backward()
    layer(x)  # and a forward without any collector open
    assert _tensors_with_graphs(layer) == []


@pytest.mark.parametrize("name", ALL)
def test_state_dicts_with_the_mechanism_state_on_the_layer_load(name):
    """State dicts that hold a mechanism's parameters, buffers and extra state on the layer itself (``centroids``,
    ``to_cluster.weight``, ``_extra_state``, as some checkpoints do) load into ``layer.inner``."""
    layer = _small(name).train()
    layer(torch.randn(2, 19, 16, dtype=torch.float64))  # some state: memory banks, pending EMA updates, generators
    old_style = {key.replace("inner.", "", 1): value for key, value in layer.state_dict().items()}
    assert any(not key.startswith(("to_qkv.", "to_out.")) for key in old_style) or name in ("full", "sliding-window")
    twin = _small(name)
    twin.load_state_dict(old_style)
    x = torch.randn(2, 23, 16, dtype=torch.float64)
    layer.eval()
    twin.eval()
    torch.testing.assert_close(twin(x), layer(x), rtol=0, atol=0)
