"""The typed mask (clusterformer.masks.AttentionMask) against a reference written entry by entry from its
definition: query i of Lq sits at position n - Lq + i; it may see key j when j is a real token, j <= its position
(causal), and j is in its window ((t - w, t] causal, [t - w // 2, t + w - w // 2) otherwise). The dense tensor,
the FlexAttention ``mask_mod`` and the flat-row predicate must each agree with it, and reading a dense mask back
(``from_allowed``, the Hugging Face path's one flip) must recover the structure or refuse the pattern."""

from __future__ import annotations

import itertools

import pytest
import torch

from clusterformer.masks import AttentionMask
from seeds import fixed_seed


def reference(padding: torch.Tensor | None, causal: bool, window: int | None, q_len: int, kv_len: int,
              batch: int) -> torch.Tensor:
    """(batch, q_len, kv_len) bool, one entry at a time."""
    out = torch.zeros(batch, q_len, kv_len, dtype=torch.bool)
    for b, i, j in itertools.product(range(batch), range(q_len), range(kv_len)):
        t = kv_len - q_len + i
        ok = padding is None or not bool(padding[b, j])
        if causal:
            ok = ok and j <= t
        if window is not None:
            low, high = (t - window + 1, t + 1) if causal else (t - window // 2, t + window - window // 2)
            ok = ok and low <= j < high
        out[b, i, j] = ok
    return out


CASES = [(q_len, kv_len, causal, window, padded)
         for q_len, kv_len in [(1, 1), (1, 7), (5, 5), (3, 11), (13, 13)]
         for causal in (False, True) for window in (None, 1, 4, 5) for padded in (False, True)]


def _padding(batch: int, kv_len: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(fixed_seed())
    padding = torch.rand(batch, kv_len, generator=generator) < 0.3
    padding[0] = False  # a sequence without padding beside the others
    padding[-1] = True  # and one of padding only
    return padding


@pytest.mark.parametrize("q_len, kv_len, causal, window, padded", CASES)
def test_allowed_matches_the_definition(q_len, kv_len, causal, window, padded):
    batch = 3
    padding = _padding(batch, kv_len) if padded else None
    mask = AttentionMask(padding, causal, window)
    got = mask.allowed(q_len, kv_len, torch.device("cpu"))
    assert got.dim() == 4 and got.shape[1] == 1 and got.shape[-1] == kv_len
    want = reference(padding, causal, window, q_len, kv_len, batch)
    assert torch.equal(got[:, 0].expand(batch, q_len, kv_len), want)


@pytest.mark.parametrize("q_len, kv_len, causal, window, padded", CASES[::3])
def test_mask_mod_is_the_same_predicate(q_len, kv_len, causal, window, padded):
    """FlexAttention's own mask builder (pure PyTorch, vmap over the grid) reads the same mask from mask_mod."""
    create_mask = pytest.importorskip("torch.nn.attention.flex_attention").create_mask
    batch = 3
    padding = _padding(batch, kv_len) if padded else None
    mask = AttentionMask(padding, causal, window)
    got = create_mask(mask.mask_mod(q_len, kv_len), batch if padded else None, None, q_len, kv_len, device="cpu")
    want = reference(padding, causal, window, q_len, kv_len, batch)
    assert torch.equal(got[:, 0].expand(batch, q_len, kv_len), want)


@pytest.mark.parametrize("q_len, kv_len", [(1, 6), (4, 4), (3, 9), (9, 9)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_from_allowed_reads_back_padding_and_causal(q_len, kv_len, causal, padded):
    batch = 3
    padding = _padding(batch, kv_len) if padded else None
    dense = reference(padding, causal, None, q_len, kv_len, batch)
    mask = AttentionMask.from_allowed(dense)
    assert mask.window is None
    # what it read describes the same mask (a causal mask over one query is read as not causal: the same keys)
    assert torch.equal(mask.allowed(q_len, kv_len, torch.device("cpu"))[:, 0].expand_as(dense), dense)
    if q_len > 1 and not (padded and causal):  # with padding, some causal patterns are also padding-only
        assert mask.causal == causal
    if not padded:
        assert mask.padding is None


def test_from_allowed_refuses_other_patterns():
    sliding = reference(None, True, 3, 8, 8, 2)
    with pytest.raises(ValueError, match="neither key padding nor key padding \\+ causal"):
        AttentionMask.from_allowed(sliding)
    packed = torch.zeros(1, 6, 6, dtype=torch.bool)
    packed[0, :3, :3] = packed[0, 3:, 3:] = True  # two documents in one row
    with pytest.raises(ValueError, match="neither"):
        AttentionMask.from_allowed(packed)
    with pytest.raises(ValueError, match="allowed must be a \\(B, Lq, n\\) bool tensor"):
        AttentionMask.from_allowed(torch.ones(2, 3, 3))


def test_bad_fields_raise_naming_them():
    with pytest.raises(ValueError, match="padding must be a \\(B, n\\) bool tensor"):
        AttentionMask(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="padding must be"):
        AttentionMask(torch.zeros(2, 3, 4, dtype=torch.bool))
    for window in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="window must be a positive int"):
            AttentionMask(None, True, window)
    with pytest.raises(ValueError, match="padding covers 5 keys; the mask asks for 6"):
        AttentionMask(torch.zeros(1, 5, dtype=torch.bool)).allowed(2, 6, torch.device("cpu"))
    with pytest.raises(ValueError, match="positions are needed"):
        AttentionMask(None, True).predicate(torch.ones(4, dtype=torch.bool), None)
