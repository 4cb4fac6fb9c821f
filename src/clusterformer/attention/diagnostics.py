"""Which keys a query can see: the key-recall diagnostic of the recall tasks, for every registered mechanism.

The question, for a query at position i that needs the token at position s (an MQAR query and its value): is s
inside the set of keys i attends to, in each layer and head -- and with what weight?

One probe answers it for every mechanism without knowing how the mechanism groups tokens. The layer's input x is
run through the mechanism with a projection (:class:`_ValueProbe`) that computes queries and keys as usual, from
x *detached*, but passes x itself as the values (v = x, split into heads). Then the output at (i, head h, channel
c) is sum_j p^h_ij x_j[h, c], and its gradient with respect to x_s[h, c] is exactly p^h_is, the attention weight of
query i on key s in head h: zero when s is outside i's attended set (a masked or absent key contributes nothing),
positive inside it. Groupings (argmax, hashes, sorts) have no gradient, and queries and keys are detached, so
nothing else reaches x. One backward gives the weights of up to ``head_dim`` queries per sequence at once (query m
reads channel m mod head_dim); more queries take more passes.

Mechanisms whose queries are cluster centroids (``clustered``, ``improved-clustered``) attend to every key through
the centroid: the probe reports that as it is (a positive weight on s). The probe runs in float64 so that a weight
that float32 would round to zero counts as seen.
"""

from __future__ import annotations

import copy
import math
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

from .._checks import check_tensor
from ..masks import AttentionMask
from .base import AttentionLayer

__all__ = ["LogitSpy", "SourceWeights", "attention_rows", "attention_to_sources", "cache_rows", "key_recall",
           "logits_read", "step_logits"]


class _ValueProbe:
    """A :class:`~clusterformer.attention.base.QKVProjection`: the layer's own queries and keys from x detached,
    and x itself as the values."""

    def __init__(self, layer: AttentionLayer) -> None:
        self.layer = layer
        self.heads = layer.heads
        self.head_dim = layer.head_dim
        self.shared_qk = layer.shared_qk  # a mechanism that clusters its shared QK asks for it

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, _ = self.layer.qkv(x.detach())
        B, N, _ = x.shape
        return q, k, x.view(B, N, self.heads, self.head_dim).transpose(1, 2)

    def project_rows(self, rows: torch.Tensor, which: str) -> torch.Tensor:
        return rows if which == "v" else self.layer.project_rows(rows.detach(), which)


def attention_rows(
    layer: AttentionLayer, x: torch.Tensor, queries: torch.Tensor, key_padding_mask: torch.Tensor | None = None,
    causal: bool = False, flow: torch.Tensor | None = None,
) -> torch.Tensor:
    """The attention weights of the queries at positions ``queries`` (B, Q) over every key: (B, Q, H, N), float64.

    Args:
        layer: an attention layer (any registered mechanism), in the mode to probe (eval for a diagnostic).
        x: (B, N, dim) the layer's input.
        queries: (B, Q) long positions.
        key_padding_mask, causal, flow: as the layer is called.

    Row (b, m, h) is query ``queries[b, m]``'s weights in head h; a key outside its attended set has weight 0
    (a mechanism that averages several windows, as sliding-window, gives the average weight). The layer is
    copied and run in float64; the layer itself is left as it was (its generator state included)."""
    check_tensor("x", x, ndim=3, floating=True)
    B, N, _ = x.shape
    _check_positions("queries", queries, B, N)
    probe_layer = copy.deepcopy(layer).double()
    probe = _ValueProbe(probe_layer)
    H, D = layer.heads, layer.head_dim
    Q = queries.shape[1]
    weights = torch.zeros(B, Q, H, N, dtype=torch.float64)
    rows = torch.arange(B).unsqueeze(1)
    mask = AttentionMask(key_padding_mask, causal)  # the call's one mask, as the layer builds it
    for start in range(0, Q, D):  # passes of head_dim queries: ceil(Q / head_dim), not a loop over tokens
        m = torch.arange(start, min(Q, start + D))
        xd = x.detach().double().clone().requires_grad_(True)
        channel = m - start
        pick = channel.view(1, -1, 1, 1).expand(B, -1, H, 1)  # query m reads channel m - start
        with torch.enable_grad():  # also inside an evaluation's no_grad
            out, _ = probe_layer.inner.attend_hidden(
                xd, probe, mask, None if flow is None else flow.detach().double())  # (B, N, H, D)
            score = out[rows, queries[:, m]].gather(3, pick).sum()  # sum over b, h, m of out[b, q_m, h, c_m]
            (grad,) = torch.autograd.grad(score, xd)
        # grad[b, j, h, c_m] = weight of query m on key j in head h
        weights[:, m] = grad.view(B, N, H, D)[..., channel].permute(0, 3, 2, 1)
    return weights


class SourceWeights(NamedTuple):
    """What each query puts on the key it needs, per head: all (B, Q, H).

    ``weight`` (float64, in [0, 1]): the attention weight on it (zero: not in the attended set). ``argmax`` (bool):
    a needed key carries that row's largest weight, larger than every other key's. The second tells a key read *as
    the answer* from one merely inside the attended set -- a summary of many keys (cluster-select's ``summaries``,
    the centroid queries of clustered attention) gives every member a positive weight, and all members of a summary
    the same weight, so a member of the heaviest summary ties with its n - 1 companions and is not the argmax.
    ``coverage`` (float64, in [0, 1]): the share of the needed keys inside the attended set -- for a query that
    needs *all* of several keys (the histogram's count), what it can see of them; 1 or 0 for one needed key."""

    weight: torch.Tensor
    argmax: torch.Tensor
    coverage: torch.Tensor


def attention_to_sources(
    layer: AttentionLayer, x: torch.Tensor, queries: torch.Tensor, sources: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None, causal: bool = False, flow: torch.Tensor | None = None,
    source_mask: torch.Tensor | None = None,
) -> SourceWeights:
    """The attention weight of each query on the key it needs, per head, whether it is the row's largest, and the
    share of the needed keys it can see (:class:`SourceWeights`, each (B, Q, H)).

    ``queries``: (B, Q) long positions; ``sources``: (B, Q) long, query ``queries[b, m]`` needs key
    ``sources[b, m]``, or (B, Q, S) with S distinct positions (the weight is then their sum, ``argmax`` holds when
    one of them weighs more than every other key, ``coverage`` is the share of them in the attended set);
    ``source_mask``: (B, Q, S) bool, None or the real entries of a padded ``sources`` (a query needing fewer than
    S keys repeats one; masked entries count nowhere). The rest as :func:`attention_rows`. Zero weight means no
    needed key is in the query's attended set in that head."""
    check_tensor("x", x, ndim=3, floating=True)
    B, N = x.shape[0], x.shape[1]
    _check_positions("sources", sources.reshape(B, -1) if sources.dim() == 3 else sources, B, N)
    if sources.shape[:2] != queries.shape:
        raise ValueError(f"sources must be (B, Q) or (B, Q, S) for queries of shape {tuple(queries.shape)}, got "
                         f"{tuple(sources.shape)}")
    S = 1 if sources.dim() == 2 else sources.shape[2]
    if source_mask is None:
        source_mask = torch.ones(*queries.shape, S, dtype=torch.bool, device=sources.device)
    elif source_mask.shape != (*queries.shape, S) or source_mask.dtype != torch.bool:
        raise ValueError(f"source_mask must be a bool tensor of the shape of sources, {(*queries.shape, S)}, got "
                         f"{tuple(source_mask.shape)} {source_mask.dtype}")
    elif not bool(source_mask.any(-1).all()):
        raise ValueError("source_mask must keep at least one needed key for every query")
    rows = attention_rows(layer, x, queries, key_padding_mask, causal, flow)  # (B, Q, H, N)
    index = sources.view(B, queries.shape[1], 1, -1).expand(-1, -1, rows.shape[2], -1)  # (B, Q, H, S)
    real = source_mask.unsqueeze(2).expand_as(index)
    needed = rows.gather(3, index).masked_fill(~real, 0.0)
    # by addition: a masked entry may repeat a needed position, and a scatter of False could overwrite its True
    is_needed = torch.zeros_like(rows).scatter_add_(3, index, real.to(rows.dtype)) > 0
    best = needed.amax(-1)
    other = rows.masked_fill(is_needed, 0.0).amax(-1)  # the heaviest key that is not needed
    # strictly above it, beyond float64 rounding: equal shares (the members of one summary) are not an argmax
    argmax = (best > 0) & (best > other * (1 + 1e-9))
    coverage = (needed > 0).sum(-1).double() / real.sum(-1).double()
    return SourceWeights(needed.sum(-1), argmax, coverage)


def _check_positions(name: str, t: torch.Tensor, B: int, N: int) -> None:
    check_tensor(name, t, ndim=2)
    if t.shape[0] != B or t.dtype != torch.long:
        raise ValueError(f"{name} must be a (B={B}, Q) long tensor, got {tuple(t.shape)} {t.dtype}")
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= N):
        raise ValueError(f"{name} must hold positions in [0, {N}), got values in [{int(t.min())}, {int(t.max())}]")


def key_recall(
    model: nn.Module, tokens: torch.Tensor, queries: torch.Tensor, sources: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None, source_mask: torch.Tensor | None = None,
) -> dict[str, SourceWeights]:
    """Run ``model(tokens, key_padding_mask)`` once, and for every attention layer in it the weight each query puts
    on the key it needs, whether that is the row's largest, and the share of the needed keys it sees: {layer name:
    :class:`SourceWeights`} (see :func:`attention_to_sources`, which also takes ``source_mask``). The model is put
    in eval mode for the call and returned to its mode after."""
    captured: dict[str, tuple] = {}
    layers = {name: module for name, module in model.named_modules() if isinstance(module, AttentionLayer)}
    if not layers:
        raise ValueError("model has no attention layer (clusterformer.attention.AttentionLayer) to probe")

    def capture(name: str):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["x"]
            pad = args[1] if len(args) > 1 else kwargs.get("key_padding_mask")
            causal = args[2] if len(args) > 2 else kwargs.get("causal", False)
            if pad is not None:
                x = x.masked_fill(pad.unsqueeze(-1), 0.0)  # as the layer zeroes padded rows on entry
            captured[name] = (x.detach(), pad, causal, kwargs.get("flow"))
        return hook

    handles = [layer.register_forward_pre_hook(capture(name), with_kwargs=True) for name, layer in layers.items()]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(tokens, key_padding_mask)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    result = {}
    for name, layer in layers.items():
        if name not in captured:
            continue
        x, pad, causal, flow = captured[name]
        was = layer.training
        layer.eval()
        try:
            mask = None if source_mask is None else source_mask.to(x.device)
            found = attention_to_sources(layer, x, queries.to(x.device), sources.to(x.device), pad, causal, flow,
                                         mask)
            result[name] = SourceWeights(*(t.cpu() for t in found))
        finally:
            layer.train(was)
    return result


# ------------------------------------------------------------------------------------------------ keys read
_RANKS = {torch.topk, torch.Tensor.topk, torch.sort, torch.Tensor.sort, torch.argsort, torch.Tensor.argsort,
          torch.argmax, torch.Tensor.argmax}
_SOFTMAX = {torch.softmax, torch.Tensor.softmax, torch.nn.functional.softmax, torch.log_softmax,
            torch.Tensor.log_softmax, torch.nn.functional.log_softmax, torch.logsumexp, torch.Tensor.logsumexp}
_SDPA = torch.nn.functional.scaled_dot_product_attention
_PRODUCTS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.bmm,
             torch.Tensor.bmm, torch.mm, torch.Tensor.mm, torch.einsum, torch.baddbmm, torch.Tensor.baddbmm}
_MULS = {torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__}


class LogitSpy(TorchFunctionMode):
    """Counts the logits one query's computation uses: a spy on the score computation, for a call with a single
    query row (one sequence, one head, one query position: a decoding step or a cached call).

    The query ``q`` is marked "q" and the keys ``k`` (the cache, and the prompt's keys before it) "k"; every
    floating tensor an op makes inherits the marks of its inputs (integer and bool outputs -- indices, masks --
    carry none), and a product (matmul, einsum, bmm; an elementwise product of a query-only and a key-only
    operand, as Quest's bound) of an operand marked "q" with one marked "k" is marked "logit" (so a shared-QK
    query hashed by drawn rotations or scored against learned centroids makes no logit). A *logit* is an entry
    of a tensor marked "logit" at the point where it is used: ranked
    (``topk``, ``sort``, ``argsort``, ``argmax``: selection, re-ranking, members scored by score, Quest's page
    bounds, cluster retrieval's centroids) or normalised (``softmax``, ``log_softmax``, ``logsumexp``, and the
    logits SDPA computes inside from its q, k and mask). Entries that are -inf there (masked, or empty slots) are
    not used. The same logit used twice (a key ranked and then attended; a summary ranked and attended) has the
    same value: ``logits`` keeps the distinct finite non-zero values (to 12 significant digits, which separates
    the logits of distinct random float64 keys; an exact zero is a zero row -- a padded query or key slot -- which
    random inputs never give), so ``len(spy.logits)`` is the query's keys read. ``scale``: the softmax scale
    1 / sqrt(D) of the layer, where one path scores a key unscaled and another scaled (members scored by score,
    then attended): a value equal to a kept one times ``scale`` or its inverse is that one. A logit whose
    computation adds a bias before it is used (a summary's + log n) is one value all the same. Kernels that run
    outside PyTorch's Python API (the fused C++ and Triton kernels) are not seen: probe a layer built with a
    PyTorch kernel."""

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.marks = WeakTensorKeyDictionary()
        self.logits: set[float] = set()
        self.factors = (1.0,) if scale == 1.0 else (1.0, scale, 1 / scale)
        self.recording = True  # False: marks propagate, nothing is counted (a prefill before the probed step)

    def mark(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """Mark ``tensor`` (a query: "q"; keys: "k") and return it."""
        self.marks[tensor] = self.marks.get(tensor, frozenset()) | {what}
        return tensor

    def _marks_of(self, values: Any) -> frozenset:
        found: frozenset = frozenset()
        for leaf in tree_flatten(values)[0]:
            if isinstance(leaf, torch.Tensor):
                found = found | self.marks.get(leaf, frozenset())
        return found

    def _record(self, scores: torch.Tensor) -> None:
        if not self.recording:
            return
        scores = scores.detach()
        finite = scores[torch.isfinite(scores) & (scores > -1e30)].double()  # below -1e30: a mask's finite fill
        for value in finite[finite != 0].tolist():  # a probe: a few thousand logits
            if not any(float(f"{value * f:.12g}") in self.logits for f in self.factors):
                self.logits.add(float(f"{value:.12g}"))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            q, k = args[0], args[1]
            if {"q"} <= self.marks.get(q, frozenset()) and {"k"} <= self.marks.get(k, frozenset()):
                scale = kwargs.get("scale") or 1 / math.sqrt(q.shape[-1])
                logits = (q @ k.transpose(-1, -2)) * scale
                mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
                if mask is not None:
                    blocked = ~mask if mask.dtype == torch.bool else mask < -1e30  # an additive mask's -inf, min
                    logits = logits.masked_fill(blocked, -math.inf)
                if kwargs.get("is_causal"):
                    logits = logits.masked_fill(torch.ones(logits.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
                self._record(logits)
        elif (func in _RANKS or func in _SOFTMAX) and isinstance(args[0], torch.Tensor) and \
                "logit" in self.marks.get(args[0], frozenset()):
            self._record(args[0])
        out = func(*args, **kwargs)
        found = self._marks_of((args, kwargs))
        if func in _PRODUCTS or func in _MULS:
            operands = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            each = [self.marks.get(a, frozenset()) for a in operands]
            if func in _MULS:
                each = [m for m in each if len(m & {"q", "k"}) == 1]  # a query-only and a key-only operand
            if len(each) >= 2 and any("q" in m for m in each) and any(
                    "k" in m for i, m in enumerate(each) if any("q" in o for j, o in enumerate(each) if j != i)):
                found = found | {"logit"}
        if found:
            if func is torch.Tensor.__setitem__:
                self.marks[args[0]] = self.marks.get(args[0], frozenset()) | found
            for leaf in tree_flatten(out)[0]:
                if isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex()):
                    self.marks[leaf] = self.marks.get(leaf, frozenset()) | found
        return out


def cache_rows(layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, scale: float | None = None,
               spy: LogitSpy | None = None) -> torch.Tensor:
    """A cache reader's weights in one cached call (:meth:`CacheReadingAttention.attend_cache
    <clusterformer.attention.retrieval.CacheReadingAttention.attend_cache>`): the queries q (B, H, Lq, D) of the
    last Lq positions of a cache of keys k (B, H, n, D), read causally without padding, with *one-hot values*
    (v = the identity, one channel per key), so that output row (b, h, i) is the weight each key's value received
    -- a centroid term or a summary passes its weight on to every member's value. Returns (B, H, Lq, n), float64.
    ``spy``: a :class:`LogitSpy` to count the logits the call uses (q and k marked before it)."""
    B, H, n, _ = k.shape
    q, k = q.double(), k.double()
    v = torch.eye(n, dtype=torch.float64).expand(B, H, n, n)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    probe = copy.deepcopy(layer.inner).double()
    with torch.no_grad():
        if spy is None:
            out, _ = probe.attend_cache(q, k, v, None, scale)
        else:
            with spy:
                spy.mark(q, "q")
                spy.mark(k, "k")
                out, _ = probe.attend_cache(q, k, v, None, scale)
    return out


class _MarkingProjection:
    """A :class:`~clusterformer.attention.base.QKVProjection`: the layer's own q, k, v, q and k marked for a
    :class:`LogitSpy` (a shared-QK layer's one tensor gets both marks)."""

    def __init__(self, layer: AttentionLayer, spy: LogitSpy) -> None:
        self.layer, self.spy = layer, spy
        self.heads, self.head_dim, self.shared_qk = layer.heads, layer.head_dim, layer.shared_qk

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.layer.qkv(x)
        return self.spy.mark(q, "q"), self.spy.mark(k, "k"), v

    def project_rows(self, rows: torch.Tensor, which: str) -> torch.Tensor:
        projected = self.layer.project_rows(rows, which)
        for mark in ("q", "k"):
            if mark in which:  # "q", "k", or a shared "qk"
                self.spy.mark(projected, mark)
        return projected


def logits_read(layer: AttentionLayer, x: torch.Tensor, causal: bool = False) -> int:
    """The distinct logits a forward of ``layer`` over x (B, N, dim) uses, counted by a :class:`LogitSpy`: the
    keys read summed over every query and head (with random float64 inputs distinct (query, key) pairs have
    distinct logits; the same pair in two rounds or windows is one). The layer is copied and run in float64, in
    the mode it is in; build it with a PyTorch kernel (the spy does not see inside a fused one)."""
    return len(_forward_logits(layer, x, causal))


def _forward_logits(layer: AttentionLayer, x: torch.Tensor, causal: bool) -> set[float]:
    check_tensor("x", x, ndim=3, floating=True)
    probe = copy.deepcopy(layer).double()
    spy = LogitSpy(layer.head_dim ** -0.5)
    with torch.no_grad(), spy:
        probe.inner.attend_hidden(x.detach().double(), _MarkingProjection(probe, spy), AttentionMask(None, causal))
    return spy.logits


def step_logits(layer: AttentionLayer, x: torch.Tensor) -> int:
    """The distinct logits the last query of x (1, N, dim) uses in a cached decoding step after a prefill of the
    N - 1 before it (``layer.prefill`` / ``layer.step``; a strictly causal mechanism), counted by a
    :class:`LogitSpy`: the keys that query reads, summed over the heads (build the layer with one head for one
    query's count; with a PyTorch kernel). The layer is copied and run in float64 in eval mode."""
    check_tensor("x", x, ndim=3, floating=True)
    if x.shape[0] != 1 or x.shape[1] < 2:
        raise ValueError(f"x must be (1, N >= 2, dim): one sequence, a prompt and the step; got {tuple(x.shape)}")
    probe = copy.deepcopy(layer).double().eval()
    spy = LogitSpy(layer.head_dim ** -0.5)
    projection = _MarkingProjection(probe, spy)
    x = x.detach().double()
    with torch.no_grad(), spy:
        spy.recording = False
        _, cache = probe.inner.prefill_hidden(x[:, :-1], projection, AttentionMask(None, causal=True))
        spy.recording = True
        probe.inner.step_hidden(x[:, -1], projection, cache)
    return len(spy.logits)
