"""clusterformer's mechanisms through transformers' AttentionInterface (clusterformer.hf.interface).

A tiny randomly initialised Llama (grouped-query attention: 4 query / 2 key-value heads, float64, no download)
and a tiny BERT stand in for pretrained models. Prompts of different lengths are left-padded, as generate()
batches them."""

from __future__ import annotations

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
        out = model.generate(**batch, max_new_tokens=steps, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.logits, 1)


def _with(model, name):
    model.set_attn_implementation(name)
    return model


def test_registered_names_work_with_from_pretrained(tmp_path):
    names = hf.registered()
    assert {f"clusterformer-{m}" for m in hf.MECHANISMS} <= set(names)
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


def test_retrieval_index_follows_the_cache_and_is_rebuilt_for_a_new_prompt():
    model = _llama(layers=1)
    name = hf.register_attention("cluster-retrieval", name="test-index", budget=10, clusters=3, sink=1, window=2)
    _with(model, name)
    attention = model.model.layers[0].self_attn
    first = _prompts([30], fixed_seed())
    _generate(model, first, steps=3)
    index = attention.clusterformer_index
    # built at the first step (cache 31, window 2), then the window widens until JOIN_BATCH keys can join
    assert index.length == 32 and index.end == 29
    second = _prompts([40], fixed_seed())  # longer: its keys would extend the old index if it were not rebuilt
    _, logits = _generate(model, second, steps=3)
    assert attention.clusterformer_index.length == 42
    fresh = _llama(layers=1)
    _, want = _generate(_with(fresh, name), second, steps=3)
    torch.testing.assert_close(logits, want, rtol=0, atol=0)


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
    with pytest.raises(ValueError, match="bidirectional"):
        read_structure = read_mask(None, 5, 5, 1, False)
        hf.interface._retrieval(None, hf.interface.RetrievalOptions(), torch.zeros(1, 2, 5, 4),
                                torch.zeros(1, 1, 5, 4), torch.zeros(1, 1, 5, 4), read_structure, 0.5)
