"""Key/value caches for incremental (autoregressive) decoding by the strictly causal mechanisms.

A strictly causal mechanism's output at position t depends on tokens 0..t only, and a prefix gives the same
outputs alone as inside a longer sequence, so a new token's output can be computed from a cache of what
the earlier tokens left behind. Three caches cover the family:

* :class:`KVCache` -- every key and value so far (full attention). A step costs O(t) per token and head.
* :class:`GroupRingCache` -- per group (cluster, bucket), a ring of that group's *last* ``(look_back + 1) *
  chunk_size`` keys and values (neural clustering, LSH, routing, k-means under ``causal=True``). Under the
  strictly causal chunking (:func:`clusterformer.ops.cluster_causal_layout`) token t of group c, with r
  earlier tokens in c, sits in chunk ``r // w`` of its group and sees the tokens of c with rank in
  ``[(r // w - look_back) w, r]``: at most ``(look_back + 1) w`` keys, all in the ring. A step costs
  O((look_back + 1) w) per token, head and round -- independent of t -- and so does the cache's memory.
* :class:`WindowCache` -- the last ``window`` keys and values (sliding windows of ``window`` every
  ``stride``; a token is in at most ceil(window / stride) windows, its output the mean over them).
* :class:`LocalBlockCache` -- the last two blocks of keys and values with each token's group and rank: the local
  part of neural clustering's ``local_window``, joined with a :class:`GroupRingCache` by :class:`JoinedCache`.

Every cache holds tensors with the batch first and ``lengths`` (B,), the tokens each sequence has cached;
:meth:`select` reorders or repeats sequences (beam search). Caches are updated in place by the steps that
take them (and returned, for a functional style); they hold no autograd graph (decoding is inference).

Batches of different lengths: a prompt batch is right-padded (its mask's padding True at the end of
shorter sequences; every ``from_prompt`` takes the prompt's :class:`~clusterformer.masks.AttentionMask`, or
None); each sequence's next token goes to its own position, ``lengths[b]``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..masks import NO_MASK, AttentionMask
from .layouts import group_ranks
from .selected_ranking import group_extremes, top_groups, upper_bounds

__all__ = ["DecodeCache", "GroupRingCache", "JoinedCache", "KVCache", "LocalBlockCache", "MemberScoreCache",
           "WindowCache", "attend_allowed", "check_right_padded", "merge_attention"]


def _lengths(mask: AttentionMask | None, batch: int, length: int, device: torch.device) -> torch.Tensor:
    """Each prompt's real tokens, (batch,) long (:meth:`AttentionMask.lengths`; ``length`` for all without a mask)."""
    return (NO_MASK if mask is None else mask).lengths(batch, length, device)


def check_right_padded(mask: AttentionMask | None) -> None:
    """Cached decoding appends each sequence's next token after its last real one: the padding of ``mask`` (an
    :class:`AttentionMask`, or None) must come last."""
    if mask is None or mask.padding is None or mask.padding.shape[1] == 0:
        return
    pad = mask.padding.long()
    if bool((pad[:, 1:] < pad[:, :-1]).any()):
        raise ValueError("key_padding_mask must mark right padding only (real tokens first, padding after them) "
                         "for a prompt to be continued by cached decoding")


def attend_allowed(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor,
                   scale: float, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per row against its own keys. q (..., D), keys/values (..., S, D), allowed (..., S) bool, bias
    (..., S) added to the scaled scores. Returns (out (..., D), log-sum-exp of the scores (...,)); a row with no
    allowed key gets out 0 and lse -inf (what :func:`merge_attention` reads as an empty set)."""
    scores = (keys @ (q * scale).unsqueeze(-1)).squeeze(-1)  # (..., S)
    if bias is not None:
        scores = scores + bias.masked_fill(~allowed, 0.0)
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0).unsqueeze(-1))  # empty row: exp(-inf) = 0
    return (weights.unsqueeze(-2) @ values).squeeze(-2), lse


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
                    ) -> torch.Tensor:
    """One softmax over two disjoint key sets from each set's output (..., D) and log-sum-exp (...): the outputs
    weighted by exp(lse) and renormalised. A set without keys has lse = -inf and weight 0."""
    top = torch.maximum(lse_a, lse_b)
    top = top.masked_fill(torch.isinf(top), 0.0)  # no key in either set: both weights zero, output zero
    w_a, w_b = torch.exp(lse_a - top).unsqueeze(-1), torch.exp(lse_b - top).unsqueeze(-1)
    return (out_a * w_a + out_b * w_b) / (w_a + w_b).clamp(min=torch.finfo(out_a.dtype).tiny)


@dataclass
class DecodeCache:
    """Base of the caches: tensor fields with the batch first, and ``lengths`` (B,) cached tokens."""

    lengths: torch.Tensor

    def select(self, index: torch.Tensor) -> DecodeCache:
        """A cache whose sequence i is this cache's sequence ``index[i]`` (reorder, drop or repeat: beam search)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return type(self)(**{name: value.index_select(0, index) if isinstance(value, torch.Tensor) else value
                             for name, value in fields.items()})

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def reserve(self, tokens: int) -> None:
        """Make room for ``tokens`` more steps of every sequence, so that those steps read no host value and
        allocate nothing (what capturing a step in a CUDA graph needs). The fixed-size caches need nothing;
        :class:`KVCache` overrides it."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")

    def memory_bytes(self) -> int:
        """Bytes held by the cache's tensors."""
        return sum(v.numel() * v.element_size() for f in dataclasses.fields(self)
                   if isinstance(v := getattr(self, f.name), torch.Tensor))


# ------------------------------------------------------------------------------------------------ full
@dataclass
class KVCache(DecodeCache):
    """Every key and value so far: keys/values (B, H, capacity, D); slots >= lengths[b] are unused.
    The capacity doubles when full, so appending is amortised O(1) copies per token. After :meth:`reserve`
    the capacity is fixed: a step reads every slot under a mask and no host value (a static cache, as
    CUDA-graph decoding needs) until the reserved room is used; stepping beyond it is the caller's error."""

    keys: torch.Tensor
    values: torch.Tensor
    static: bool = False  # set by reserve(): fixed capacity, no host read per step

    @classmethod
    def from_prompt(cls, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None) -> KVCache:
        """k, v (B, H, N, D) of a right-padded prompt batch under ``mask``."""
        B, _, N, _ = k.shape
        lengths = _lengths(mask, B, N, k.device)
        capacity = max(16, 2 * N)
        keys = k.new_zeros(*k.shape[:2], capacity, k.shape[-1])
        values = v.new_zeros(*v.shape[:2], capacity, v.shape[-1])
        keys[:, :, :N], values[:, :, :N] = k, v
        return cls(lengths, keys, values)

    def reserve(self, tokens: int) -> None:
        """Fix the capacity at the longest sequence plus ``tokens`` (one copy now, none per step)."""
        super().reserve(tokens)
        capacity = int(self.lengths.max()) + tokens
        if capacity != self.keys.shape[2]:
            keep = min(capacity, self.keys.shape[2])
            keys = self.keys.new_zeros(*self.keys.shape[:2], capacity, self.keys.shape[-1])
            values = torch.zeros_like(keys)
            keys[:, :, :keep], values[:, :, :keep] = self.keys[:, :, :keep], self.values[:, :, :keep]
            self.keys, self.values = keys, values
        self.static = True

    def append(self, k_t: torch.Tensor, v_t: torch.Tensor) -> None:
        """k_t, v_t (B, H, D): each sequence's new key and value, at its own position ``lengths[b]``."""
        B = self.batch_size
        if not self.static and int(self.lengths.max()) + 1 > self.keys.shape[2]:
            grow = self.keys.shape[2]
            self.keys = torch.cat([self.keys, torch.zeros_like(self.keys[:, :, :grow])], dim=2)
            self.values = torch.cat([self.values, torch.zeros_like(self.values[:, :, :grow])], dim=2)
        batch = torch.arange(B, device=k_t.device)
        self.keys[batch, :, self.lengths] = k_t
        self.values[batch, :, self.lengths] = v_t
        self.lengths += 1  # in place: a captured step advances the cache it was captured on

    def attend(self, q_t: torch.Tensor) -> torch.Tensor:
        """q_t (B, H, D) against every cached key of its sequence -> (B, H, D) (after :meth:`append`)."""
        used = self.keys.shape[2] if self.static else int(self.lengths.max())
        allowed = torch.arange(used, device=q_t.device) < self.lengths.unsqueeze(1)  # (B, used)
        out, _ = attend_allowed(q_t, self.keys[:, :, :used], self.values[:, :, :used], allowed.unsqueeze(1),
                                q_t.shape[-1] ** -0.5)
        return out


# ------------------------------------------------------------------------------------------ group rings
@dataclass
class GroupRingCache(DecodeCache):
    """Per (sequence, stream, group) the last ``slots = (look_back + 1) * chunk_size`` members' keys and values.

    A *stream* is what has its own grouping: a head and hash round for the shared-QK mechanisms, the whole
    token for neural clustering (whose groups are shared by the heads: features (H, D)).

    Attributes:
        keys, values: (B, X, G, capacity, *features); the member of rank r sits in slot r % capacity.
        ranks: (B, X, G, capacity) long, the rank in its group of the member in each slot, -1 for none.
        counts: (B, X, G) long, members of each group so far.
        chunk_size, look_back: the strictly causal chunking (w and the look-back in chunks).

    The capacity starts at what the largest group needs (a power of two) and doubles as groups grow, up to
    ``(look_back + 1) * chunk_size``; only then does the ring wrap. Short sequences (translation, beam search,
    whose every step reorders the cache) so hold and copy only what they use.
    """

    keys: torch.Tensor
    values: torch.Tensor
    ranks: torch.Tensor
    counts: torch.Tensor
    chunk_size: int
    look_back: int

    @property
    def slots(self) -> int:
        """Slots per group now (the capacity)."""
        return self.ranks.shape[-1]

    @property
    def ring_size(self) -> int:
        """The most slots a group needs: a token sees members of rank >= (r // w - look_back) w only."""
        return (self.look_back + 1) * self.chunk_size

    def _grow(self) -> None:
        """Double the capacity (up to the ring size) before a group's next member would overwrite a slot: below the
        ring size no group has wrapped (rank r sits in slot r), so the slots keep their places."""
        grow = min(self.slots, self.ring_size - self.slots)
        self.keys = torch.cat([self.keys, torch.zeros_like(self.keys[:, :, :, :grow])], dim=3)
        self.values = torch.cat([self.values, torch.zeros_like(self.values[:, :, :, :grow])], dim=3)
        self.ranks = torch.cat([self.ranks, torch.full_like(self.ranks[..., :grow], -1)], dim=3)

    @classmethod
    def from_prompt(cls, ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None,
                    num_groups: int, chunk_size: int, look_back: int) -> GroupRingCache:
        """ids (B, X, N) in [0, num_groups); k, v (B, X, N, *features) of a right-padded prompt batch: each
        group's last ``slots`` members (padding is no member)."""
        B, X, N = ids.shape
        device = ids.device
        features = k.shape[3:]
        ring = (look_back + 1) * chunk_size
        if mask is not None and mask.padding is not None:
            ids = ids.masked_fill(mask.padding[:, None, :], num_groups)  # padding: an extra group, dropped
        rank, counts = group_ranks(ids.reshape(B * X, N), num_groups + 1)  # rank: earlier members
        rank, counts = rank.view(B, X, N), counts.view(B, X, num_groups + 1)[..., :num_groups]  # (B, X, G)
        largest = int(counts.max()) if counts.numel() else 0
        slots = min(ring, 1 << max(largest, 1).bit_length())  # room for the next member of the largest group
        kept = ids < num_groups
        kept &= rank >= counts.gather(2, ids.clamp(max=num_groups - 1)) - slots  # a group's last `slots` only
        where = kept.nonzero(as_tuple=True)  # (b, x, n) of the members that stay
        g, slot = ids[where], rank[where] % slots
        keys = k.new_zeros(B, X, num_groups, slots, *features)
        values = v.new_zeros(B, X, num_groups, slots, *features)
        ranks = torch.full((B, X, num_groups, slots), -1, dtype=torch.long, device=device)
        keys[where[0], where[1], g, slot] = k[where]
        values[where[0], where[1], g, slot] = v[where]
        ranks[where[0], where[1], g, slot] = rank[where]
        lengths = _lengths(mask, B, N, device)
        return cls(lengths, keys, values, ranks, counts, chunk_size, look_back)

    def append(self, ids_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Add each stream's new token to its group: ids_t (B, X), k_t / v_t (B, X, *features).

        Returns the token's window -- keys and values (B, X, slots, *features) of its group and ``allowed``
        (B, X, slots), the members of rank in [(r // w - look_back) w, r] -- and its own slot (B, X)."""
        B, X = ids_t.shape
        b = torch.arange(B, device=ids_t.device).unsqueeze(1)
        x = torch.arange(X, device=ids_t.device)
        rank = self.counts[b, x, ids_t]  # (B, X): earlier members of the token's group
        if self.slots < self.ring_size and int(rank.max()) >= self.slots:
            self._grow()
        slot = rank % self.slots
        self.keys[b, x, ids_t, slot] = k_t
        self.values[b, x, ids_t, slot] = v_t
        self.ranks[b, x, ids_t, slot] = rank
        self.counts[b, x, ids_t] += 1
        self.lengths += 1  # in place, as every update of a full ring: a CUDA graph of the step replays on this memory
        member = self.ranks[b, x, ids_t]  # (B, X, slots)
        first = (torch.div(rank, self.chunk_size, rounding_mode="floor") - self.look_back) * self.chunk_size
        allowed = (member >= first.unsqueeze(-1)) & (member >= 0) & (member <= rank.unsqueeze(-1))
        return self.keys[b, x, ids_t], self.values[b, x, ids_t], allowed, slot


# ---------------------------------------------------------------------------------------- sliding windows
@dataclass
class WindowCache(DecodeCache):
    """The last ``window`` keys and values: (B, H, window, D), position p in slot p % window."""

    keys: torch.Tensor
    values: torch.Tensor
    window: int
    stride: int

    @classmethod
    def from_prompt(cls, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None,
                    window: int, stride: int) -> WindowCache:
        B, H, N, D = k.shape
        lengths = _lengths(mask, B, N, k.device)
        # slot s holds the latest position p < L_b with p = s (mod window), if any
        s = torch.arange(window, device=k.device)
        last = lengths.unsqueeze(1) - 1
        position = last - (last - s) % window  # (B, window)
        valid = position >= 0
        index = position.clamp(min=0)[:, None, :, None].expand(B, H, window, D)
        keys = k.gather(2, index.clamp(max=max(N - 1, 0))) if N else k.new_zeros(B, H, window, D)
        values = v.gather(2, index.clamp(max=max(N - 1, 0))) if N else v.new_zeros(B, H, window, D)
        keep = valid[:, None, :, None]
        return cls(lengths, keys * keep, values * keep, window, stride)

    def append_and_attend(self, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor) -> torch.Tensor:
        """q_t, k_t, v_t (B, H, D) at position t = lengths[b] -> (B, H, D): the mean over the windows (starts
        j * stride with t - window < j * stride <= t) of attention to the keys from the window's start to t."""
        B, _, D = q_t.shape
        t = self.lengths.clone()  # (B,)
        batch = torch.arange(B, device=q_t.device)
        slot = t % self.window
        self.keys[batch, :, slot] = k_t
        self.values[batch, :, slot] = v_t
        self.lengths += 1  # in place (a CUDA graph of the step replays on this memory)
        s = torch.arange(self.window, device=q_t.device)
        position = t.unsqueeze(1) - (t.unsqueeze(1) - s) % self.window  # (B, window), <= t
        most = -(-self.window // self.stride)  # windows holding a token: at most ceil(window / stride)
        start = (torch.div(t, self.stride, rounding_mode="floor").unsqueeze(1)
                 - torch.arange(most, device=q_t.device)) * self.stride  # (B, most)
        used = (start >= 0) & (start > t.unsqueeze(1) - self.window)
        allowed = (position.unsqueeze(1) >= start.unsqueeze(-1)) & (position >= 0).unsqueeze(1)  # (B, most, window)
        out, _ = attend_allowed(q_t.unsqueeze(2), self.keys.unsqueeze(2), self.values.unsqueeze(2),
                                allowed.unsqueeze(1), D ** -0.5)  # (B, H, most, D)
        weight = used.to(out.dtype)[:, None, :, None]
        return (out * weight).sum(2) / weight.sum(2)


# ------------------------------------------------------------------------------------- local blocks (joined)
@dataclass
class LocalBlockCache(DecodeCache):
    """The last ``2 * block`` tokens: keys/values (B, 2 block, H, D), position p in slot p % (2 block), with each
    token's position, group and rank in its group ((B, 2 block) long, -1 for an empty slot).

    A query at position t sees the keys of its position block (t // block) and the one before, up to itself: at
    most 2 block positions, all in the ring. Beside a group ring, the keys its group window already holds are left
    out here (same group, rank >= the window's first rank), so that the two parts hold each key once."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    groups: torch.Tensor
    ranks: torch.Tensor
    block: int

    @classmethod
    def from_prompt(cls, k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor, mask: AttentionMask | None,
                    block: int) -> LocalBlockCache:
        """k, v (B, N, H, D) and the groups ids (B, N) of a right-padded prompt batch under ``mask``."""
        B, N = ids.shape
        span = 2 * block
        lengths = _lengths(mask, B, N, ids.device)
        top = int(ids.max()) + 1 if ids.numel() else 1
        padding = None if mask is None else mask.padding
        groups = ids if padding is None else ids.masked_fill(padding, top)  # padding: a group
        rank, _ = group_ranks(groups, top + 1)
        s = torch.arange(span, device=ids.device)
        last = lengths.unsqueeze(1) - 1
        position = last - (last - s) % span  # (B, span): the latest position p < L_b with p = s (mod span)
        valid = position >= 0
        index = position.clamp(min=0, max=max(N - 1, 0))
        if N == 0:
            empty = k.new_zeros(B, span, *k.shape[2:])
            return cls(lengths, empty, empty.clone(), position.masked_fill(~valid, -1),
                       torch.full_like(position, -1), torch.full_like(position, -1), block)
        gather = index[:, :, None, None].expand(B, span, *k.shape[2:])
        keep = valid[:, :, None, None]
        return cls(lengths, k.gather(1, gather) * keep, v.gather(1, gather) * keep, position.masked_fill(~valid, -1),
                   ids.gather(1, index).masked_fill(~valid, -1), rank.gather(1, index).masked_fill(~valid, -1), block)

    def append_and_attend(self, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, group_t: torch.Tensor,
                          rank_t: torch.Tensor, first_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q_t, k_t, v_t (B, H, D) at position t = lengths[b], its group and rank (B,), and the first rank of its
        group window (B,) -> (out (B, H, D), log-sum-exp (B, H)) over its local keys outside the group window."""
        B, H, D = q_t.shape
        t = self.lengths.clone()
        batch = torch.arange(B, device=q_t.device)
        slot = t % (2 * self.block)
        self.keys[batch, slot], self.values[batch, slot] = k_t, v_t
        self.positions[batch, slot], self.groups[batch, slot], self.ranks[batch, slot] = t, group_t, rank_t
        self.lengths += 1  # in place (a CUDA graph of the step replays on this memory)
        start = (torch.div(t, self.block, rounding_mode="floor") - 1) * self.block
        in_blocks = (self.positions >= start.unsqueeze(1)) & (self.positions >= 0)  # (B, span), all <= t
        in_group_window = (self.groups == group_t.unsqueeze(1)) & (self.ranks >= first_t.unsqueeze(1))
        allowed = in_blocks & ~in_group_window
        out, lse = attend_allowed(q_t, self.keys.transpose(1, 2), self.values.transpose(1, 2),
                                  allowed.unsqueeze(1).expand(B, H, -1), D ** -0.5)
        no_key = ~allowed.any(-1, keepdim=True)  # every local key is in the group window (the token itself is)
        return out.masked_fill(no_key.unsqueeze(-1), 0.0), lse.masked_fill(no_key, float("-inf"))


@dataclass
class JoinedCache(DecodeCache):
    """A group ring and what neural clustering keeps beside it: the local blocks (``local_window``), and/or the
    state of the prefix assignment (``causal_assign="prefix"``): ``assign_lse`` (B, k), each centroid's log-sum-exp
    of its scores over the cached real tokens."""

    groups: GroupRingCache
    local: LocalBlockCache | None = None
    assign_lse: torch.Tensor | None = None

    def select(self, index: torch.Tensor) -> JoinedCache:
        return JoinedCache(self.lengths.index_select(0, index), self.groups.select(index),
                           None if self.local is None else self.local.select(index),
                           None if self.assign_lse is None else self.assign_lse.index_select(0, index))

    def memory_bytes(self) -> int:
        return (self.groups.memory_bytes() + (0 if self.local is None else self.local.memory_bytes())
                + (0 if self.assign_lse is None else self.assign_lse.numel() * self.assign_lse.element_size()))


# ------------------------------------------------------------------------------------------ cluster selection
@dataclass
class SelectionCache(DecodeCache):
    """``"cluster-select"``: per (sequence, head) the last ``window`` keys/values with their clusters, and per
    cluster the last ``cluster_keys`` members that have left the window -- all that a query at the next position
    can read (:mod:`clusterformer.ops.selected`). Position p sits in window slot p % window; a cluster's member of
    rank r in slot r % cluster_keys. The sums of every member that left the window give the cluster summaries
    (``summaries=True``): the ring's members taken out for a selected cluster.

    Attributes:
        window_keys, window_values: (B, H, window, D); window_ids: (B, H, window) long cluster ids, -1 for none.
        ring_keys, ring_values: (B, H, C, cluster_keys, D); counts: (B, H, C) long, members that left the window.
        key_sums, value_sums: (B, H, C, D), sums over the members that left the window.
        bound_hi, bound_lo: with ``bound_block`` (selection="bound"), (B, H, C, D) channel-wise max and min of the
            members in the whole blocks of bound_block positions that left the window; pending_hi, pending_lo: of
            the members that left it from the block not yet whole, merged into the bounds when it is
            (:func:`clusterformer.ops.selected_ranking.bound_logits`, one position). None without ``bound_block``.
    """

    window_keys: torch.Tensor
    window_values: torch.Tensor
    window_ids: torch.Tensor
    ring_keys: torch.Tensor
    ring_values: torch.Tensor
    counts: torch.Tensor
    key_sums: torch.Tensor
    value_sums: torch.Tensor
    bound_hi: torch.Tensor | None = None
    bound_lo: torch.Tensor | None = None
    pending_hi: torch.Tensor | None = None
    pending_lo: torch.Tensor | None = None
    bound_block: int = 0

    @classmethod
    def from_prompt(cls, ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None,
                    num_clusters: int, cluster_keys: int, window: int, bound_block: int = 0) -> SelectionCache:
        """ids (B, H, N) key clusters; k, v (B, H, N, D) of a right-padded prompt batch; ``bound_block``: keep the
        bounds of selection="bound" over blocks of that many positions (0: none)."""
        B, H, N, D = k.shape
        device = k.device
        lengths = _lengths(mask, B, N, device)
        position = torch.arange(N, device=device)
        real = position < lengths.unsqueeze(1)  # (B, N)
        in_window = (real & (position >= (lengths - window).unsqueeze(1)))[:, None, :].expand(B, H, N)
        gone = (real & ~in_window[:, 0])[:, None, :].expand(B, H, N)  # positions < L - window
        window_keys, window_values = k.new_zeros(B, H, window, D), v.new_zeros(B, H, window, D)
        window_ids = torch.full((B, H, window), -1, dtype=torch.long, device=device)
        b, h, n = in_window.nonzero(as_tuple=True)
        window_keys[b, h, n % window], window_values[b, h, n % window] = k[b, h, n], v[b, h, n]
        window_ids[b, h, n % window] = ids[b, h, n]
        grouped = ids.masked_fill(~gone, num_clusters)  # the window and padding: an extra group, dropped
        rank, counts = group_ranks(grouped.reshape(B * H, N), num_clusters + 1)
        rank, counts = rank.view(B, H, N), counts.view(B, H, num_clusters + 1)[..., :num_clusters]
        kept = gone & (rank >= counts.gather(2, grouped.clamp(max=num_clusters - 1)) - cluster_keys)
        b, h, n = kept.nonzero(as_tuple=True)
        c, slot = grouped[b, h, n], rank[b, h, n] % cluster_keys
        ring_keys, ring_values = k.new_zeros(B, H, num_clusters, cluster_keys, D), v.new_zeros(
            B, H, num_clusters, cluster_keys, D)
        ring_keys[b, h, c, slot], ring_values[b, h, c, slot] = k[b, h, n], v[b, h, n]
        members = F.one_hot(grouped, num_clusters + 1)[..., :num_clusters].to(k.dtype)  # (B, H, N, C), gone only
        key_sums, value_sums = members.transpose(2, 3) @ k, members.transpose(2, 3) @ v
        bounds = {}
        if bound_block:  # the next query's whole blocks: positions < block floor((lengths - window) / block)
            blocks = torch.div(lengths - window, bound_block, rounding_mode="floor")
            whole = position < (blocks * bound_block).unsqueeze(1)
            for name, part in (("bound", gone & whole[:, None, :]), ("pending", gone & ~whole[:, None, :])):
                bounds[f"{name}_hi"], bounds[f"{name}_lo"] = group_extremes(k, ids.masked_fill(~part, num_clusters),
                                                                              num_clusters)
        return cls(lengths, window_keys, window_values, window_ids, ring_keys, ring_values, counts, key_sums,
                   value_sums, **bounds, bound_block=bound_block)

    def append(self, k_t: torch.Tensor, v_t: torch.Tensor, id_t: torch.Tensor) -> None:
        """The token at position ``lengths``: the key leaving the window moves to its cluster's ring (and sums), the
        new one, k_t, v_t (B, H, D) of cluster id_t (B, H), enters the window."""
        B, H, W = self.window_keys.shape[:3]
        w = self.ring_keys.shape[3]
        b = torch.arange(B, device=k_t.device)[:, None]
        h = torch.arange(H, device=k_t.device)[None, :]
        out_slot = (self.lengths % W)[:, None].expand(B, H)  # the slot of position t - W, which t takes over
        leaving = self.window_ids[b, h, out_slot]  # (B, H), -1 while the window is not full
        moves = leaving >= 0
        c = leaving.clamp(min=0)
        rank = self.counts[b, h, c]
        ring_slot = rank % w
        keep_k, keep_v = self.ring_keys[b, h, c, ring_slot], self.ring_values[b, h, c, ring_slot]
        self.ring_keys[b, h, c, ring_slot] = torch.where(moves[..., None], self.window_keys[b, h, out_slot], keep_k)
        self.ring_values[b, h, c, ring_slot] = torch.where(moves[..., None], self.window_values[b, h, out_slot],
                                                           keep_v)
        self.counts[b, h, c] = rank + moves.long()
        gone = moves[..., None].to(k_t.dtype)
        self.key_sums[b, h, c] += gone * self.window_keys[b, h, out_slot]
        self.value_sums[b, h, c] += gone * self.window_values[b, h, out_slot]
        if self.bound_block:  # the leaving key joins its group's pending block; a whole block joins the bounds
            leaving_key = self.window_keys[b, h, out_slot]
            hi, lo = self.pending_hi[b, h, c], self.pending_lo[b, h, c]
            self.pending_hi[b, h, c] = torch.where(moves[..., None], torch.maximum(hi, leaving_key), hi)
            self.pending_lo[b, h, c] = torch.where(moves[..., None], torch.minimum(lo, leaving_key), lo)
            whole = ((self.lengths - W + 1) % self.bound_block == 0).view(B, 1, 1, 1)  # position t - W ends a block
            self.bound_hi.copy_(torch.where(whole, torch.maximum(self.bound_hi, self.pending_hi), self.bound_hi))
            self.bound_lo.copy_(torch.where(whole, torch.minimum(self.bound_lo, self.pending_lo), self.bound_lo))
            self.pending_hi.masked_fill_(whole, float("-inf"))
            self.pending_lo.masked_fill_(whole, float("inf"))
        self.window_keys[b, h, out_slot], self.window_values[b, h, out_slot] = k_t, v_t
        self.window_ids[b, h, out_slot] = id_t
        self.lengths += 1  # in place (a CUDA graph of the step replays on this memory)

    def summaries(self, selected: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per cluster, the mean key and value (B, H, C, D) of the members that left the window, less the ring of
        each ``selected`` (B, H, S) cluster (read alone; ``None``: nothing taken out), and log n (B, H, C), -inf
        where n = 0 (:func:`clusterformer.ops.selected_layout.cluster_summaries`, one position)."""
        key_sums, value_sums, count = self.key_sums, self.value_sums, self.counts
        if selected is not None:
            w = self.ring_keys.shape[3]
            taken = torch.zeros_like(count).scatter(-1, selected, 1).bool()  # (B, H, C)
            key_sums = key_sums - self.ring_keys.sum(3) * taken[..., None]  # unfilled ring slots hold zeros
            value_sums = value_sums - self.ring_values.sum(3) * taken[..., None]
            count = count - count.clamp(max=w) * taken
        n = count.clamp(min=1).unsqueeze(-1).to(key_sums.dtype)
        log_n = torch.where(count > 0, count.clamp(min=1).to(key_sums.dtype).log(), float("-inf"))
        return key_sums / n, value_sums / n, log_n

    def summary_selection(self, q_t: torch.Tensor, select: int, by_cluster: int = 0, groups: int | None = None
                          ) -> torch.Tensor:
        """The ``select`` clusters (B, H, S) whose summary of every member outside the window has the largest logit
        for q_t (B, H, D) (:func:`clusterformer.ops.selected_ranking.summary_selection`; ``by_cluster``: its groups'
        clusters first), among the first ``groups`` (None: all)."""
        keys, _, log_n = self.summaries(None)
        logits = (keys @ (q_t * q_t.shape[-1] ** -0.5).unsqueeze(-1)).squeeze(-1) + log_n
        return top_groups(logits[..., :groups], select, by_cluster)

    def bound_selection(self, q_t: torch.Tensor, select: int, by_cluster: int = 0, groups: int | None = None
                        ) -> torch.Tensor:
        """The ``select`` groups (B, H, S) of largest upper bound q+ . hi + q- . lo / sqrt(D) over their members in
        the whole blocks outside the window, for q_t (B, H, D)
        (:func:`clusterformer.ops.selected_ranking.bound_logits`), among the first ``groups`` (None: all)."""
        if not self.bound_block:
            raise ValueError("this cache keeps no bounds: build it with bound_block > 0 (selection='bound')")
        logits = upper_bounds((q_t * q_t.shape[-1] ** -0.5).unsqueeze(-2), self.bound_hi, self.bound_lo)
        return top_groups(logits.squeeze(-2)[..., :groups], select, by_cluster)

    def attend(self, q_t: torch.Tensor, selected: torch.Tensor, summaries: bool = False) -> torch.Tensor:
        """q_t (B, H, D) reads its window and the rings of ``selected`` (B, H, S) clusters (and, with
        ``summaries``, every cluster's summary of the rest). Returns (B, H, D)."""
        B, H, _, D = self.window_keys.shape
        w = self.ring_keys.shape[3]
        b = torch.arange(B, device=q_t.device)[:, None]
        h = torch.arange(H, device=q_t.device)[None, :]
        S = selected.shape[-1]
        keys = torch.cat([self.ring_keys[b[..., None], h[..., None], selected].reshape(B, H, S * w, D),
                          self.window_keys], dim=2)
        values = torch.cat([self.ring_values[b[..., None], h[..., None], selected].reshape(B, H, S * w, D),
                            self.window_values], dim=2)
        filled = torch.arange(w, device=q_t.device) < self.counts[b[..., None], h[..., None], selected].unsqueeze(-1)
        allowed = torch.cat([filled.reshape(B, H, S * w), self.window_ids >= 0], dim=2)
        out, lse = attend_allowed(q_t, keys, values, allowed, D ** -0.5)
        if not summaries:
            return out
        summary_keys, summary_values, log_n = self.summaries(selected)
        out_s, lse_s = attend_allowed(q_t, summary_keys, summary_values, log_n > float("-inf"), D ** -0.5,
                                      bias=log_n)
        return merge_attention(out, lse, out_s, lse_s)


@dataclass
class MemberScoreCache(DecodeCache):
    """``"cluster-select"`` with ``members="score"``: a query reads each selected group's members of largest q . k
    outside its window, which may be any of them, so besides the :class:`SelectionCache` (window, ranking state)
    every key and value so far is kept (``store``, a :class:`KVCache`) with its group (``ids`` (B, H, capacity), -1
    for none). A step scores every cached key: O(t D) per head, as full attention's does, plus the selection's.

    ``lengths`` is the selection cache's own tensor (advanced in place by its append)."""

    selection: SelectionCache
    store: KVCache
    ids: torch.Tensor
    cluster_keys: int = 1

    @classmethod
    def from_prompt(cls, ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None,
                    num_clusters: int, cluster_keys: int, window: int, bound_block: int = 0) -> MemberScoreCache:
        """ids (B, H, N) key groups; k, v (B, H, N, D) of a right-padded prompt batch (:meth:`SelectionCache
        .from_prompt`'s arguments)."""
        selection = SelectionCache.from_prompt(ids, k, v, mask, num_clusters, cluster_keys, window,
                                               bound_block=bound_block)
        store = KVCache.from_prompt(k, v, mask)
        B, H, N = ids.shape
        real = torch.arange(N, device=ids.device) < selection.lengths.unsqueeze(1)  # (B, N)
        kept = torch.full((B, H, store.keys.shape[2]), -1, dtype=torch.long, device=ids.device)
        kept[:, :, :N] = ids.masked_fill(~real[:, None, :], -1)
        return cls(selection.lengths, selection, store, kept, cluster_keys)

    def select(self, index: torch.Tensor) -> MemberScoreCache:
        selection = self.selection.select(index)
        return MemberScoreCache(selection.lengths, selection, self.store.select(index), self.ids.index_select(0, index),
                                self.cluster_keys)

    def memory_bytes(self) -> int:
        return (self.selection.memory_bytes() + self.store.memory_bytes()
                + self.ids.numel() * self.ids.element_size())

    def reserve(self, tokens: int) -> None:
        self.store.reserve(tokens)
        self._fit_ids()

    def _fit_ids(self) -> None:
        """``ids`` as long as the store's capacity (it doubles, or is fixed by reserve)."""
        capacity = self.store.keys.shape[2]
        if self.ids.shape[2] != capacity:
            keep = min(capacity, self.ids.shape[2])
            ids = torch.full((*self.ids.shape[:2], capacity), -1, dtype=torch.long, device=self.ids.device)
            ids[:, :, :keep] = self.ids[:, :, :keep]
            self.ids = ids

    def append(self, k_t: torch.Tensor, v_t: torch.Tensor, id_t: torch.Tensor) -> None:
        """The token at position ``lengths``: k_t, v_t (B, H, D) of group id_t (B, H)."""
        position = self.lengths.clone()
        self.store.append(k_t, v_t)
        self._fit_ids()
        self.ids[torch.arange(self.batch_size, device=k_t.device), :, position] = id_t
        self.selection.append(k_t, v_t, id_t)  # advances lengths

    def summary_selection(self, q_t: torch.Tensor, select: int, by_cluster: int = 0, groups: int | None = None
                          ) -> torch.Tensor:
        return self.selection.summary_selection(q_t, select, by_cluster, groups)

    def bound_selection(self, q_t: torch.Tensor, select: int, by_cluster: int = 0, groups: int | None = None
                        ) -> torch.Tensor:
        return self.selection.bound_selection(q_t, select, by_cluster, groups)

    def attend(self, q_t: torch.Tensor, selected: torch.Tensor, summaries: bool = False) -> torch.Tensor:
        """q_t (B, H, D) reads its window and, from each ``selected`` (B, H, S) group, its ``cluster_keys`` members
        outside the window of largest q . k (equal scores: the later position first), in one softmax (after
        :meth:`append`). Returns (B, H, D)."""
        if summaries:
            raise ValueError("members='score' reads no summaries (cluster-select refuses the pair)")
        sel = self.selection
        B, _, W, D = sel.window_keys.shape
        used = self.store.keys.shape[2] if self.store.static else int(self.lengths.max())
        keys, values = self.store.keys[:, :, :used], self.store.values[:, :, :used]
        position = torch.arange(used, device=q_t.device)
        outside = position <= (self.lengths - 1 - W).view(B, 1, 1, 1)  # (B, 1, 1, used): p <= t - window
        candidate = (self.ids[:, :, :used].unsqueeze(2) == selected.unsqueeze(-1)) & outside  # (B, H, S, used)
        scores = (keys @ q_t.unsqueeze(-1)).squeeze(-1).unsqueeze(2)  # (B, H, 1, used)
        scores = scores.masked_fill(~candidate, float("-inf")).flip(-1)  # the later position first on ties
        order = scores.sort(dim=-1, descending=True, stable=True).indices[..., : self.cluster_keys]  # (B, H, S, <= Kc)
        found = scores.gather(-1, order) > float("-inf")
        chosen = (used - 1 - order).flatten(2)  # positions, (B, H, S * <= Kc)
        index = chosen.unsqueeze(-1).expand(-1, -1, -1, D)
        member_keys, member_values = keys.gather(2, index), values.gather(2, index)
        out, _ = attend_allowed(q_t, torch.cat([member_keys, sel.window_keys], dim=2),
                                torch.cat([member_values, sel.window_values], dim=2),
                                torch.cat([found.flatten(2), sel.window_ids >= 0], dim=2), D ** -0.5)
        return out
