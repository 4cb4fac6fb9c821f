"""Models built from the attention registry."""

from .encoder import (
    Encoder,
    EncoderConfig,
    MaskedLanguageModel,
    SequenceClassifier,
    TokenClassifier,
    cluster_former_config,
    sinusoidal_positions,
)
from .reversible import ReversibleSequence, TiedConnection

__all__ = [
    "Encoder",
    "EncoderConfig",
    "MaskedLanguageModel",
    "ReversibleSequence",
    "SequenceClassifier",
    "TiedConnection",
    "TokenClassifier",
    "cluster_former_config",
    "sinusoidal_positions",
]
