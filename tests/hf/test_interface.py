"""clusterformer's mechanisms through transformers' AttentionInterface (clusterformer.hf.interface).

A tiny randomly initialised Llama (grouped-query attention: 4 query / 2 key-value heads, float64, no download)
and a tiny BERT stand in for pretrained models. Prompts of different lengths are left-padded, as generate()
batches them."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")

from clusterformer import hf  # noqa: E402
from clusterformer.hf.interface import read_mask  # noqa: E402
from seeds import fixed_seed  # noqa: E402


def _llama(impl: str = "sdpa", layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      initializer_range=0.2, attn_implementation=impl)
    return transformers.LlamaForCausalLM(config).double().eval()


def _prompts(lengths: list[int], seed: int) -> dict[str, torch.Tensor]:
    """Left-padded prompts (padding first), as the tokenizer prepares them for generation."""
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.randint(3, 97, (len(lengths), n), generator=g)
    mask = (torch.arange(n) >= n - torch.tensor(lengths)[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask}


def _generate(model, batch, steps=6):
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.logits, 1)


def _with(model, name):
    model.set_attn_implementation(name)
    return model


def test_registered_names_work_with_from_pretrained(tmp_path):
    names = hf.registered()
    # one list: the registry's mechanisms that say how to run on a model's own Q, K, V
    assert hf.interface_mechanisms() == ["cluster-retrieval", "clustered", "full", "improved-clustered", "oracle",
                                         "quest", "sink-window"]
    assert {f"clusterformer-{m}" for m in hf.interface_mechanisms()} <= set(names)
    name = hf.register_attention("cluster-retrieval", name="test-retrieval", budget=32, clusters=4, window=8)
    assert name == "test-retrieval"
    assert hf.registered()[name] == ("cluster-retrieval", {"budget": 32, "clusters": 4, "window": 8})
    _llama().save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=name).eval()
    assert model.config._attn_implementation == name
    batch = _prompts([40, 12], fixed_seed())
    _, got = _generate(model, batch)
    _, want = _generate(_llama(), batch)
    assert got.shape == want.shape and (got - want).abs().max() > 1e-6  # 32 of 40 keys: not dense


def test_full_prefill_and_decode_equal_sdpa_with_gqa_and_left_padding():
    model = _llama()
    batch = _prompts([17, 9, 30], fixed_seed())
    want_seq, want_logits = _generate(model, batch)
    seq, logits = _generate(_with(model, "clusterformer-full"), batch)
    assert torch.equal(seq, want_seq)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-10)


@pytest.mark.parametrize("mechanism,options", [
    ("cluster-retrieval", {"budget": 1.0, "clusters": 3}),
    ("sink-window", {"budget": 1.0}),
    ("clustered", {"causal": "dense"}),  # a decoding step has one query per head: exact
    ("improved-clustered", {"causal": "dense", "topk": 2}),
])
def test_covering_budgets_give_dense_generation(mechanism, options):
    model = _llama()
    batch = _prompts([21, 6, 40], fixed_seed())
    want_seq, want_logits = _generate(model, batch)
    name = hf.register_attention(mechanism, name=f"test-{mechanism}", **options)
    seq, logits = _generate(_with(model, name), batch)
    assert torch.equal(seq, want_seq)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-10)


def test_retrieval_general_path_is_dense_on_a_covered_sequence():
    """Budget 45 keys: the 60-token prompt retrieves (its outputs move), the 20-token one is covered by the
    retrieval path itself (sinks + window + every cluster whole) and stays dense to rounding."""
    model = _llama()
    batch = _prompts([60, 20], fixed_seed())
    _, want = _generate(model, batch)
    name = hf.register_attention("cluster-retrieval", name="test-partial", budget=45, clusters=4, sink=2, window=8)
    _, got = _generate(_with(model, name), batch)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-10)
    assert (got[0] - want[0]).abs().max() > 1e-6


def test_dense_layers_attend_densely():
    """dense_layers=2 in a 2-layer model: every layer dense, generation is dense; dense_layers=1: only layer 0."""
    model = _llama()
    batch = _prompts([60, 41], fixed_seed())
    _, want = _generate(model, batch)
    options = {"budget": 12, "clusters": 4, "sink": 2, "window": 4}
    _, both = _generate(_with(model, hf.register_attention("cluster-retrieval", name="test-d2", dense_layers=2,
                                                           **options)), batch)
    torch.testing.assert_close(both, want, rtol=0, atol=1e-10)
    _, first = _generate(_with(model, hf.register_attention("cluster-retrieval", name="test-d1", dense_layers=1,
                                                            **options)), batch)
    _, none = _generate(_with(model, hf.register_attention("cluster-retrieval", name="test-d0", **options)), batch)
    assert (first - want).abs().max() > 1e-6 and (first - none).abs().max() > 1e-6


def test_cached_generation_equals_uncached_generation():
    model = _llama()
    batch = _prompts([12, 25], fixed_seed())
    for name in ("clusterformer-full", hf.register_attention("improved-clustered", name="test-ic", causal="dense")):
        _with(model, name)
        with torch.no_grad():
            cached = model.generate(**batch, max_new_tokens=7, do_sample=False, pad_token_id=0)
            uncached = model.generate(**batch, max_new_tokens=7, do_sample=False, pad_token_id=0, use_cache=False)
        assert torch.equal(cached, uncached)


def test_retrieval_is_batch_invariant_and_never_reads_a_future_key():
    model = _llama()
    name = hf.register_attention("cluster-retrieval", name="test-small", budget=0.25, clusters=4, sink=2, window=4,
                                 refresh=5, estimate_remainder=True)
    _with(model, name)
    batch = _prompts([50, 33], fixed_seed())
    _, together = _generate(model, batch, steps=8)
    alone = {key: value[1:, 17:] for key, value in batch.items()}
    _, single = _generate(model, alone, steps=8)
    torch.testing.assert_close(single[0], together[1], rtol=0, atol=1e-10)
    _, dense = _generate(_with(_llama(), "sdpa"), batch, steps=8)
    assert (together - dense).abs().max() > 1e-6  # retrieval is on: 13 of 50 keys

    # A chunk of 3 tokens fed with a cache: changing the third leaves the first two unchanged.
    ids = batch["input_ids"][:1]
    outs = []
    for last in (5, 6):
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids[:, :40], past_key_values=cache)
            chunk = torch.cat([ids[:, 40:42], torch.tensor([[last]])], 1)
            outs.append(model(input_ids=chunk, past_key_values=cache).logits)
    assert torch.equal(outs[0][:, :2], outs[1][:, :2])
    assert not torch.equal(outs[0][:, 2], outs[1][:, 2])


@pytest.mark.parametrize(("mechanism", "options"), [("oracle", {}), ("quest", {"page_size": 4})])
def test_oracle_and_quest_in_a_decoder_are_batch_invariant_and_covering_budgets_are_dense(mechanism, options):
    """The two yardsticks (oracle, Quest) run in generate() through the interface: a left-padded sequence beside a
    longer one gives the same logits as alone, a budget of 25% changes them, and a budget covering the cache is
    dense attention."""
    model = _llama()
    batch = _prompts([50, 33], fixed_seed())
    _with(model, hf.register_attention(mechanism, name=f"test-{mechanism}", budget=0.25, **options))
    _, together = _generate(model, batch, steps=5)
    _, single = _generate(model, {key: value[1:, 17:] for key, value in batch.items()}, steps=5)
    torch.testing.assert_close(single[0], together[1], rtol=0, atol=1e-10)
    _, dense = _generate(_with(_llama(), "sdpa"), batch, steps=5)
    assert (together - dense).abs().max() > 1e-6  # the budget bites
    _with(model, hf.register_attention(mechanism, name=f"test-{mechanism}-all", budget=1.0, **options))
    torch.testing.assert_close(_generate(model, batch, steps=5)[1], dense, rtol=0, atol=1e-10)


def _index_of(cache):
    """The key index clusterformer keeps with ``cache`` (one registered name, one layer)."""
    (index,) = hf.cache_state(cache).values()
    return index


def test_retrieval_index_lives_with_the_cache_and_follows_it():
    model = _llama(layers=1)
    name = hf.register_attention("cluster-retrieval", name="test-index", budget=10, clusters=3, sink=1, window=2)
    _with(model, name)
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model.generate(**_prompts([30], fixed_seed()), max_new_tokens=3, do_sample=False, pad_token_id=0,
                       past_key_values=cache)
    index = _index_of(cache)
    # built at the first step (cache 31, window 2), then the window widens until JOIN_BATCH keys can join
    assert index.length == 32 and index.end == 29
    assert not any("clusterformer" in key for key in vars(model.model.layers[0].self_attn))  # nothing on the module
    second = _prompts([40], fixed_seed())  # a new prompt, a new cache: a new index
    _, logits = _generate(model, second, steps=3)
    fresh = _llama(layers=1)
    _, want = _generate(_with(fresh, name), second, steps=3)
    torch.testing.assert_close(logits, want, rtol=0, atol=0)
    reference = weakref.ref(cache)
    del cache
    gc.collect()
    assert reference() is None  # nothing of clusterformer's keeps the cache alive: its index went with it


def test_two_prompts_two_option_sets_and_two_models_interleaved_keep_their_own_indexes():
    """Step by step, alternating between (model, options, prompt) runs that share a process: each gives what it
    gives alone. Two option sets on one model (the same modules) must not share an index."""
    models = [_llama(), _llama(), _llama(layers=1)]
    names = [hf.register_attention("cluster-retrieval", name=f"test-interleave-{c}", budget=12, clusters=c, sink=1,
                                   window=2) for c in (2, 5)]
    runs = [(models[0], names[0], _prompts([33], fixed_seed())), (models[0], names[1], _prompts([33], fixed_seed())),
            (models[1], names[1], _prompts([41], fixed_seed() + 1)), (models[2], names[0], _prompts([37], 3))]

    def steps(run_indices, count=20):
        caches, ids, logits = {}, {}, {i: [] for i in run_indices}
        for step in range(count):
            for i in run_indices:
                model, name, batch = runs[i]
                model.set_attn_implementation(name)
                if step == 0:
                    caches[i] = transformers.DynamicCache(config=model.config)
                    ids[i] = batch["input_ids"]
                with torch.no_grad():
                    out = model(input_ids=ids[i], past_key_values=caches[i]).logits[:, -1]
                logits[i].append(out)
                ids[i] = out.argmax(-1, keepdim=True)
        return {i: torch.stack(v) for i, v in logits.items()}

    together = steps(range(len(runs)))
    for i in range(len(runs)):
        torch.testing.assert_close(together[i], steps([i])[i], rtol=0, atol=0)
    assert (together[0] - together[1]).abs().max() > 1e-6  # the option sets differ: their indexes too


def test_one_cache_read_under_two_option_sets_keeps_an_index_per_option_set():
    """A cache filled under one option set and read on under another gets an index built for the second: what a
    fresh cache holding the same keys gives (one layer: the keys depend on the tokens alone)."""
    model = _llama(layers=1)
    first, second = (hf.register_attention("cluster-retrieval", name=f"test-switch-{c}", budget=12, clusters=c,
                                           sink=1, window=2) for c in (2, 5))
    ids = _prompts([45], fixed_seed())["input_ids"]

    def feed(cache, start, stop, name):
        model.set_attn_implementation(name)
        with torch.no_grad():
            return [model(input_ids=ids[:, t:t + 1], past_key_values=cache).logits for t in range(start, stop)]

    switched = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :30], past_key_values=switched)
    feed(switched, 30, 36, first)
    fresh = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :36], past_key_values=fresh)  # a dense prefill: the same keys
    got, want = feed(switched, 36, 40, second), feed(fresh, 36, 40, second)
    torch.testing.assert_close(torch.cat(got), torch.cat(want), rtol=0, atol=0)
    assert len(hf.cache_state(switched)) == 2  # one index per option set


def test_bert_encoder_through_the_interface_matches_patch():
    """One mechanism, two routes: attn_implementation on an unmodified BERT, and hf.patch's modules."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, initializer_range=0.3)
    model = transformers.BertModel(config).double().eval()
    g = torch.Generator().manual_seed(fixed_seed())
    ids = torch.randint(3, 60, (3, 19), generator=g)
    mask = (torch.arange(19) < torch.tensor([19, 11, 4])[:, None]).long()
    with torch.no_grad():
        dense = model(input_ids=ids, attention_mask=mask).last_hidden_state * mask.unsqueeze(-1)
        name = hf.register_attention("improved-clustered", name="test-bert-ic", num_clusters=3, topk=4, seed=7)
        model.set_attn_implementation(name)
        via_interface = model(input_ids=ids, attention_mask=mask).last_hidden_state * mask.unsqueeze(-1)
        model.set_attn_implementation("sdpa")
        hf.patch(model, "improved-clustered", num_clusters=3, topk=4, seed=7)
        via_patch = model(input_ids=ids, attention_mask=mask).last_hidden_state * mask.unsqueeze(-1)
        hf.unpatch(model)
        model.set_attn_implementation(hf.register_attention("improved-clustered", name="test-bert-exact", topk=100))
        exact = model(input_ids=ids, attention_mask=mask).last_hidden_state * mask.unsqueeze(-1)
    assert (via_interface - dense).abs().max() > 1e-4  # top-4 of 19 keys: an approximation
    torch.testing.assert_close(exact, dense, rtol=0, atol=1e-10)
    # both routes seed each layer's hash planes with layer_seed(seed, layer): the same computation
    torch.testing.assert_close(via_interface, via_patch, rtol=0, atol=1e-10)


def test_the_mechanism_follows_the_model_between_train_and_eval():
    """improved-clustered draws new hash planes at every training forward and reuses its seeded ones in evaluation:
    through the interface, eval -> train -> eval -> train moves its inner attention with the model each time."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=64, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    model = transformers.BertModel(config).double()
    model.set_attn_implementation(hf.register_attention("improved-clustered", name="test-modes", num_clusters=3,
                                                        topk=4, seed=7))
    ids = torch.randint(3, 60, (2, 19), generator=torch.Generator().manual_seed(fixed_seed()))

    def twice():
        with torch.no_grad():
            return [model(input_ids=ids).last_hidden_state for _ in range(2)]

    for _ in range(2):
        model.eval()
        first, second = twice()
        torch.testing.assert_close(first, second, rtol=0, atol=0)  # eval: the seeded planes
        model.train()
        first, second = twice()
        assert (first - second).abs().max() > 1e-6  # training: fresh planes per forward


def test_full_honours_any_mask_the_model_builds():
    """'full' passes the model's own mask to SDPA, whatever its pattern (here a sliding window of 3 with a padded
    key), with zeros for a query without keys: what no other mechanism can honour."""
    function = transformers.AttentionInterface()["clusterformer-full"]
    g = torch.Generator().manual_seed(fixed_seed())
    q, k, v = (torch.randn(1, 4, 6, 8, generator=g, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(6)
    allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - 3) & (pos != 1)[None, :]
    allowed[1] = False  # a query with no key at all
    got, _ = function(torch.nn.Module(), q, k, v, allowed[None, None], scaling=0.3)
    logits = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~allowed, float("-inf"))
    want = torch.nan_to_num(torch.softmax(logits, -1)) @ v
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=0, atol=1e-12)


def test_what_cannot_be_honoured_is_refused():
    model = _llama()
    batch = _prompts([8, 5], fixed_seed())
    _with(model, "clusterformer-improved-clustered")
    with pytest.raises(ValueError, match="causal='dense'"), torch.no_grad():
        model(**batch)
    allowed = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    allowed[0, 0, 3, 0] = False  # a sliding window of 3
    with pytest.raises(ValueError, match="only the 'full' mechanism"):
        read_mask(allowed, 4, 4, 1, True)
    assert read_mask(torch.ones(1, 1, 4, 4, dtype=torch.bool).tril(), 4, 4, 1, True).causal
    for bad, match in (({"budget": 2.0}, "budget"), ({"clustres": 3}, "clustres"), ({"topk": 3}, "topk"),
                       ({"causal": "dense"}, "causal")):
        with pytest.raises(ValueError, match=match):
            hf.register_attention("cluster-retrieval", name="test-bad", **bad)
    with pytest.raises(ValueError, match="mechanism"):
        hf.register_attention("neural-clustering")
    with pytest.raises(ValueError, match="name"):
        hf.register_attention("full", name="a/b")
    function = transformers.AttentionInterface()["clusterformer-cluster-retrieval"]
    with pytest.raises(ValueError, match="bidirectional"):
        function(torch.nn.Module(), torch.zeros(1, 2, 5, 4), torch.zeros(1, 1, 5, 4), torch.zeros(1, 1, 5, 4), None,
                 is_causal=False)
    with pytest.raises(ValueError, match="cannot be set for 'cluster-retrieval' in a pretrained model"):
        hf.register_attention("cluster-retrieval", name="test-bad", dropout=0.1)


# The sparse prefill (option prefill_block): the prompt's own attention read block by block
# under the budget.

PREFILL_MECHANISMS = [("cluster-retrieval", {"clusters": 4, "sink": 2, "window": 4}), ("sink-window", {"sink": 2}),
                      ("oracle", {}), ("quest", {"page_size": 4})]


def _prefill_logits(model, batch):
    """The prompt's logits, positions counted from each sequence's first real token (as generate() counts them:
    the keys, rotated by position, are then the same alone and left-padded)."""
    mask = batch.get("attention_mask", torch.ones_like(batch["input_ids"]))
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(**batch, position_ids=positions, cache=transformers.DynamicCache(config=model.config)
                     ).logits


@pytest.mark.parametrize(("mechanism", "options"), PREFILL_MECHANISMS)
def test_sparse_prefill_is_batch_invariant_causal_and_dense_when_covered(mechanism, options):
    """Prompts of 70 and 45 tokens (left-padded together): the shorter one's prefill logits are the same alone;
    a token changed at position 50 leaves every earlier position's logits unchanged; the budget bites (the logits
    move from dense's), and a covering budget is dense attention exactly."""
    model = _llama()
    batch = _prompts([70, 45], fixed_seed())
    dense = _prefill_logits(model, batch)
    _with(model, hf.register_attention(mechanism, name=f"test-prefill-{mechanism}", budget=0.2, prefill_block=8,
                                       **options))
    together = _prefill_logits(model, batch)
    alone = _prefill_logits(model, {key: value[1:, 25:] for key, value in batch.items()})
    torch.testing.assert_close(alone[0], together[1, 25:], rtol=0, atol=1e-10)
    assert (together - dense)[batch["attention_mask"].bool()].abs().max() > 1e-6  # the budget bites
    assert torch.equal(together[:, :8], _prefill_logits(model, {k: v[:, :8] for k, v in batch.items()}))
    changed = {key: value[:1].clone() for key, value in batch.items()}
    changed["input_ids"][0, 50] = 3 if changed["input_ids"][0, 50] != 3 else 4
    moved = _prefill_logits(model, changed)
    torch.testing.assert_close(moved[0, :50], together[0, :50], rtol=0, atol=0)
    assert not torch.allclose(moved[0, 50:], together[0, 50:])
    _with(model, hf.register_attention(mechanism, name=f"test-prefill-{mechanism}-all", budget=1.0, prefill_block=8,
                                       **options))
    torch.testing.assert_close(_prefill_logits(model, batch), dense, rtol=0, atol=1e-10)


@pytest.mark.parametrize(("mechanism", "options"), PREFILL_MECHANISMS)
def test_prefill_budget_reads_the_prefill_by_its_own_budget_and_decoding_by_budget(mechanism, options):
    """prefill_budget covering every key: the prefill is dense attention exactly, though budget bites; a cached
    call (decoding) reads by budget, as without prefill_budget."""
    from clusterformer.attention.registry import build_inner
    from clusterformer.masks import AttentionMask

    model = _llama()
    batch = _prompts([70, 45], fixed_seed())
    dense = _prefill_logits(model, batch)
    _with(model, hf.register_attention(mechanism, name=f"test-prefill-budget-{mechanism}", budget=0.2,
                                       prefill_block=8, prefill_budget=1.0, **options))
    torch.testing.assert_close(_prefill_logits(model, batch), dense, rtol=0, atol=1e-10)
    g = torch.Generator().manual_seed(fixed_seed())
    q, k, v = (torch.randn(1, h, n, 8, generator=g, dtype=torch.float64) for h, n in ((4, 3), (2, 90), (2, 90)))
    step = [build_inner(mechanism, dim=32, heads=4, budget=0.2, prefill_block=8, **extra, **options).attend_cache(
        q, k, v, AttentionMask(None, causal=True), 0.3)[0] for extra in ({}, {"prefill_budget": 1.0})]
    torch.testing.assert_close(step[1], step[0], rtol=0, atol=0)
    covering = build_inner(mechanism, dim=32, heads=4, budget=1.0, **options).attend_cache(
        q, k, v, AttentionMask(None, causal=True), 0.3)[0]
    assert (step[1] - covering).abs().max() > 1e-6  # the decoding budget bites
    # the other way round: a sparse prefill before dense decoding
    sparse_prefill = build_inner(mechanism, dim=32, heads=4, budget=1.0, prefill_block=8, prefill_budget=0.2,
                                 **options)
    torch.testing.assert_close(sparse_prefill.attend_cache(q, k, v, AttentionMask(None, causal=True), 0.3)[0],
                               covering, rtol=0, atol=0)
    _with(model, hf.register_attention(mechanism, name=f"test-prefill-budget-{mechanism}-dense-decoding",
                                       budget=1.0, prefill_block=8, prefill_budget=0.2, **options))
    assert (_prefill_logits(model, batch) - dense)[batch["attention_mask"].bool()].abs().max() > 1e-6


@pytest.mark.parametrize("bad", [0.0, 1.5, 0, True, "all"])
def test_prefill_budget_is_checked(bad):
    from clusterformer.attention.registry import make_options

    with pytest.raises(ValueError, match="prefill_budget"):
        make_options("cluster-retrieval", {"prefill_block": 8, "prefill_budget": bad})
    with pytest.raises(ValueError, match=r"prefill_budget .*prefill_block"):
        make_options("sink-window", {"prefill_budget": 0.5})


@pytest.mark.parametrize(("mechanism", "options"), PREFILL_MECHANISMS[1:])
def test_sparse_prefill_is_the_prompt_fed_in_blocks_through_the_cache(mechanism, options):
    """Without an index to carry, a sparse prefill in blocks of 8 is the prompt fed to the model 8 tokens at a time
    over its growing cache (the cached path, which generate() uses), to rounding."""
    model = _llama()
    ids = _prompts([61], fixed_seed())["input_ids"]
    name = hf.register_attention(mechanism, name=f"test-blocks-{mechanism}", budget=0.2, **options)
    _with(model, name)
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        fed = torch.cat([model(input_ids=ids[:, s:s + 8], cache=cache).logits for s in range(0, 61, 8)], 1)
    _with(model, hf.register_attention(mechanism, name=f"test-blocks-{mechanism}-p", budget=0.2, prefill_block=8,
                                       **options))
    torch.testing.assert_close(_prefill_logits(model, {"input_ids": ids}), fed, rtol=0, atol=1e-10)


@pytest.mark.parametrize(("mechanism", "options"), PREFILL_MECHANISMS)
@pytest.mark.parametrize(("budget", "prefill_budget"), [(0.15, None), (6, None), (2, 0.15), (0.05, 6)])
def test_sparse_prefill_reads_at_most_the_budget(mechanism, options, budget, prefill_budget):
    """Values one-hot per position (a query's output is its weight on every key): past the first block, a query
    of the block ending at e reads at most the prefill's budget (``prefill_budget``, else ``budget``) of a cache
    of e real keys of its sequence, and some query reads more than ``budget`` where that is the smaller; the
    first block is dense (at most its P keys); no padding key is read."""
    from clusterformer.attention.registry import build_inner
    from clusterformer.masks import AttentionMask
    from clusterformer.ops.retrieval import keys_allowed

    P, n, H, D = 8, 53, 4, 8
    g = torch.Generator().manual_seed(fixed_seed())
    q = torch.randn(2, H, n, D, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, n, D, generator=g, dtype=torch.float64)
    v = torch.eye(n, dtype=torch.float64).expand(2, 2, n, n)
    padding = torch.zeros(2, n, dtype=torch.bool)
    padding[1, :11] = True
    inner = build_inner(mechanism, dim=H * D, heads=H, budget=budget, prefill_block=P, prefill_budget=prefill_budget,
                        **options)
    out, _ = inner.attend_cache(q, k, v, AttentionMask(padding, causal=True), 0.4)
    read = (out > 0).sum(-1)  # (B, H, n): keys read per query
    assert bool((out.masked_fill(~padding.view(2, 1, 1, n), 0) == 0).all())  # no padding key
    prefill = budget if prefill_budget is None else prefill_budget
    for b, pad in enumerate((0, 11)):
        ranks = torch.arange(n - pad)  # the sequence's own positions (its real tokens, in order)
        block_end = torch.minimum((ranks // P + 1) * P, torch.tensor(n - pad))
        allowed = torch.where(ranks < P, torch.tensor(P), keys_allowed(prefill, block_end))
        assert bool((read[b, :, pad:] <= allowed).all()), (b, read[b, :, pad:], allowed)
        if prefill_budget is not None and bool((keys_allowed(budget, block_end) < allowed).any()):
            assert bool((read[b, :, pad:][..., P:] > keys_allowed(budget, block_end)[P:]).any())
        assert bool((read[b, :, pad:][..., P:] < ranks[P:] + 1).any())  # past the first block, fewer than causal


def test_a_runner_made_after_a_freed_one_never_reads_its_index(monkeypatch):
    """Registering a name again frees its old runner, and CPython may give a runner made later the freed one's
    address, hence its ``id()`` (seen after 22 registrations). The index a cache keeps belongs to the runner and
    the module themselves, not to their ids: a new runner reading the cache builds its own index for its own
    options -- what a fresh cache holding the same keys gives. The reuse is forced here: every ``id()`` the
    interface could take is 0, as if each new runner sat where the freed one sat."""
    from clusterformer.hf import interface

    monkeypatch.setattr(interface, "id", lambda obj: 0, raising=False)
    model = _llama(layers=1)
    ids = _prompts([45], fixed_seed())["input_ids"]

    def feed(cache, start, stop, name):
        model.set_attn_implementation(name)
        with torch.no_grad():
            return torch.cat([model(input_ids=ids[:, t:t + 1], past_key_values=cache).logits
                              for t in range(start, stop)])

    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :30], past_key_values=cache)
    name = hf.register_attention("cluster-retrieval", name="test-reused", budget=12, clusters=2, sink=1, window=2)
    feed(cache, 30, 36, name)
    freed = weakref.ref(transformers.AttentionInterface()[name])
    name = hf.register_attention("cluster-retrieval", name="test-reused", budget=12, clusters=7, sink=3, window=2)
    gc.collect()
    assert freed() is None  # the first runner's function is gone, and the runner with it
    fresh = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :36], past_key_values=fresh)  # a dense prefill: the same keys
    torch.testing.assert_close(feed(cache, 36, 40, name), feed(fresh, 36, 40, name), rtol=0, atol=0)


def test_an_index_built_under_other_options_is_rebuilt():
    """The index records the options it was clustered under: handed to a reader with other options (another number
    of clusters, other sinks), it is not extended or read but rebuilt -- the reader's output is what it gives with
    no index at all; and under its own options it is kept."""
    from clusterformer.attention.registry import build_inner
    from clusterformer.masks import AttentionMask
    from clusterformer.ops.retrieval import build_index, extend_index

    g = torch.Generator().manual_seed(fixed_seed())
    q, k, v = (torch.randn(1, h, n, 8, generator=g, dtype=torch.float64) for h, n in ((4, 1), (2, 90), (2, 90)))
    mask = AttentionMask(None, causal=True)
    old, new = (build_inner("cluster-retrieval", dim=32, heads=4, budget=20, num_clusters=c, sink=s, window=4)
                for c, s in ((2, 1), (7, 3)))
    _, index = old.attend_cache(q, k, v, mask, 0.3)
    assert index.options == old.options and index.follows(k, old.options) and not index.follows(k, new.options)
    got, rebuilt = new.attend_cache(q, k, v, mask, 0.3, index)
    want, _ = new.attend_cache(q, k, v, mask, 0.3)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert rebuilt is not index and rebuilt.options == new.options and rebuilt.counts.shape[1] == 7
    assert old.attend_cache(q, k, v, mask, 0.3, index)[1] is index  # its own reader keeps it
    assert extend_index(index, k, v, None, 86, new.options).counts.shape[1] == 7
    assert build_index(k, v, None, 80, new.options).options is new.options


def _leftovers(module):
    """Whatever of clusterformer's an attention module carries: hooks of any kind, attributes."""
    hooks = {name: dict(getattr(module, name)) for name in ("_forward_hooks", "_forward_pre_hooks",
                                                            "_forward_hooks_with_kwargs",
                                                            "_forward_pre_hooks_with_kwargs",
                                                            "_forward_hooks_always_called", "_backward_hooks",
                                                            "_backward_pre_hooks")}
    attributes = [key for key in vars(module) if "clusterformer" in key]
    return {name: hooks for name, hooks in hooks.items() if hooks}, attributes


def test_the_interface_leaves_nothing_on_the_model_or_its_masks():
    """Cached generation under every cache-reading mechanism, then back to sdpa: no attention module carries a hook
    or an attribute of clusterformer's (the call's cache is read from its forward, not passed by a hook), nor does
    the mask a call reads; a patched then unpatched encoder is left as it was."""
    model = _llama()
    modules = [layer.self_attn for layer in model.model.layers]
    before = [_leftovers(module) for module in modules]
    batch = _prompts([30, 21], fixed_seed())
    for mechanism in ("cluster-retrieval", "sink-window", "oracle", "quest", "improved-clustered"):
        options = {"causal": "dense"} if mechanism == "improved-clustered" else {"budget": 8}
        _generate(_with(model, hf.register_attention(mechanism, name=f"test-leave-{mechanism}", **options)), batch,
                  steps=3)
    assert [_leftovers(module) for module in modules] == before == [({}, [])] * len(modules)
    _with(model, "sdpa")
    assert [_leftovers(module) for module in modules] == before
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    function = transformers.AttentionInterface()["clusterformer-cluster-retrieval"]
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    function(modules[0], q, k, v, mask)
    assert vars(mask) == {}

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64)
    bert = transformers.BertModel(config).eval()
    state = dict(vars(bert))
    hf.patch(bert, "clustered", clusters=2)
    with torch.no_grad():
        bert(input_ids=torch.randint(3, 60, (2, 9)), attention_mask=torch.ones(2, 9, dtype=torch.long))
    hf.unpatch(bert)
    assert dict(vars(bert)) == state
    assert all(_leftovers(m) == ({}, []) for m in bert.modules())


def test_threads_sharing_one_model_each_read_their_own_cache():
    """Two threads share one model, each generating from its own prompt with its own cache, their attention calls
    interleaved (both inside the same attention module before either computes): each gets what it gets alone. A
    call's cache is its own (the calling thread's forward holds it), never the last one some thread set."""
    import threading

    model = _llama(layers=1)
    name = hf.register_attention("cluster-retrieval", name="test-threads", budget=12, clusters=3, sink=1, window=2)
    _with(model, name)
    prompts = [_prompts([40], fixed_seed())["input_ids"], _prompts([33], fixed_seed())["input_ids"]]

    def run(ids, results, index):
        cache = transformers.DynamicCache(config=model.config)
        logits = []
        with torch.no_grad():
            for _ in range(12):
                out = model(input_ids=ids, past_key_values=cache).logits[:, -1]
                logits.append(out)
                ids = out.argmax(-1, keepdim=True)
        results[index] = torch.stack(logits)

    alone: dict[int, torch.Tensor] = {}
    for i, ids in enumerate(prompts):
        run(ids, alone, i)
    meeting = threading.Barrier(2, timeout=60)

    def meet(module, args):  # both threads enter the attention module before either goes on
        meeting.wait()

    handle = model.model.layers[0].self_attn.register_forward_pre_hook(meet)
    together: dict[int, torch.Tensor] = {}
    errors = []

    def thread_run(i):
        try:
            run(prompts[i], together, i)
        except Exception as error:  # reported below
            errors.append(error)
            meeting.abort()

    threads = [threading.Thread(target=thread_run, args=(i,)) for i in range(2)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        handle.remove()
    assert not errors, errors
    for i in range(2):
        torch.testing.assert_close(together[i], alone[i], rtol=0, atol=1e-12)
