"""The encoder-decoder: it learns a synthetic copy task end to end (decoder, cache and beam search together);
cached and uncached decoding agree; beam 1 is greedy; bad inputs are refused clearly."""

from __future__ import annotations

import pytest
import torch

from clusterformer.models.seq2seq import (
    BOS,
    EOS,
    Seq2Seq,
    Seq2SeqConfig,
    beam_search,
    greedy_decode,
    label_smoothed_loss,
)

NC_DECODER = {"causal_chunk_size": 4, "causal_clusters": 2}


def _copy_data(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sources of 2..6 tokens from ids 3..10; the target is the source itself (BOS + source + EOS)."""
    lengths = torch.randint(2, 7, (n,), generator=generator)
    src = torch.randint(3, 11, (n, 6), generator=generator)
    pad = torch.arange(6) >= lengths.unsqueeze(1)
    src = src.masked_fill(pad, 0)
    tgt = torch.zeros(n, 8, dtype=torch.long)
    tgt[:, 0] = BOS
    tgt[:, 1:7] = src
    tgt[torch.arange(n), lengths + 1] = EOS
    return src, pad, tgt


def _model(encoder: str = "full", decoder: str = "full", **config) -> Seq2Seq:
    return Seq2Seq(Seq2SeqConfig(
        src_vocab_size=11, tgt_vocab_size=11, dim=32, heads=2, encoder_depth=2, decoder_depth=2, max_len=16,
        encoder_attention=encoder, decoder_attention=decoder,
        decoder_options=NC_DECODER if decoder == "neural-clustering" else {}, **config))


def test_learns_to_copy_with_neural_clustering_in_encoder_and_decoder():
    """450 CPU steps; then greedy decoding and beam search copy (nearly) every held-out sentence exactly. The
    floating-point order of the CPU's thread count moves borderline sentences: after 300 steps one thread copied 94
    of 100 greedily where two threads copied all; after 450 both copy all 100. An untrained model copies none."""
    torch.manual_seed(0)
    model = _model("neural-clustering", "neural-clustering", dropout=0.0, share_embeddings=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(1)
    for _ in range(450):
        src, pad, tgt = _copy_data(64, generator)
        loss = label_smoothed_loss(model(src, pad, tgt[:, :-1]), tgt[:, 1:], smoothing=0.0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    src, pad, _ = _copy_data(100, torch.Generator().manual_seed(99))
    expected = [row[~p].tolist() for row, p in zip(src, pad, strict=True)]
    for decoded in (greedy_decode(model, src, pad), beam_search(model, src, pad, beam=3)):
        exact = sum(d == e for d, e in zip(decoded, expected, strict=True))
        assert exact >= 97, f"{exact} of 100 copied exactly"


@pytest.mark.parametrize(("encoder", "decoder"), [("full", "full"), ("neural-clustering", "neural-clustering"),
                                                  ("lsh", "lsh"), ("clustered", "routing")])
def test_cached_and_uncached_decoding_agree_and_beam_one_is_greedy(encoder, decoder):
    torch.manual_seed(4)
    model = _model(encoder, decoder).double().eval()
    src = torch.randint(3, 11, (5, 9))
    pad = torch.arange(9) >= torch.tensor([9, 4, 2, 7, 1]).unsqueeze(1)
    src = src.masked_fill(pad, 0)
    greedy = greedy_decode(model, src, pad, max_new_tokens=12)
    assert greedy == greedy_decode(model, src, pad, max_new_tokens=12, use_cache=False)
    assert beam_search(model, src, pad, beam=1, max_new_tokens=12) == greedy
    beams = beam_search(model, src, pad, beam=4, max_new_tokens=12)
    assert beams == beam_search(model, src, pad, beam=4, max_new_tokens=12, use_cache=False)
    # each sentence's translation does not depend on the rest of the batch
    alone = [beam_search(model, src[i:i + 1, :int((~pad[i]).sum())], beam=4, max_new_tokens=12)[0] for i in range(5)]
    assert alone == beams


def test_beam_search_finds_a_better_scored_hypothesis_than_greedy_on_a_planted_model():
    """Greedy takes the locally best first token; beam search keeps the second and wins overall."""

    class Planted(Seq2Seq):
        # after BOS: token 3 (p=0.6) or 4 (p=0.4); after 3: EOS with p=0.3 or 5 with 0.35 or 6 with 0.35;
        # after 4: EOS with p=1. Greedy: 3 then 5/6 (0.6 * 0.35 = 0.21 ...); beam: "4" alone, 0.4 * 1.0.
        def logits(self, hidden):
            return self._table[self._last].log()

    model = Planted(Seq2SeqConfig(src_vocab_size=8, tgt_vocab_size=8, dim=8, heads=2, encoder_depth=1,
                                  decoder_depth=1, max_len=8)).eval()
    table = torch.full((8, 8), 1e-9)
    table[BOS, 3], table[BOS, 4] = 0.6, 0.4
    table[3, EOS], table[3, 5], table[3, 6] = 0.3, 0.35, 0.35
    table[4, EOS] = 1.0
    for t in (5, 6, EOS):
        table[t, EOS] = 1.0
    model._table = table
    model.start = _tracking(model, model.start, first=True)
    model.step = _tracking(model, model.step, first=False)
    src = torch.tensor([[3, 4]])
    assert greedy_decode(model, src, max_new_tokens=4) == [[3, 5]]
    assert beam_search(model, src, beam=2, length_penalty=0.0, max_new_tokens=4) == [[4]]


def _tracking(model, method, first):
    """Feed the planted model's table the last token of each sequence."""
    def wrapped(*args):
        if first:
            model._last = torch.full((args[0].shape[0],), BOS)
        else:
            model._last = args[0]
        return method(*args)
    return wrapped


def test_bad_inputs_are_refused_clearly():
    with pytest.raises(ValueError, match="decoder_attention 'clustered'"):
        _model("full", "clustered")
    with pytest.raises(ValueError, match="decoder_attention 'cluster-former'"):
        _model("full", "cluster-former")
    with pytest.raises(ValueError, match="share_embeddings"):
        Seq2SeqConfig(src_vocab_size=10, tgt_vocab_size=12, share_embeddings=True)
    model = _model().eval()
    with pytest.raises(ValueError, match="at least one token"):
        greedy_decode(model, torch.tensor([[3, 0]]), torch.tensor([[False, False], [True, True]])[1:])
    with pytest.raises(ValueError, match="beam"):
        beam_search(model, torch.tensor([[3, 4]]), beam=0)
    with pytest.raises(ValueError, match="eval"):
        greedy_decode(model.train(), torch.tensor([[3, 4]]))
