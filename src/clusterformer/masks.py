"""The library's one mask: its value, the typed mask built on it, composable predicates, and one rule for a
query with no key. It sits below ``ops``, ``clustering``, ``attention`` and ``hf``, which all take it from here.

The mask value. At the public entry points padding is one tensor, PyTorch's ``key_padding_mask`` (B, N) bool,
True = padding (``None``: no padding); inside the package it is the ``padding`` of the typed mask below. Its views
have names: :func:`real_tokens` (True = a token),
:func:`real_lengths` (tokens per sequence). Attention masks are *allowed* tensors, True = the query may
attend to the key, broadcastable to (..., queries, keys).

Predicates. A mask is built from predicates in the style of ``torch.nn.attention.flex_attention``'s
``mask_mod`` and ``and_masks``: a predicate maps (query index, key index) tensors -- indices into flat
per-row tables (a token's flat index b * N + n for dense attention, a buffer row for windowed attention)
-- to a boolean "allowed" tensor of their broadcast shape:

    allowed = and_masks(key_is_real(real), causal_order(positions), same_group(groups))(q_index, k_index)

The typed mask. :class:`AttentionMask` (padding, causal, window) is everything a mask says, built once at the
entry points (a layer's ``key_padding_mask`` and causal flag; a ``transformers`` model's 4-D mask, read back by
:meth:`AttentionMask.from_allowed`) and carried as that one object through the inner attentions to the ops, which
take from it the form they need (never building another): a dense allowed tensor, per-row tables and a
predicate for windowed buffers (blocks that repeat a sequence per head or round included), padding per block,
lengths and real tokens, a FlexAttention ``mask_mod``. An op given no mask reads :data:`NO_MASK` (or
:data:`CAUSAL_MASK`, where it is causal by definition); :func:`check_mask` checks one against its input.

The rule. A query with no allowed key (a sequence of padding only, left padding under a causal mask, an
empty window) has no softmax; :func:`allow_empty_rows` gives it every key -- a finite softmax, so no NaN
reaches outputs or gradients -- and reports it, and the caller zeroes its output, which also zeroes every
gradient through it. :func:`masked_sdpa` is SDPA with that rule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["CAUSAL_MASK", "NO_MASK", "AttentionMask", "MaskPredicate", "allow_empty_rows", "and_masks", "cache_sdpa",
           "causal_order", "check_mask", "key_is_real", "local_blocks", "masked_sdpa", "not_mask", "real_lengths",
           "real_tokens", "same_group", "self_only_when_alone", "within_window"]

MaskPredicate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# ---------------------------------------------------------------------------------- views of the mask value
def real_tokens(key_padding_mask: torch.Tensor | None, batch: int, length: int, device: torch.device) -> torch.Tensor:
    """(batch, length) bool, True = a real token (all True without a mask)."""
    if key_padding_mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    return ~key_padding_mask


def real_lengths(key_padding_mask: torch.Tensor | None, batch: int, length: int, device: torch.device) -> torch.Tensor:
    """Each sequence's number of real tokens, (batch,) long: ``length`` for all without a mask. What the
    length-tied parameters (k = sqrt(L), chunk sizes, bucket counts) are computed from."""
    if key_padding_mask is None:
        return torch.full((batch,), length, dtype=torch.long, device=device)
    return (~key_padding_mask).sum(1)


# ------------------------------------------------------------------------------------------------ predicates
def and_masks(*predicates: MaskPredicate) -> MaskPredicate:
    """The predicate allowing a (query, key) pair when every one of ``predicates`` does."""

    def both(q_index: torch.Tensor, k_index: torch.Tensor) -> torch.Tensor:
        allowed = predicates[0](q_index, k_index)
        for predicate in predicates[1:]:
            allowed = allowed & predicate(q_index, k_index)
        return allowed

    return both


def key_is_real(real: torch.Tensor) -> MaskPredicate:
    """The key is a real token: ``real`` (rows,) bool per flat row."""
    return lambda q_index, k_index: real[k_index]


def causal_order(positions: torch.Tensor) -> MaskPredicate:
    """The key is not after the query: ``positions`` (rows,) each row's position in its sequence."""
    return lambda q_index, k_index: positions[q_index] >= positions[k_index]


def same_group(groups: torch.Tensor) -> MaskPredicate:
    """Query and key are in the same group: ``groups`` (rows,) each row's group."""
    return lambda q_index, k_index: groups[q_index] == groups[k_index]


def local_blocks(positions: torch.Tensor, block: int) -> MaskPredicate:
    """The key is in the query's local blocks: positions cut into blocks of ``block``, the key's block is the
    query's or the one before (``positions`` (rows,) each row's position in its sequence). The local part of
    neural-clustering's ``local_window``."""
    blocks = torch.div(positions, block, rounding_mode="floor")

    def local(q_index: torch.Tensor, k_index: torch.Tensor) -> torch.Tensor:
        behind = blocks[q_index] - blocks[k_index]
        return (behind >= 0) & (behind <= 1)

    return local


def not_mask(predicate: MaskPredicate) -> MaskPredicate:
    """The predicate allowing a pair when ``predicate`` does not."""
    return lambda q_index, k_index: ~predicate(q_index, k_index)


def self_only_when_alone(allowed: torch.Tensor, is_self: torch.Tensor) -> torch.Tensor:
    """Reformer's shared-QK rule on an allowed mask (..., Nq, Nk): a query may attend to its own token only when
    it has no other allowed key (with shared QK, q . k_self would dominate). ``is_self`` broadcasts to it."""
    others = allowed & ~is_self
    return torch.where(others.any(-1, keepdim=True), others, allowed)


def within_window(positions: torch.Tensor, window: int, causal: bool) -> MaskPredicate:
    """The key is in the query's local window of ``window`` positions: causal, (t - window, t]; otherwise
    [t - window // 2, t + window - window // 2) (``positions`` (rows,) each row's position in its sequence)."""
    behind = window - 1 if causal else window // 2

    def local(q_index: torch.Tensor, k_index: torch.Tensor) -> torch.Tensor:
        offset = positions[k_index] - positions[q_index]
        return (offset >= -behind) & (offset < window - behind)

    return local


# ----------------------------------------------------------------------------------------- the typed mask
@dataclass(frozen=True)
class AttentionMask:
    """Which keys each query may see: the one mask the library carries from its entry points to the ops.

    padding: (B, n) bool, True = a padding key (never attended to), or None (no padding). causal: a query sees
    no key after its own position. window: with a number, a query sees only the keys of its local window
    (:func:`within_window`). Queries are the *last* Lq of the n positions (lower-right aligned: query i sits at
    position n - Lq + i), which is a self-attention when Lq = n and a cached decoding step or a chunk of a
    prompt when Lq < n.

    Its predicates are the only place where "may query i see key j" is written: :meth:`predicate` over flat
    row tables (the windowed kernels' buffers, the Triton kernel's metadata), :meth:`allowed` as a dense
    tensor, :meth:`mask_mod` in FlexAttention's signature. :meth:`from_allowed` reads a dense boolean mask
    (a ``transformers`` model's) back into this structure, or refuses a pattern it is not."""

    padding: torch.Tensor | None = None
    causal: bool = False
    window: int | None = None

    def __post_init__(self) -> None:
        if self.padding is not None and (self.padding.dim() != 2 or self.padding.dtype != torch.bool):
            raise ValueError(f"padding must be a (B, n) bool tensor (True = padding); got "
                             f"{tuple(self.padding.shape)} {self.padding.dtype}")
        if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, int)
                                        or self.window < 1):
            raise ValueError(f"window must be a positive int or None; got {self.window!r}")

    # views of the padding
    def real(self, batch: int, length: int, device: torch.device) -> torch.Tensor:
        """(batch, length) bool, True = a real key: :func:`real_tokens`."""
        return real_tokens(self.padding, batch, length, device)

    def lengths(self, batch: int, length: int, device: torch.device) -> torch.Tensor:
        """Real keys per sequence, (batch,) long: :func:`real_lengths`."""
        return real_lengths(self.padding, batch, length, device)

    # the predicates
    def predicate(self, real: torch.Tensor, positions: torch.Tensor | None) -> MaskPredicate:
        """The predicate over flat rows whose realness is ``real`` (rows,) bool and whose positions in their
        sequences are ``positions`` (rows,) long (needed with ``causal`` or ``window``; None otherwise)."""
        predicates = [key_is_real(real)]
        if self.causal or self.window is not None:
            if positions is None:
                raise ValueError("positions are needed for a causal or windowed mask")
            if self.causal:
                predicates.append(causal_order(positions))
            if self.window is not None:
                predicates.append(within_window(positions, self.window, self.causal))
        return and_masks(*predicates)

    def rows(self, rows: torch.Tensor, length: int, row_valid: torch.Tensor | None = None, repeat: int = 1
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per flat buffer row holding token ``rows`` (block * length + position): may it be a key (a token --
        where ``row_valid`` says the slot holds one -- and not padding), and its position (None unless causal or
        windowed): the tables :meth:`predicate` and the fused kernel's metadata read. ``repeat``: the blocks are
        ``repeat`` consecutive copies of each sequence (one per head, or per head and hashing round: block
        b * repeat + copy), all reading sequence b's padding."""
        real = torch.ones(rows.shape, dtype=torch.bool, device=rows.device) if row_valid is None else row_valid
        if self.padding is not None:
            tokens = rows
            if repeat != 1:  # block * length + position -> b * length + position
                span = max(length, 1)
                tokens = torch.div(rows, span * repeat, rounding_mode="floor") * span + rows % span
            real = real & ~self.padding.reshape(-1)[tokens]
        positions = rows % max(length, 1) if self.causal or self.window is not None else None
        return real, positions

    def block_padding(self, repeat: int = 1) -> torch.Tensor | None:
        """The padding of ``repeat`` consecutive copies of each sequence, (B * repeat, n) bool (block
        b * repeat + copy reads sequence b), or None without padding: what a layout that sorts each block's
        real tokens reads (:func:`clusterformer.ops.sorted_layout`)."""
        if self.padding is None or repeat == 1:
            return self.padding
        return self.padding.repeat_interleave(repeat, dim=0)

    def repeats(self, blocks: int, name: str = "mask") -> int:
        """How many consecutive blocks of ``blocks`` each sequence of the padding covers (1 without padding);
        ``ValueError`` naming ``name`` when ``blocks`` is not a multiple of the batch."""
        if self.padding is None:
            return 1
        B = self.padding.shape[0]
        if (B == 0 and blocks) or (B and blocks % B):
            raise ValueError(f"{name}'s padding covers {B} sequences, which do not divide the {blocks} blocks")
        return blocks // B if B else 1

    def packed_prefix(self, end: int) -> AttentionMask:
        """The mask of the first ``end`` keys once each sequence's real keys are moved to its front in their own
        order (left padding becomes right padding): padding True from the sequence's number of real keys on,
        (B, end), or None without padding; causal order and window as here. The mask of a block of a prompt read
        in that order (:meth:`clusterformer.attention.retrieval.CacheReadingAttention.attend_cache`)."""
        if self.padding is None:
            return self
        lengths = self.lengths(*self.padding.shape, self.padding.device)
        padding = torch.arange(end, device=self.padding.device) >= lengths[:, None]
        return AttentionMask(padding, self.causal, self.window)

    def point_sets(self, heads: int, copies: int) -> AttentionMask:
        """The padding of ``heads`` point sets per sequence, each ``copies`` of the sequence's n positions side by
        side ((B * heads, copies * n), the sets of one sequence consecutive), for a clustering of per-head points
        (a head's queries and keys together); no causal order or window (a clustering's normalisation is over the
        sequence). Itself when there is neither padding nor an order to drop."""
        if self.padding is None and not self.causal and self.window is None:
            return self
        padding = None if self.padding is None else self.padding.repeat(1, copies).repeat_interleave(heads, dim=0)
        return AttentionMask(padding)

    def allowed(self, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
        """The dense allowed mask of the last ``q_len`` of ``kv_len`` positions: (B or 1, 1, q_len or 1, kv_len),
        True = the query may attend to the key (one query row when it is the same for every query)."""
        B = 1 if self.padding is None else self.padding.shape[0]
        if self.padding is not None and self.padding.shape[1] != kv_len:
            raise ValueError(f"padding covers {self.padding.shape[1]} keys; the mask asks for {kv_len}")
        real, positions = self.rows(torch.arange(B * kv_len, device=device), kv_len)
        k_index = torch.arange(B * kv_len, device=device).view(B, 1, 1, kv_len)  # flat rows b * kv_len + position
        same_rows = not self.causal and self.window is None
        first = kv_len - (1 if same_rows else q_len)
        q_index = k_index[..., first:].transpose(-1, -2)
        return self.predicate(real, positions)(q_index, k_index)

    def mask_mod(self, q_len: int, kv_len: int) -> Callable[..., torch.Tensor]:
        """This mask as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` over ``q_len`` queries (the last of
        ``kv_len`` positions) and ``kv_len`` keys: the same predicate as :meth:`allowed`."""
        offset = kv_len - q_len
        B = 1 if self.padding is None else self.padding.shape[0]
        device = torch.device("cpu") if self.padding is None else self.padding.device
        predicate = self.predicate(*self.rows(torch.arange(B * kv_len, device=device), kv_len))

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            base = b * kv_len if self.padding is not None else 0  # flat rows b * kv_len + position
            return predicate(base + q_idx + offset, base + kv_idx)

        return mask_mod

    @classmethod
    def from_allowed(cls, allowed: torch.Tensor) -> AttentionMask:
        """Read a dense boolean mask (B, Lq, n), True = may attend, as key padding, optionally with causal
        order (lower-right aligned); ``ValueError`` for any other pattern (a sliding window, packed sequences, a
        custom mask). The one place where a keep mask becomes a padding mask."""
        if allowed.dim() != 3 or allowed.dtype != torch.bool:
            raise ValueError(f"allowed must be a (B, Lq, n) bool tensor; got {tuple(allowed.shape)} {allowed.dtype}")
        keys = allowed[:, -1, :]  # the last query sees every real key in both patterns
        padding = None if bool(keys.all()) else ~keys
        q_len, kv_len = allowed.shape[1:]
        for causal in ((True, False) if q_len > 1 else (False,)):
            mask = cls(padding, causal)
            if torch.equal(allowed, mask.allowed(q_len, kv_len, allowed.device)[:, 0].expand_as(allowed)):
                return mask
        raise ValueError("the mask is neither key padding nor key padding + causal (a sliding-window, "
                         "packed-sequence or custom mask)")


NO_MASK = AttentionMask()  # no padding, no causal order, no window: what an op reads when given no mask
CAUSAL_MASK = AttentionMask(causal=True)  # causal order alone: what a causal op reads when given no mask


def check_mask(mask: AttentionMask | None, batch: int, length: int, *, device: torch.device | None = None,
               name: str = "mask") -> AttentionMask:
    """``mask`` checked for ``batch`` sequences of ``length`` keys: an :class:`AttentionMask` whose padding is None
    or (batch, length) (on ``device``), returned as it is; None is :data:`NO_MASK`. ``ValueError`` naming ``name``."""
    if mask is None:
        return NO_MASK
    if not isinstance(mask, AttentionMask):
        raise ValueError(f"{name} must be an AttentionMask or None, got {type(mask).__name__} (a key padding "
                         "tensor becomes one at the layer: AttentionMask(key_padding_mask, causal))")
    if mask.padding is not None:
        if tuple(mask.padding.shape) != (batch, length):
            raise ValueError(f"{name}'s padding must have shape (batch, length) = {(batch, length)}, got "
                             f"{tuple(mask.padding.shape)}")
        if device is not None and mask.padding.device != device:
            raise ValueError(f"{name}'s padding is on {mask.padding.device} but the input is on {device}")
    return mask


# ----------------------------------------------------------------------------------------------- the rule
def allow_empty_rows(allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """allowed (..., Nq, Nk) bool -> (the mask to give the softmax, (..., Nq, Nk); the rows without an allowed
    key, (..., Nq, 1), whose outputs the caller zeroes)."""
    no_key = ~allowed.any(-1, keepdim=True)
    return allowed | no_key, no_key


def masked_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, *, dropout_p: float = 0.0,
    scale: float | None = None, enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with a boolean ``allowed`` mask (broadcastable to (..., Nq, Nk)) and
    the rule of this module: zeros for a query with no allowed key. ``enable_gqa``: k and v have fewer heads than
    q (grouped-query attention; SDPA reads each key/value head for its group of query heads)."""
    mask, no_key = allow_empty_rows(allowed)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                         enable_gqa=enable_gqa)
    return out.masked_fill(no_key, 0.0)


def cache_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, *,
               scale: float | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Dense attention of q (B, H, Lq, D), the last Lq positions of a cache, on the cache k, v (B, Hkv, n, D)
    (H a multiple of Hkv: grouped-query attention without repeating the cache) under ``mask``
    (:meth:`AttentionMask.allowed`), with the rule for a query without keys. No mask is built where SDPA's own
    ``is_causal`` says the same."""
    Lq, n = q.shape[-2], k.shape[-2]
    gqa = q.shape[1] != k.shape[1]
    causal = mask.causal and Lq > 1  # the last position sees every earlier key
    if mask.padding is None and mask.window is None and (not causal or Lq == n):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale,
                                              enable_gqa=gqa)
    return masked_sdpa(q, k, v, mask.allowed(Lq, n, q.device), dropout_p=dropout_p, scale=scale, enable_gqa=gqa)
