"""Masked-language-model pretraining (``train --task mlm``) and fine-tuning from its checkpoint (``--init PATH``)."""

from __future__ import annotations

import json

import pytest
import torch

from clusterformer.data.recall import IGNORE
from clusterformer.data.tokenize import ByteTokenizer, MLMSpecials
from clusterformer.train import TrainConfig, run_training
from clusterformer.train.loop import load_trained
from clusterformer.train.mlm import MaskedLMTask, MLMOptions, mask_tokens, mlm_options
from seeds import fixed_seed
from shared_data import SHARED, needs_data

SPECIALS = MLMSpecials(mask=3, cls=4, sep=2, vocab_size=50)


def _ids(seed: int, n: int = 400, length: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 50, (n, length), generator=g)
    ids[:, 0] = SPECIALS.cls
    ids[:, 30] = SPECIALS.sep
    ids[:3, -10:] = 0  # padding
    return ids


def test_bert_masking_rates_and_rules():
    """15% of the ordinary tokens selected; of those 80% [MASK], 10% a random ordinary token, 10% kept; never
    [PAD], [CLS], [SEP] or a protected position; targets the original token where selected, IGNORE elsewhere."""
    ids = _ids(fixed_seed())
    protected = torch.zeros_like(ids, dtype=torch.bool)
    protected[:, 5] = True
    seed = fixed_seed()
    inputs, targets = mask_tokens(ids, SPECIALS, 0.15, torch.Generator().manual_seed(seed), protected)
    selected = targets != IGNORE
    ordinary = (ids != 0) & (ids != SPECIALS.cls) & (ids != SPECIALS.sep) & ~protected
    assert not (selected & ~ordinary).any()
    assert torch.equal(targets[selected], ids[selected])
    assert torch.equal(inputs[~selected], ids[~selected])
    share = selected.sum() / ordinary.sum()
    assert 0.14 < share < 0.16, share
    as_mask = (inputs == SPECIALS.mask) & selected
    changed = (inputs != ids) & ~as_mask & selected
    kept = (inputs == ids) & selected
    n = int(selected.sum())
    assert abs(as_mask.sum() / n - 0.8) < 0.02 and abs(changed.sum() / n - 0.1) < 0.015
    assert abs((kept.sum() + changed.sum()) / n - 0.2) < 0.02  # a random draw equal to the token counts as kept
    replaced = inputs[changed]
    assert ((replaced >= 1) & (replaced != SPECIALS.mask) & (replaced != SPECIALS.cls)
            & (replaced != SPECIALS.sep)).all()
    assert len(torch.unique(replaced)) > 30  # spread over the vocabulary, not one id
    again = mask_tokens(ids, SPECIALS, 0.15, torch.Generator().manual_seed(seed), protected)
    assert torch.equal(again[0], inputs) and torch.equal(again[1], targets)  # a function of the seed


def _task(nsp: bool, stream_len: int = 3000, max_len: int = 33) -> MaskedLMTask:
    g = torch.Generator().manual_seed(fixed_seed())
    stream = torch.randint(5, 50, (stream_len,), generator=g)
    return MaskedLMTask("mlm", stream, {"imdb": stream[:500]}, SPECIALS, MLMOptions(nsp=nsp), "t", max_len)


def _original(batch) -> torch.Tensor:
    return torch.where(batch.targets != IGNORE, batch.targets, batch.ids)


def test_next_sentence_pairs_follow_the_stream_when_labelled_so():
    """[CLS] A [SEP] B: with label 1, A and B are consecutive in the stream; with label 0 B starts elsewhere. Read
    back independently: A located in the stream by search, then the tokens after it compared with B."""
    task = _task(nsp=True)
    batch = task.batch(3, 10, 64, 0, 1, fixed_seed())
    labels = batch.targets[:, 0]
    original = _original(batch)
    original[:, 0] = SPECIALS.cls
    half = (task.max_len - 2) // 2
    assert (original[:, 0] == SPECIALS.cls).all() and (original[:, 1 + half] == SPECIALS.sep).all()
    stream = task.train_stream
    windows = stream.unfold(0, half, 1)  # every window of the stream: the search
    assert 0.3 < labels.float().mean() < 0.7
    for row, label in zip(original, labels.tolist(), strict=True):  # per sequence of a test, not a hot path
        a, b = row[1:1 + half], row[2 + half:]
        start = int((windows == a).all(1).nonzero()[0])
        follows = torch.equal(stream[start + half:start + 2 * half], b)
        assert follows == bool(label)


def test_batches_are_reproducible_and_ranks_split_the_global_batch():
    task = _task(nsp=False)
    one = task.batch(7, 10, 8, 0, 1, 5)
    assert torch.equal(one.ids, task.batch(7, 10, 8, 0, 1, 5).ids)  # a resumed run draws the same
    assert not torch.equal(one.ids, task.batch(8, 10, 8, 0, 1, 5).ids)
    ranks = [task.batch(7, 10, 4, r, 2, 5) for r in range(2)]
    assert torch.equal(torch.cat([b.ids for b in ranks]), one.ids)
    assert torch.equal(torch.cat([b.targets for b in ranks]), one.targets)
    assert (one.ids[:, 0] == SPECIALS.cls).all() and (one.targets[:, 0] == IGNORE).all()


def test_loss_counts_selected_tokens_and_the_next_sentence_label():
    task = _task(nsp=True)
    batch = task.batch(0, 10, 6, 0, 1, 0)
    g = torch.Generator().manual_seed(fixed_seed())
    logits, nsp = torch.randn(6, batch.ids.shape[1], 50, generator=g), torch.randn(6, 2, generator=g)
    chosen = batch.targets.clone()
    chosen[:, 0] = IGNORE
    keep = chosen != IGNORE
    want = torch.nn.functional.cross_entropy(logits[keep], chosen[keep]) + torch.nn.functional.cross_entropy(
        nsp, batch.targets[:, 0])
    torch.testing.assert_close(task.loss((logits, nsp), batch.targets), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("nsp", [False, True])
def test_the_head_on_the_selected_positions_gives_their_logits_and_the_same_loss(nsp):
    """Training runs the token head on the batch's selected positions alone (its ``extra`` input): those rows'
    logits equal the whole head's at the same positions (float64, to rounding), and so does the loss; [CLS], whose
    target is the NSP label, is not among them."""
    from clusterformer.models import EncoderConfig, MaskedLanguageModel

    task = _task(nsp=nsp)
    batch = task.batch(3, 10, 6, 0, 1, 0)
    assert torch.equal(batch.extra, (batch.targets != IGNORE) & (torch.arange(batch.ids.shape[1]) > 0))
    assert batch.extra.any()
    torch.manual_seed(fixed_seed())
    model = MaskedLanguageModel(EncoderConfig(vocab_size=50, dim=16, depth=2, heads=2, dropout=0.0), nsp=nsp).double()
    whole, nsp_whole = model(batch.ids)
    rows, nsp_rows = model(batch.ids, None, batch.extra)
    assert rows.shape == (int(batch.extra.sum()), 50)
    torch.testing.assert_close(rows, whole[batch.extra], rtol=0, atol=1e-12)
    # the loss runs in float32 (logits.float()): the two orders of summation agree to its rounding
    torch.testing.assert_close(task.loss((rows, nsp_rows), batch.targets), task.loss((whole, nsp_whole), batch.targets),
                               rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="positions must be a bool tensor"):
        model(batch.ids, None, batch.extra.long())
    with pytest.raises(ValueError, match="rows of token logits"):
        task.loss((rows[1:], nsp_rows), batch.targets)


def test_options_are_validated():
    for bad, match in (({"corpus": ["imdb", "wiki"]}, "corpus"), ({"mask_prob": 0.0}, "mask_prob"),
                       ({"nsp": 1}, "nsp"), ({"eval_windows": 0}, "eval_windows"), ({"masks": 1}, "masks")):
        with pytest.raises(ValueError, match=match):
            mlm_options(bad)
    with pytest.raises(ValueError, match="task_options"):
        TrainConfig(task="mr", out="x", max_steps=1, task_options={"nsp": True})
    specials = ByteTokenizer.mlm_specials()
    assert (specials.mask, specials.cls, specials.sep, specials.vocab_size) == (257, 258, 259, 260)


MLM_FLAGS = dict(dim=32, depth=2, heads=2, batch_size=4, lr=3e-3, warmup_steps=0, log_every=1, progress=False,
                 vocab_size=3000, limit=12, max_len=48, data_dir=str(SHARED))


@needs_data
def test_pretrain_then_fine_tune_from_the_checkpoint(tmp_path):
    """MLM pretraining runs on the training splits and reports held-out perplexity (IMDB test, WikiText-2 test);
    fine-tuning loads its encoder and tokenizer; a mismatch is refused unless --init-partial."""
    pre = tmp_path / "pre"
    metrics = run_training(TrainConfig(task="mlm", out=str(pre), attention="neural-clustering", max_steps=4,
                                       task_options={"nsp": True, "eval_windows": 4}, **MLM_FLAGS))
    m = metrics["metrics"]
    assert 1 < m["perplexity"] < 2 * 3000 and 0 <= m["accuracy"] <= 1 and m["masked_tokens"] > 0  # about uniform
    assert "wikitext2_perplexity" in m and m["wikitext2_windows"] == 4
    info = json.loads((pre / "metrics.json").read_text())
    assert info["config"]["task"] == "mlm"
    model, task, _config, _ = load_trained(pre)  # the checkpoint holds the tokenizer
    assert task.specials.vocab_size == model.encoder.embed.num_embeddings

    fine = dict(MLM_FLAGS, max_len=40, lr=1e-3)
    fine.pop("vocab_size")
    config = TrainConfig(task="mr", out=str(tmp_path / "fine"), attention="neural-clustering", max_steps=2,
                         init=str(pre), **fine)
    result = run_training(config)
    assert result["init"]["transferred"] > 10 and result["init"]["skipped"] == [] == result["init"]["unused"]
    tuned, _, _, _ = load_trained(tmp_path / "fine")
    assert tuned.encoder.embed.num_embeddings == model.encoder.embed.num_embeddings  # the pretrained vocabulary

    # the from-scratch control with the pretrained vocabulary: the checkpoint's tokenizer, none of its weights
    from clusterformer.train.loop import _set_up
    pretrained = torch.load(pre / "checkpoint.pt", weights_only=False)
    control = _set_up(TrainConfig(task="mr", out=str(tmp_path / "control"), attention="neural-clustering",
                                  max_steps=1, tokenizer_from=str(pre), **fine), None)
    assert control.task.tokenizer == pretrained["tokenizer"] and control.init_report is None
    assert control.model.encoder.embed.num_embeddings == model.encoder.embed.num_embeddings
    scratch = _set_up(TrainConfig(task="mr", out=str(tmp_path / "own"), attention="neural-clustering", max_steps=1,
                                  **dict(fine, vocab_size=3000)), None)
    assert scratch.task.tokenizer != pretrained["tokenizer"]  # without it: a vocabulary fitted on the task's texts
    fresh = control.model.encoder.state_dict()
    assert not any(torch.equal(value, pretrained["model"]["encoder." + name]) for name, value in fresh.items()
                   if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() > 1
                   and value.std() > 0)
    with pytest.raises(ValueError, match="tokenizer_from is for a run without --init"):
        TrainConfig(task="mr", out="x", max_steps=1, init=str(pre), tokenizer_from=str(pre))
    with pytest.raises(ValueError, match="tokenizer_from must be a checkpoint"):
        TrainConfig(task="mr", out="x", max_steps=1, tokenizer_from=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="leave --tokenizer at auto"):
        TrainConfig(task="mr", out="x", max_steps=1, tokenizer_from=str(pre), tokenizer="word")

    # what fine-tuning starts from is the pretrained encoder (no steps: the weights as loaded)
    run = _set_up(TrainConfig(task="mr", out=str(tmp_path / "fresh"), attention="neural-clustering", max_steps=1,
                              init=str(pre), **fine), None)
    pretrained = pretrained["model"]
    for name, value in run.model.encoder.state_dict().items():
        source = pretrained["encoder." + name]
        if name == "positions.weight":
            source = source[:value.shape[0]]
        torch.testing.assert_close(value, source, rtol=0, atol=0)

    with pytest.raises(ValueError, match="dim: pretrained 32, here 48"):
        run_training(TrainConfig(task="mr", out=str(tmp_path / "bad"), attention="neural-clustering", max_steps=1,
                                 init=str(pre), **dict(fine, dim=48)))
    with pytest.raises(ValueError, match="attention: pretrained 'neural-clustering', here 'full'"):
        run_training(TrainConfig(task="mr", out=str(tmp_path / "bad2"), attention="full", max_steps=1,
                                 init=str(pre), **fine))
    partial = run_training(TrainConfig(task="mr", out=str(tmp_path / "partial"), attention="full", max_steps=1,
                                       init=str(pre), init_partial=True, **fine))
    assert partial["init"]["transferred"] > 0 and not partial["init"]["skipped"]
    assert any("centroids" in name for name in partial["init"]["unused"])  # neural-clustering's, which full lacks
    with pytest.raises(ValueError, match="continuing a run of this task"):  # an MLM encoder is taken as trained
        run_training(TrainConfig(task="mr", out=str(tmp_path / "bad5"), attention="neural-clustering", max_steps=1,
                                 init=str(pre), layer_attention={1: ["full", {}]}, **fine))
    with pytest.raises(ValueError, match="neither"):
        TrainConfig(task="mr", out="x", max_steps=1, init=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="cluster_layers cannot rebuild"):  # a pretrained model's own layers
        TrainConfig(task="mr", out="x", max_steps=1, init="minilm", attention="cluster-former", cluster_layers=(1,))
    with pytest.raises(ValueError, match="task 'listops' is not one"):  # an MLM encoder fine-tunes text tasks
        run_training(TrainConfig(task="listops", out=str(tmp_path / "bad4"), max_steps=1, init=str(pre),
                                 **dict(fine, vocab_size=3000)))
    with pytest.raises(ValueError, match=r"of task 'mr'.*mlm"):  # a checkpoint of another task
        run_training(TrainConfig(task="subj", out=str(tmp_path / "bad3"), max_steps=1,
                                 init=str(tmp_path / "partial"), init_partial=True, **fine))


@needs_data
def test_a_crashed_and_resumed_pretraining_equals_an_uninterrupted_one(tmp_path, monkeypatch):
    """Masks, NSP coins and starts are drawn per step: a run that crashes at step 5 (checkpoints every 2) and is
    resumed ends with the same weights as one that did not, and the per-step log shows tokens per second."""
    from clusterformer.train.checkpoint import load_checkpoint

    common = dict(MLM_FLAGS, attention="routing", max_steps=6, checkpoint_every=2, reversible=True, tied=True,
                  task_options={"nsp": True, "eval_windows": 2})  # the k-means paper's tied reversible layers
    run_training(TrainConfig(task="mlm", out=str(tmp_path / "straight"), **common))
    original = MaskedLMTask.batch

    def crash_at_5(task, step, *args):
        if step == 5:
            raise RuntimeError("simulated crash")
        return original(task, step, *args)

    monkeypatch.setattr(MaskedLMTask, "batch", crash_at_5)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_training(TrainConfig(task="mlm", out=str(tmp_path / "crashed"), **common))
    monkeypatch.setattr(MaskedLMTask, "batch", original)
    run_training(TrainConfig(task="mlm", out=str(tmp_path / "crashed"), resume=True, **common))
    a, b = (load_checkpoint(tmp_path / name)["model"] for name in ("straight", "crashed"))
    assert any(".tied." in name for name in a)  # --tied built the tied connections
    for name, value in a.items():
        if torch.is_tensor(value):
            assert torch.equal(value, b[name]), name
    rows = [json.loads(line) for line in (tmp_path / "crashed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6] and rows[-1]["tokens_per_s"] > 0


@needs_data
def test_wordpiece_pretraining_carries_its_subwords_into_fine_tuning(tmp_path):
    """``--tokenizer wordpiece``: the pretraining's vocabulary is BERT's subwords, saved with the checkpoint and
    read by the fine-tuned runs of sentence and pair tasks (no [UNK] on their texts, which a word-level vocabulary
    fitted on the pretraining corpus leaves); a task trained from scratch with it fits its own subwords."""
    from clusterformer.data import WordTokenizer
    from clusterformer.train.loop import _set_up

    pre, word_pre = tmp_path / "pre", tmp_path / "word-pre"
    for out, kind in ((pre, "wordpiece"), (word_pre, "word")):
        run_training(TrainConfig(task="mlm", out=str(out), attention="full", max_steps=1, tokenizer=kind,
                                 task_options={"eval_windows": 2}, **MLM_FLAGS))
    saved = torch.load(pre / "checkpoint.pt", weights_only=False)["tokenizer"]
    assert WordTokenizer.from_str(saved).kind == "wordpiece"
    fine = dict(MLM_FLAGS, max_len=40)
    fine.pop("vocab_size")
    for task in ("mr", "wikiqa"):
        tuned = _set_up(TrainConfig(task=task, out=str(tmp_path / task), max_steps=1, init=str(pre), **fine), None)
        assert tuned.task.tokenizer == saved
        words = _set_up(TrainConfig(task=task, out=str(tmp_path / f"{task}-words"), max_steps=1,
                                    tokenizer_from=str(word_pre), **fine), None)
        unknown = {name: (run.task.train.ids[~run.task.train.pad] == 1).float().mean().item()
                   for name, run in (("pieces", tuned), ("words", words))}
        assert unknown["pieces"] < 0.01 < 0.1 < unknown["words"], unknown  # rare words read as pieces, not [UNK]
    scratch = _set_up(TrainConfig(task="wikiqa", out=str(tmp_path / "own"), max_steps=1, tokenizer="wordpiece",
                                  **dict(fine, vocab_size=500)), None)
    own = WordTokenizer.from_str(scratch.task.tokenizer)
    assert own.kind == "wordpiece" and own.vocab_size <= 500 and scratch.task.tokenizer != saved
    with pytest.raises(ValueError, match="tokenizer"):
        TrainConfig(task="mr", out="x", max_steps=1, tokenizer="subwords")
