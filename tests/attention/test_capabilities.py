"""What a mechanism can do is a capability the registry holds (:class:`clusterformer.attention.registry.Mechanism`),
and the code that treats mechanisms differently asks it, never the name."""

import pytest
import torch

from clusterformer.attention import build, registry
from clusterformer.attention.base import AttentionOptions
from clusterformer.attention.full import FullAttention, FullOptions
from clusterformer.attention.neural_clustering import NeuralClusteringAttention, NeuralClusteringOptions
from clusterformer.attention.registry import DENSE, STACK, Mechanism, get, names, names_where, register
from clusterformer.models import EncoderConfig
from clusterformer.train.config import TrainConfig, check_trainable

CACHE_READERS = {"cluster-retrieval", "oracle", "quest", "sink-window"}


def test_the_cache_readers_are_a_kind_of_their_own():
    """They are full attention by their forward (FullAttention's subclasses), yet no model's layer: kind "cache"."""
    assert set(names_where(kind="cache")) == CACHE_READERS
    assert set(names_where(kind="sequence")) == set(names()) - CACHE_READERS
    assert all(issubclass(get(name).inner, FullAttention) for name in CACHE_READERS)
    assert names_where(keeps_index=True) == ["cluster-retrieval"]
    assert names_where(interface_mode="sequence") == ["clustered", "improved-clustered"]
    assert names_where(learned_centroids=True) == ["neural-clustering"]
    assert [(m.name, m.stack_layers) for m in registry.mechanisms() if m.stack_layers] == [
        ("cluster-former", "sliding-window")]
    with pytest.raises(ValueError, match="not a capability"):
        names_where(summary="x")


@pytest.mark.parametrize("label", [DENSE, STACK])
def test_the_labels_beside_the_names_cannot_be_registered(label):
    with pytest.raises(ValueError, match="not a mechanism's name"):
        register(label, FullOptions, "a mechanism under a label the comparisons use")(FullAttention)
    assert label not in names()


@pytest.mark.parametrize("name", ["cluster-former", "neural-clustering"])
def test_mechanisms_grouping_by_hidden_states_refuse_q_k_v_alone(name):
    inner = build(name, dim=8, heads=2).inner
    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match=f"^{name} .*: call it through attend_hidden"):
        inner(q, q, q)


def test_the_capability_decides_not_the_name(monkeypatch):
    """A mechanism registered under another name with the same capabilities is treated alike: centroid flow for
    learned centroids, the refusal to train for a cache reader."""

    class Twin(NeuralClusteringAttention):
        pass

    class Reader(FullAttention):
        kind = "cache"

    monkeypatch.setitem(registry._REGISTRY, "twin", Mechanism("twin", Twin, NeuralClusteringOptions, "a twin"))
    monkeypatch.setitem(registry._REGISTRY, "reader", Mechanism("reader", Reader, AttentionOptions, "a reader"))
    EncoderConfig(vocab_size=10, attention="twin", centroid_flow=True)
    with pytest.raises(ValueError, match="centroid_flow needs attention='neural-clustering' or 'twin'"):
        EncoderConfig(vocab_size=10, attention="lsh", centroid_flow=True)
    with pytest.raises(ValueError, match="'reader' changes only how a pretrained decoder reads"):
        check_trainable("attention", "reader")
    check_trainable("attention", "twin")
    with pytest.raises(ValueError, match="it needs attention='neural-clustering' or 'twin'"):
        TrainConfig(task="mr", out="x", max_steps=1, attention="lsh", centroid_lr_scale=0.5)
