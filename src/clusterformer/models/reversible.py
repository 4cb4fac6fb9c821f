"""Reversible residual layers (RevNet; Reformer; ``reformer-kmeans-attention-tied-reversible.md`` §3.1, §3.3).

A reversible block maps (x1, x2) -> (y1, y2):

    y1 = x1 + F(x2) [+ H(x1, x2)]        F: attention branch (LayerNorm + any registered attention)
    y2 = x2 + G(y1)                      G: feed-forward branch (LayerNorm + FF)

with the optional *tied connection* H(x1, x2) = FF([x1, x2]) of §3.3. Inputs can be recomputed from
outputs, x2 = y2 - G(y1) and x1 = y1 - F(x2) [- H(x1, x2)], so :class:`ReversibleSequence` keeps no
activations: its forward runs under ``no_grad`` and saves only the last (y1, y2); the backward walks the
blocks in reverse, reconstructs each block's inputs and backpropagates through a recomputed forward.
Activation memory is O(1) in depth (plus one block's activations at a time).

Gradients (§3.3, eqs. 4-6) -- with y1_bar = dL/dy1 + (dG/dy1)^T dL/dy2 (the total derivative of y1):

    dL/dx2 = dL/dy2 + (dF/dx2 + dH/dx2)^T y1_bar                          (4)
    dL/dx1 = y1_bar + (dH/dx1)^T y1_bar                                   (5)
    dL/dw_H = (dH/dw_H)^T y1_bar                                          (6)

The backward computes exactly these by calling ``torch.autograd.grad`` on the recomputed branches (G first,
with dL/dy2; then F and H, with y1_bar). The blocks' parameters are inputs of the autograd function, so
their gradients are returned by its backward like any input's: ``torch.autograd.grad(loss, params)`` works,
and under DistributedDataParallel every parameter's gradient hook fires exactly once.

Inverting the tied block. With H, x1 appears on both sides of y1 = x1 + F(x2) + H(x1, x2); the paper does
not say how to recover it. We solve x1 = (y1 - F(x2)) - H(x1, x2) by fixed-point iteration, which converges
while H is a contraction in x1; H's output layer starts at zero (H = 0, exact at initialisation). Training
moves H's weights, and with the paper's unconstrained H the iteration stops converging (an MLM run at lr 1e-3
lost it near step 211; the paper reports diverging losses with tied connections). So by default H is kept a
contraction in x1 by construction, as invertible residual networks keep their blocks (Behrmann et al. 2019,
i-ResNet): its output is scaled by lipschitz / max(bound, lipschitz), with bound = 1.13 sigma(W1_x1) sigma(W2)
an upper bound of its Lipschitz constant in x1 (1.13 >= GELU's largest slope; sigma the spectral norm, made
differentiable as u^T W v with the top singular vectors held constant, as spectral normalisation does), so the
iteration converges at rate ``lipschitz`` (0.5: 1e-15 in 50 steps). ``lipschitz=None`` is the paper's H; if the
iteration does not converge to ``tol`` in ``tied_iterations`` steps the backward raises a RuntimeError rather
than returning wrong gradients.

Replay. The recompute must see the same hashes, clusters and dropout masks as the forward: before each
branch the forward records the global CPU (and CUDA) RNG state and the state of every attention layer's
generator; the recompute restores them (inside :func:`torch.random.fork_rng`, so the caller's RNG stream is
untouched) and runs under :func:`clusterformer.attention.replaying`, in which stateful layers (memory banks,
EMA centroids) leave their state alone.

Auxiliary losses (clustering, commitment) of the attention layers are captured per block (an isolated
collector of :mod:`clusterformer.attention.aux`), returned by the autograd function as extra outputs, and
published from those outputs, so :func:`~clusterformer.attention.collect_aux_losses` and ``total_loss`` work
unchanged and their gradients reach the recomputed branches. The recompute publishes nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..attention import replaying
from ..attention.aux import isolated, publish_losses
from ..attention.aux import publish_groups as _publish_groups
from ..attention.base import SeededModule

__all__ = ["ReversibleSequence", "TiedConnection"]


GELU_SLOPE = 1.13  # >= max_x d/dx GELU(x) = 1.1289 (at x = 0.7518)


def _spectral_norm(w: torch.Tensor) -> torch.Tensor:
    """sigma(w), differentiable as u^T w v with its top singular vectors u, v held constant (spectral
    normalisation's gradient; no SVD backward, which is undefined at the zero matrix H starts as)."""
    with torch.no_grad():
        U, _S, Vh = torch.linalg.svd(w, full_matrices=False)
    return U[:, 0] @ w @ Vh[0]


class TiedConnection(nn.Module):
    """H(x1, x2) = s (W2 GELU(W1 [x1, x2] + b1) + b2), output dim = dim (§3.3). W2, b2 start at zero.

    ``lipschitz`` (default 0.5): s = lipschitz / max(bound, lipschitz), bound = 1.13 sigma(W1_x1) sigma(W2), so H is
    a contraction in x1 with constant <= lipschitz and the block stays invertible (module docs); s = 1 while the
    bound is below it (at initialisation, H = 0). None: s = 1, the paper's H."""

    def __init__(self, dim: int, hidden: int | None = None, lipschitz: float | None = 0.5) -> None:
        super().__init__()
        if lipschitz is not None and not 0.0 < lipschitz < 1.0:
            raise ValueError(f"lipschitz must be in (0, 1) (a contraction) or None; got {lipschitz!r}")
        hidden = hidden or dim
        self.dim, self.lipschitz = dim, lipschitz
        self.net = nn.Sequential(nn.Linear(2 * dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
        nn.init.zeros_(self.net[2].weight)
        nn.init.zeros_(self.net[2].bias)

    def scale(self) -> torch.Tensor | float:
        """s: 1, or lipschitz / bound once the bound on H's Lipschitz constant in x1 exceeds ``lipschitz``."""
        if self.lipschitz is None:
            return 1.0
        bound = GELU_SLOPE * _spectral_norm(self.net[0].weight[:, :self.dim]) * _spectral_norm(self.net[2].weight)
        return self.lipschitz / bound.clamp(min=self.lipschitz)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        return self.scale() * self.net(torch.cat([x1, x2], dim=-1))


Branch = Callable[[torch.Tensor], torch.Tensor]


class _RNGState:
    """Global CPU/CUDA RNG states and the generators of the attention layers, captured before a branch."""

    def __init__(self, generators: list[torch.Generator], device: torch.device) -> None:
        self.generators = generators
        self.gen_states = [g.get_state() for g in generators]
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.device = device

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
        for g, s in zip(self.generators, self.gen_states, strict=True):
            g.set_state(s)


def _accumulate(total: dict[int, torch.Tensor], params: list[nn.Parameter], grads) -> None:
    for p, g in zip(params, grads, strict=True):
        if g is not None:
            total[id(p)] = total[id(p)] + g if id(p) in total else g


class _ReversibleFunction(torch.autograd.Function):
    """(x1, x2, *params) -> (y1, y2, aux losses); ``aux_names`` receives the losses' names per block.

    The parameters of every block are explicit inputs, so their
    gradients leave ``backward`` as outputs and reach ``.grad`` through the outer autograd pass only, once per
    parameter: DistributedDataParallel sees them in the graph and its gradient hooks fire once (a nested
    ``backward`` that accumulated them itself would mark them ready twice)."""

    @staticmethod
    def forward(ctx, x1, x2, seq: ReversibleSequence, kwargs: dict, aux_names: list, *params):
        ctx.seq, ctx.kwargs = seq, kwargs
        ctx.params = params
        ctx.states = []
        aux_values = []
        ctx.aux_names = aux_names  # filled here, read by the caller: which loss each aux output is
        with torch.no_grad():
            for i in range(len(seq.blocks)):
                f_state = seq._capture(i, x2.device)
                f_out, aux = seq._attention_branch(i, x2, kwargs)
                x1 = x1 + f_out + (seq.tied[i](x1, x2) if seq.tied is not None else 0)
                g_state = seq._capture(i, x2.device)
                x2 = x2 + seq._ff_branch(i, x1)  # (x1, x2) now hold (y1, y2), the next block's inputs
                ctx.states.append((f_state, g_state))
                names = sorted(aux)
                ctx.aux_names.append(names)
                aux_values.extend(aux[n].reshape(()) for n in names)
        ctx.save_for_backward(x1, x2)
        aux_flat = torch.stack(aux_values) if aux_values else x1.new_zeros(0)
        return x1, x2, aux_flat

    @staticmethod
    def backward(ctx, dy1, dy2, daux):
        seq, kwargs = ctx.seq, ctx.kwargs
        y1, y2 = ctx.saved_tensors
        offsets = [0]
        for names in ctx.aux_names:
            offsets.append(offsets[-1] + len(names))
        param_grads: dict[int, torch.Tensor] = {}
        for i in reversed(range(len(seq.blocks))):
            params = seq._block_parameters(i)
            f_state, g_state = ctx.states[i]
            with torch.random.fork_rng(devices=[y1.device] if y1.device.type == "cuda" else []), replaying():
                # G: x2 = y2 - G(y1); y1_bar = dy1 + (dG/dy1)^T dy2.
                with torch.enable_grad():
                    y1_ = y1.detach().requires_grad_(True)
                    g_state.restore()
                    g_out = seq._ff_branch(i, y1_)
                    d_y1, *d_params = torch.autograd.grad(g_out, [y1_, *params], dy2, allow_unused=True)
                _accumulate(param_grads, params, d_params)
                y1_bar = dy1 + (d_y1 if d_y1 is not None else 0)
                x2 = y2 - g_out.detach()
                # F (and H): x1 = y1 - F(x2) [- H(x1, x2)]; eqs. (4)-(6) with y1_bar.
                with torch.enable_grad(), isolated():  # the recompute's losses are not published again
                    x2_ = x2.detach().requires_grad_(True)
                    f_state.restore()
                    f_out, aux = seq._attention_branch(i, x2_, kwargs, publish_groups=False)
                    outputs, grads = [f_out], [y1_bar]
                    x1_ = None
                    if seq.tied is not None:
                        x1 = seq._invert_tied(i, y1 - f_out.detach(), x2)
                        x1_ = x1.detach().requires_grad_(True)
                        outputs.append(seq.tied[i](x1_, x2_))
                        grads.append(y1_bar)
                    else:
                        x1 = y1 - f_out.detach()
                    names = ctx.aux_names[i]
                    for j, n in enumerate(names):
                        if aux[n].requires_grad:
                            outputs.append(aux[n].reshape(()))
                            grads.append(daux[offsets[i] + j])
                    inputs = [x2_] + ([x1_] if x1_ is not None else [])
                    d_inputs = torch.autograd.grad(outputs, inputs + params, grads, allow_unused=True)
                _accumulate(param_grads, params, d_inputs[len(inputs):])
            dx2 = dy2 + (d_inputs[0] if d_inputs[0] is not None else 0)
            dx1 = y1_bar + (d_inputs[1] if x1_ is not None and d_inputs[1] is not None else 0)
            y1, y2, dy1, dy2 = x1.detach(), x2.detach(), dx1, dx2
        return (dy1, dy2, None, None, None, *(param_grads.get(id(p)) for p in ctx.params))


class ReversibleSequence(nn.Module):
    """Reversible stack over the encoder's blocks: each block contributes ``attention_branch`` (F) and
    ``ff_branch`` (G). ``forward(x1, x2, **kwargs) -> (y1, y2)``; kwargs (key_padding_mask, causal) go to F.

    Args:
        blocks: modules with ``attention_branch(x, key_padding_mask, causal)`` and ``ff_branch(x)``. They are
            *not* registered here (the owner, e.g. :class:`clusterformer.models.Encoder`, registers them), so
            their parameters appear once in ``state_dict``.
        tied: add the tied connection H per block (§3.3).
        recompute: True (default) runs the memory-saving custom backward; False runs the same equations with
            ordinary autograd (the reference the tests compare against, and a debugging aid).
        tied_iterations, tol: fixed-point inversion of a tied block (see module docs).
        tied_lipschitz: the tied connections' contraction constant in x1 (:class:`TiedConnection`; None: the
            paper's unconstrained H, whose inversion can fail once trained).
    """

    def __init__(self, blocks: nn.ModuleList, *, dim: int, tied: bool = False, recompute: bool = True,
                 tied_iterations: int = 50, tol: float | None = None, tied_lipschitz: float | None = 0.5) -> None:
        super().__init__()
        self.blocks = list(blocks)  # a plain list: not registered twice
        self.tied = nn.ModuleList(TiedConnection(dim, lipschitz=tied_lipschitz) for _ in blocks) if tied else None
        self.recompute = recompute
        self.tied_iterations = tied_iterations
        self.tol = tol

    def _block_parameters(self, i: int) -> list[nn.Parameter]:
        """Block i's trainable parameters, with its tied connection's."""
        params = list(self.blocks[i].parameters()) + (list(self.tied[i].parameters()) if self.tied is not None else [])
        return [p for p in params if p.requires_grad]

    def _trainable_parameters(self) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for i in range(len(self.blocks)):
            seen.update((id(p), p) for p in self._block_parameters(i))
        return list(seen.values())

    def _capture(self, i: int, device: torch.device) -> _RNGState:
        gens = [m.generator for m in self.blocks[i].modules() if isinstance(m, SeededModule) and m.generator]
        return _RNGState(gens, device)

    def _attention_branch(self, i: int, x: torch.Tensor, kwargs: dict, *,
                          publish_groups: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """F of block i, with the auxiliary losses it published (name -> mean over its layers) captured, not
        published; its groups are passed on to the open recorders unless ``publish_groups`` is False."""
        with isolated() as (aux, groups):
            out = self.blocks[i].attention_branch(x, **kwargs)
        if publish_groups:
            for module, value in groups.items():
                _publish_groups(module, value)
        return out, dict(aux)

    def _ff_branch(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[i].ff_branch(x)

    @torch.no_grad()
    def _invert_tied(self, i: int, target: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        """Solve x1 + H(x1, x2) = target by fixed-point iteration."""
        tol = self.tol if self.tol is not None else 100 * torch.finfo(target.dtype).eps
        x1 = target
        for _ in range(self.tied_iterations):
            nxt = target - self.tied[i](x1, x2)
            gap = (nxt - x1).abs().max()
            x1 = nxt
            if gap <= tol * (1 + x1.abs().max()):
                return x1
        raise RuntimeError(
            f"could not invert tied reversible block {i}: the fixed-point iteration for x1 did not converge in "
            f"{self.tied_iterations} steps (H is not a contraction in x1); lower the learning rate of the tied "
            "connections, raise tied_iterations, or train without tied=True"
        )

    def forward(self, x1: torch.Tensor, x2: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.recompute or not torch.is_grad_enabled():  # ordinary autograd: layers publish as usual
            for i in range(len(self.blocks)):
                f_out = self.blocks[i].attention_branch(x2, **kwargs)
                x1 = x1 + f_out + (self.tied[i](x1, x2) if self.tied is not None else 0)
                x2 = x2 + self._ff_branch(i, x1)
            return x1, x2
        aux_names: list[list[str]] = []
        y1, y2, aux_flat = _ReversibleFunction.apply(x1, x2, self, kwargs, aux_names, *self._trainable_parameters())
        # Publish each block's auxiliary losses as entries of the function's output (with the graph attached),
        # in the order the function stacked them: per block, sorted by name.
        offset = 0
        for names in aux_names:
            publish_losses({name: aux_flat[offset + t] for t, name in enumerate(names)})
            offset += len(names)
        return y1, y2
