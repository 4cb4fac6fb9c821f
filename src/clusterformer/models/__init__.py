"""Models built from the attention registry."""

from .encoder import (
    Encoder,
    EncoderConfig,
    SequenceClassifier,
    TokenClassifier,
    cluster_former_config,
    sinusoidal_positions,
)
from .reversible import ReversibleSequence, TiedConnection

__all__ = [
    "Encoder",
    "EncoderConfig",
    "ReversibleSequence",
    "SequenceClassifier",
    "TiedConnection",
    "TokenClassifier",
    "cluster_former_config",
    "sinusoidal_positions",
]
