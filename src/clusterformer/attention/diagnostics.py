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
from typing import NamedTuple

import torch
from torch import nn

from .._checks import check_tensor
from .base import AttentionLayer

__all__ = ["SourceWeights", "attention_rows", "attention_to_sources", "key_recall"]


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
    for start in range(0, Q, D):  # passes of head_dim queries: ceil(Q / head_dim), not a loop over tokens
        m = torch.arange(start, min(Q, start + D))
        xd = x.detach().double().clone().requires_grad_(True)
        channel = m - start
        pick = channel.view(1, -1, 1, 1).expand(B, -1, H, 1)  # query m reads channel m - start
        with torch.enable_grad():  # also inside an evaluation's no_grad
            out, _ = probe_layer.inner.attend_hidden(
                xd, probe, key_padding_mask, causal, None if flow is None else flow.detach().double())  # (B, N, H, D)
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
