"""Models built from the attention registry."""

from .encoder import Encoder, EncoderConfig, SequenceClassifier, sinusoidal_positions

__all__ = ["Encoder", "EncoderConfig", "SequenceClassifier", "sinusoidal_positions"]
