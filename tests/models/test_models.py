"""Encoder, classifier, centroid flow and the aux-loss plumbing through a model."""

from __future__ import annotations

import pytest
import torch

from clusterformer.attention import collect_aux_losses, total_loss
from clusterformer.models import Encoder, EncoderConfig, SequenceClassifier
from reference import run_recorded


def _config(**overrides):
    base = dict(vocab_size=30, dim=16, depth=3, heads=2, dropout=0.0, attention="neural-clustering",
                attention_options={"num_clusters": 3})
    base.update(overrides)
    return EncoderConfig(**base)


def test_aux_losses_are_the_mean_over_layers():
    model = SequenceClassifier(_config(), num_classes=3)
    tokens = torch.randint(1, 30, (2, 11))
    inputs = []  # what each attention layer was called with, to run it again alone
    hooks = [block.attn.register_forward_hook(lambda m, args, kwargs, out: inputs.append((m, args, kwargs)),
                                              with_kwargs=True) for block in model.encoder.blocks]
    with collect_aux_losses() as aux:
        model(tokens)
    for hook in hooks:
        hook.remove()
    depth = len(model.encoder.blocks)
    assert depth > 1 and aux.counts() == {"clustering": depth, "centroid_sorting": depth}
    alone = [run_recorded(layer, *args, **kwargs)[1] for layer, args, kwargs in inputs]
    for name in ("clustering", "centroid_sorting"):
        expected = torch.stack([layer_aux[name] for layer_aux in alone]).mean()
        torch.testing.assert_close(aux[name], expected)
    total = total_loss(torch.tensor(2.0), aux, {"clustering": 0.5, "centroid_sorting": 0.25}, task_weight=3.0)
    torch.testing.assert_close(total, 6.0 + 0.5 * aux["clustering"] + 0.25 * aux["centroid_sorting"])
    with collect_aux_losses() as none:
        SequenceClassifier(_config(attention="full", attention_options={}), 2)(tokens)
    assert dict(none) == {}
    with pytest.raises(ValueError, match="loss weight 'clustering' must be >= 0"):
        total_loss(torch.tensor(1.0), aux, {"clustering": -1.0})
    with pytest.raises(ValueError, match="loss weight 'clusterin' names no auxiliary loss; known losses: "
                                         "centroid_sorting, clustering, commitment"):
        total_loss(torch.tensor(1.0), aux, {"clusterin": 0.5})  # a misspelled weight must not do nothing
    # a known loss this model does not publish adds nothing
    torch.testing.assert_close(total_loss(torch.tensor(1.0), {}, {"commitment": 1.0}), torch.tensor(1.0))


def test_centroid_flow_passes_updated_centroids_between_layers():
    model = Encoder(_config(centroid_flow=True))
    attn = [block.attn for block in model.blocks]
    assert attn[0].inner.centroids is not None and all(a.inner.centroids is None for a in attn[1:])
    flows_in, flows_out = [], []

    def record(module, args, kwargs, out) -> None:
        flows_in.append(kwargs["flow"])
        flows_out.append(out[1])

    hooks = [a.register_forward_hook(record, with_kwargs=True) for a in attn]
    tokens = torch.randint(1, 30, (2, 9))
    out, aux, _ = run_recorded(model, tokens)
    for hook in hooks:
        hook.remove()
    assert flows_in[0] is None and flows_in[1] is flows_out[0]  # layer 2 starts from layer 1's C_hat
    loss = out.sum() + sum(aux.values())
    loss.backward()
    assert attn[0].inner.centroids.grad is not None and attn[0].inner.centroids.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="leak future tokens"):
        model(tokens, causal=True)  # strict causal mode refuses centroids from another layer


@pytest.mark.parametrize("attention", ["full", "neural-clustering"])
def test_classifier_ignores_padding(attention):
    model = SequenceClassifier(_config(attention=attention, attention_options={}), num_classes=2).eval()
    tokens = torch.randint(1, 30, (3, 14))
    pad = torch.zeros(3, 14, dtype=torch.bool)
    pad[0, 9:] = True
    logits = model(tokens, pad)
    changed = tokens.clone()
    changed[pad] = torch.randint(1, 30, (int(pad.sum()),))
    torch.testing.assert_close(model(changed, pad), logits)


def test_encoder_config_errors():
    with pytest.raises(ValueError, match="unknown attention mechanism 'nope'"):
        _config(attention="nope")
    with pytest.raises(ValueError, match="unknown option 'clusters'"):
        _config(attention_options={"clusters": 3})
    with pytest.raises(ValueError, match="centroid_flow needs attention='neural-clustering'"):
        _config(attention="full", attention_options={}, centroid_flow=True)
    with pytest.raises(ValueError, match="positional must be one of"):
        _config(positional="rotary")
    model = Encoder(_config(positional="learned", max_len=8))
    with pytest.raises(ValueError, match="max_len=8"):
        model(torch.randint(1, 30, (1, 9)))
    with pytest.raises(ValueError, match="tokens must be an integer tensor"):
        model(torch.randn(1, 5))


@pytest.mark.parametrize("name", ["lsh", "kmeans", "routing", "clustered"])
def test_each_layer_gets_its_own_seed(name):
    """Layers of a model must not share hash rotations / planes / initial centroids. Layer 1's
    parameters (not its seeded buffers or generator) are copied into layer 0; with a shared seed the two
    would then compute the same function."""
    from clusterformer.models import Encoder, EncoderConfig

    config = EncoderConfig(vocab_size=30, dim=32, depth=2, heads=2, attention=name,
                           attention_options={"seed": 3})
    tokens = torch.randint(1, 30, (2, 40), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    model = Encoder(config).eval()
    torch.manual_seed(0)
    again = Encoder(config).eval()
    with torch.no_grad():  # a fixed seed still reproduces the whole model
        assert torch.equal(model(tokens), again(tokens))
    first, second = (block.attn for block in model.blocks)
    assert first.inner.seed != second.inner.seed
    with torch.no_grad():
        for p_first, p_second in zip(first.parameters(), second.parameters(), strict=True):
            p_first.copy_(p_second)
        x = torch.randn(2, 150, 32, generator=torch.Generator().manual_seed(1))
        assert not torch.allclose(first(x), second(x))
