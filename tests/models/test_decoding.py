"""Cached incremental decoding: feeding tokens one at a time through a mechanism's cache gives what one causal
forward over the whole sequence gives, for every strictly causal mechanism, across several chunk boundaries,
with prompts of different lengths in one batch; generation with and without the cache agree."""

from __future__ import annotations

import copy

import pytest
import torch

from causal_configs import STRICT_CAUSAL
from clusterformer.attention import build
from clusterformer.models import EncoderConfig
from clusterformer.models.lm import LanguageModel, sample_next
from clusterformer.ops.decode import GroupRingCache, MemberScoreCache, attend_allowed, merge_attention

STRICT = STRICT_CAUSAL  # small chunks and windows: 60-token sequences cross many chunk and window boundaries
IDS = [f"{name}-{i}" for i, (name, _) in enumerate(STRICT)]
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def _prompt_batch(x: torch.Tensor, prompt_lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The first prompt_lengths[b] rows of each sequence, right-padded with garbage (it must not matter)."""
    P = max(prompt_lengths)
    mask = torch.arange(P) >= torch.tensor(prompt_lengths).unsqueeze(1)
    return x[:, :P].masked_fill(mask.unsqueeze(-1), 7.0), mask


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("name", "options"), STRICT, ids=IDS)
def test_layer_steps_equal_the_causal_forward(name, options, dtype):
    seed = 1234
    torch.manual_seed(seed)
    _check_steps(build(name, dim=24, heads=3, **options).to(dtype).eval(), dtype, seed)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("summaries", [False, True])
def test_cluster_select_steps_with_a_balance_bias_equal_the_causal_forward(dtype, summaries):
    """Option ``balance``: the cache assigns each new key with the cluster biases the forward uses."""
    seed = 4321
    torch.manual_seed(seed)
    layer = build("cluster-select", dim=24, heads=3, num_clusters=4, select=2, cluster_keys=2, window=4,
                  summaries=summaries, balance=0.1).to(dtype).eval()
    layer.inner.balance_bias.copy_(torch.randn(3, 4))  # keys move between clusters (as the layer test asserts)
    _check_steps(layer, dtype, seed)


def _check_steps(layer, dtype, seed):
    """Prefill prompts of 1, 13 and 6 tokens (right-padded in one batch) and step to 61 tokens: every output equals
    the causal forward of each sequence alone."""
    B, N = 3, 61
    x = torch.randn(B, N, 24, dtype=dtype)
    prompt_lengths = [1, 13, 6]
    with torch.no_grad():
        # each sequence alone: no padding, no batch neighbours
        reference = torch.cat([layer(x[b:b + 1], causal=True) for b in range(B)])
        prompt, mask = _prompt_batch(x, prompt_lengths)
        y, cache = layer.prefill(prompt, mask)
        errors = [(y[b, :n] - reference[b, :n]).abs().max() for b, n in enumerate(prompt_lengths)]
        position = torch.tensor(prompt_lengths)
        for _ in range(N - min(prompt_lengths)):
            y_t, cache = layer.step(x[torch.arange(B), position.clamp(max=N - 1)], cache)
            errors += [(y_t[b] - reference[b, position[b]]).abs().max() for b in range(B) if position[b] < N]
            position = position + 1
    assert max(errors) <= TOLERANCE[dtype], f"seed {seed}: max |step - forward| = {max(errors):.3g}"
    assert cache.lengths.tolist() == [N - min(prompt_lengths) + n for n in prompt_lengths]


def test_a_wrong_window_is_caught():
    """The comparison above is sharp: a ring cache that lets a token see one chunk less fails it."""
    torch.manual_seed(0)
    layer = build("neural-clustering", dim=16, heads=2, causal_chunk_size=3, causal_clusters=2).double().eval()
    x = torch.randn(1, 30, 16, dtype=torch.float64)
    with torch.no_grad():
        reference = layer(x, causal=True)
        _, cache = layer.prefill(x[:, :1])
        cache.look_back = 0  # sabotage: the ring forgets the previous chunk
        errors = [(layer.step(x[:, t], cache)[0] - reference[:, t]).abs().max() for t in range(1, 30)]
    assert max(errors) > 1e-3


@pytest.mark.parametrize(("name", "options"), [STRICT[i] for i in (0, 1, 5, 9)], ids=[IDS[i] for i in (0, 1, 5, 9)])
@pytest.mark.parametrize("reversible", [False, True])
def test_language_model_steps_equal_its_forward(name, options, reversible):
    torch.manual_seed(5)
    config = EncoderConfig(vocab_size=13, dim=16, depth=2, heads=2, attention=name, attention_options=options,
                           reversible=reversible, positional="learned" if reversible else "sinusoidal", max_len=64)
    model = LanguageModel(config).double().eval()
    B, N = 3, 37
    tokens = torch.randint(1, 13, (B, N))
    lengths = torch.tensor([4, 11, 1])
    mask = torch.arange(11) >= lengths.unsqueeze(1)
    with torch.no_grad():
        reference = torch.cat([model(tokens[b:b + 1]) for b in range(B)])
        logits, cache = model.prefill(tokens[:, :11].masked_fill(mask, 0), mask)
        errors = [(logits[b, :n] - reference[b, :n]).abs().max() for b, n in enumerate(lengths.tolist())]
        for s in range(N - 11):
            step_logits, cache = model.step(tokens[torch.arange(B), lengths + s], cache)
            errors += [(step_logits[b] - reference[b, lengths[b] + s]).abs().max() for b in range(B)]
    assert max(errors) <= 1e-10


@pytest.mark.parametrize("name", ["full", "neural-clustering", "routing"])
def test_generation_with_and_without_the_cache_agree(name):
    torch.manual_seed(3)
    options = {"causal_chunk_size": 4, "causal_clusters": 3} if name == "neural-clustering" else {}
    if name == "routing":
        options = {"chunk_size": 4, "num_clusters": 3}
    model = LanguageModel(EncoderConfig(vocab_size=9, dim=16, depth=2, heads=2, attention=name,
                                        attention_options=options)).double().eval()
    prompt = torch.randint(1, 9, (3, 7))
    mask = torch.arange(7) >= torch.tensor([7, 2, 5]).unsqueeze(1)
    prompt = prompt.masked_fill(mask, 0)
    for sampling in ({"temperature": 0.0}, {"temperature": 0.9, "top_k": 5, "top_p": 0.8}):
        runs = [model.generate(prompt, mask, max_new_tokens=25, use_cache=cache,
                               generator=torch.Generator().manual_seed(11), **sampling) for cache in (True, False)]
        assert torch.equal(runs[0], runs[1]), sampling
        assert bool((runs[0] > 0).all())  # never the padding index


def test_generate_streams_and_checks_its_arguments():
    model = LanguageModel(EncoderConfig(vocab_size=9, dim=8, depth=1, heads=2)).eval()
    prompt = torch.tensor([[1, 2, 3]])
    seen = []
    out = model.generate(prompt, max_new_tokens=4, temperature=0, on_tokens=seen.append)
    assert torch.equal(torch.stack(seen, dim=1), out) and out.shape == (1, 4)
    with pytest.raises(ValueError, match="at least one real token"):
        model.generate(prompt, torch.tensor([[True, True, True]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(prompt, max_new_tokens=-1)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(prompt, max_new_tokens=2, temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        model.generate(prompt, max_new_tokens=2, top_p=1.5)
    with pytest.raises(ValueError, match="eval"):
        model.train().generate(prompt, max_new_tokens=2)


def test_sample_next_filters():
    logits = torch.log(torch.tensor([[0.0, 0.5, 0.3, 0.15, 0.05]]))
    logits[0, 0] = 10.0  # the padding index is never chosen, however likely
    g = torch.Generator().manual_seed(0)
    assert sample_next(logits, 0.0).item() == 1
    assert set(sample_next(logits.expand(400, 5), 1.0, top_k=2, generator=g).tolist()) == {1, 2}
    # nucleus 0.7: 0.5 alone does not reach it, 0.5 + 0.3 does: tokens 1 and 2 only
    assert set(sample_next(logits.expand(400, 5), 1.0, top_p=0.7, generator=g).tolist()) == {1, 2}
    assert set(sample_next(logits.expand(400, 5), 1.0, top_p=0.5, generator=g).tolist()) == {1}


def test_cluster_ring_memory_does_not_grow_with_the_context():
    layer = build("neural-clustering", dim=16, heads=2, causal_chunk_size=4, causal_clusters=3).eval()
    with torch.no_grad():
        sizes = [layer.prefill(torch.randn(1, n, 16))[1].memory_bytes() for n in (20, 400)]
        full = [build("full", dim=16, heads=2).eval().prefill(torch.randn(1, n, 16))[1].memory_bytes()
                for n in (20, 400)]
    assert sizes[0] == sizes[1]
    assert full[1] > 10 * full[0]


@pytest.mark.parametrize(("name", "options", "kind"), [
    ("neural-clustering", {"causal_chunk_size": 4, "causal_clusters": 3}, GroupRingCache),
    ("cluster-select", {"num_clusters": 3, "select": 2, "cluster_keys": 2, "window": 2, "summaries": False,
                        "members": "score"}, MemberScoreCache),  # nested caches: each reordered, lengths shared
])
def test_cache_select_reorders_sequences(name, options, kind):
    torch.manual_seed(2)
    layer = build(name, dim=16, heads=2, **options).double().eval()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    with torch.no_grad():
        _, cache = layer.prefill(x[:, :8])
        swapped = cache.select(torch.tensor([1, 0, 0]))
        assert isinstance(swapped, kind) and swapped.lengths.tolist() == [8, 8, 8]
        y, _ = layer.step(x[[1, 0, 0], 8], swapped)
        reference = layer(x, causal=True)[:, 8]
    torch.testing.assert_close(y, reference[[1, 0, 0]], rtol=0, atol=1e-12)


@pytest.mark.parametrize(("name", "options", "message"), [
    ("cluster-former", {}, "no cached decoding: its causal mode is 'paper'"),
    ("neural-clustering", {"causal_mode": "paper"}, "no cached decoding"),
    ("clustered", {}, "no cached decoding"),
])
def test_mechanisms_that_are_not_strictly_causal_refuse_to_decode(name, options, message):
    layer = build(name, dim=16, heads=2, **options).eval()
    with pytest.raises(ValueError, match=message):
        layer.prefill(torch.randn(1, 5, 16))


def test_decoding_refuses_training_mode_left_padding_and_foreign_caches():
    layer = build("full", dim=16, heads=2)
    with pytest.raises(ValueError, match="eval"):
        layer.prefill(torch.randn(1, 5, 16))
    layer.eval()
    with pytest.raises(ValueError, match="right padding"):
        layer.prefill(torch.randn(1, 3, 16), torch.tensor([[True, False, False]]))
    _, cache = layer.prefill(torch.randn(2, 3, 16))
    with pytest.raises(ValueError, match="x_t"):
        layer.step(torch.randn(2, 1, 16), cache)
    with pytest.raises(ValueError, match="cache"):
        layer.step(torch.randn(3, 16), cache)
    with pytest.raises(ValueError, match="cache"):
        layer.step(torch.randn(2, 16), None)


def test_one_softmax_over_two_key_sets_with_an_empty_row():
    """attend_allowed + merge_attention equal one masked softmax over the union of two disjoint key sets, also
    for a row whose first set is empty (a shared-QK token alone in its cluster, with local keys beside it: such
    a row must not give NaN)."""
    torch.manual_seed(7)
    q, keys, values = (torch.randn(3, 6, 4, dtype=torch.float64) for _ in range(3))
    q = q[:, 0]
    first = torch.tensor([[1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0]], dtype=torch.bool)
    second = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 1, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    out_a, lse_a = attend_allowed(q, keys, values, first, 0.5)
    out_b, lse_b = attend_allowed(q, keys, values, second, 0.5)
    assert torch.equal(out_a[1], torch.zeros(4, dtype=torch.float64)) and lse_a[1] == float("-inf")
    merged = merge_attention(out_a, lse_a, out_b, lse_b)
    scores = (keys @ q.unsqueeze(-1)).squeeze(-1) * 0.5
    weights = torch.softmax(scores.masked_fill(~(first | second), float("-inf")), dim=-1)
    torch.testing.assert_close(merged, (weights.unsqueeze(1) @ values).squeeze(1), rtol=1e-12, atol=1e-12)


# What a CUDA graph of a decoding step needs (bench decode --cuda-graph replays one): every tensor of the cache keeps
# its memory from step to step (updates in place), and the step reads nothing back to the host. Full's KV cache
# grows, so it is checked after ``reserve`` (a static cache). Not here: lsh and the random groupings (each step draws
# a number on the host from the layer's generator; in evaluation that number is the same every step, but this
# check cannot tell a host draw from a device read).
GRAPH_SAFE = [(name, options) for name, options in STRICT if name != "lsh" and options.get("grouping") != "random"]
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


def _cache_tensors(cache, path: str = "cache") -> list[tuple[str, int, tuple]]:
    """(field path, address, shape) of every tensor of a cache, nested caches included."""
    import dataclasses

    found = []
    for field in dataclasses.fields(cache):
        value = getattr(cache, field.name)
        if isinstance(value, torch.Tensor):
            found.append((f"{path}.{field.name}", value.data_ptr(), tuple(value.shape)))
        elif dataclasses.is_dataclass(value):
            found += _cache_tensors(value, f"{path}.{field.name}")
    return found


@pytest.mark.parametrize(("name", "options"), GRAPH_SAFE, ids=[f"{n}-{i}" for i, (n, _) in enumerate(GRAPH_SAFE)])
def test_a_decoding_step_updates_its_cache_in_place_without_host_reads(name, options, monkeypatch):
    torch.manual_seed(77)
    layer = build(name, dim=24, heads=3, **options).eval()
    with torch.no_grad():
        _, cache = layer.prefill(torch.randn(2, 90, 24))  # long enough that every ring is at its full size
        _, cache = layer.step(torch.randn(2, 24), cache)
        cache.reserve(4)
        before, lengths = _cache_tensors(cache), cache.lengths.clone()

        def refuse(self, *args, **kwargs):
            raise AssertionError("a decoding step read a tensor back to the host")

        with monkeypatch.context() as patch:
            for method in HOST_READS:
                patch.setattr(torch.Tensor, method, refuse)
            for _ in range(4):
                _, stepped = layer.step(torch.randn(2, 24), cache)
                assert stepped is cache
        assert _cache_tensors(cache) == before
        assert torch.equal(cache.lengths, lengths + 4)  # the steps did advance it, in place


def test_a_reserved_kv_cache_steps_as_the_growing_one():
    """Full attention's static cache (``reserve``, for CUDA graphs) gives the growing cache's outputs, over
    sequences of different lengths, and refuses a negative reservation."""
    torch.manual_seed(78)
    layer = build("full", dim=24, heads=3).eval().double()
    mask = torch.zeros(2, 21, dtype=torch.bool)
    mask[1, 13:] = True  # padding: the second prompt is 13 tokens
    tokens = torch.randn(40, 2, 24, dtype=torch.float64)
    with torch.no_grad():
        _, growing = layer.prefill(torch.randn(2, 21, 24, dtype=torch.float64), key_padding_mask=mask)
        static = copy.deepcopy(growing)
        static.reserve(40)
        assert static.keys.shape[2] == 21 + 40  # the longest sequence plus the reservation, not the doubled capacity
        for t in range(40):  # the growing cache doubles past 42 slots on the way
            expected, growing = layer.step(tokens[t], growing)
            out, static = layer.step(tokens[t], static)
            torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="tokens"):
        static.reserve(-1)
