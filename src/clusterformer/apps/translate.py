"""``clusterformer translate``: translate sentences with a trained ``--task multi30k`` model (greedy or beam search,
both with the decoder cache), batched. The model and its BPE tokenizers are rebuilt from the checkpoint alone."""

from __future__ import annotations

from pathlib import Path

from ..train.translation import Translator, tokenizers_from_state, translation_model_config

__all__ = ["load_translator"]


def load_translator(path: str | Path, device: str = "cpu") -> Translator:
    """The :class:`~clusterformer.train.translation.Translator` of a translation run directory or checkpoint file."""
    from ..models import EncoderConfig
    from ..models.seq2seq import Seq2Seq
    from ..train.loop import load_run

    state, config = load_run(path)
    if config.task != "multi30k":
        raise ValueError(f"{str(path)!r} is a {config.task!r} run; translate needs a translation model "
                         "(clusterformer train --task multi30k)")
    source, target = tokenizers_from_state(state["tokenizer"])
    # the encoder config train's build_model gave the task (max_len: TranslationTask.model_max_len, + BOS and EOS)
    encoder = EncoderConfig(vocab_size=source.vocab_size, dim=config.dim, depth=config.depth, heads=config.heads,
                            ff_dim=config.ff_dim, dropout=config.dropout, max_len=config.max_len + 2,
                            attention=config.attention, attention_options=dict(config.attention_options))
    model = Seq2Seq(translation_model_config(encoder, source, target, config.decoder_attention,
                                             dict(config.decoder_attention_options)))
    model.load_state_dict(state["model"])
    return Translator(model.to(device).eval(), source, target, config.max_len)
