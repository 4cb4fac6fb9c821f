"""CUDA graphs of an attention layer's step, and the check that a replay computes what the eager step computes
(on a GPU a short step is bound by Python and kernel launches, not by the device).

A captured graph replays the recorded kernels on the same memory without running Python, so it is only right
when the step has no host round trip (no ``.item()``, no shape read from a tensor, no copy from host memory) and
draws no random numbers on the host: a number drawn on the host at capture would be replayed as a constant.
The mechanisms that draw in every training forward (lsh's rotations, clustered attention's hash planes) therefore
run with staged draws (:func:`clusterformer.attention.stage_draws`): the check and the benchmark stage the layer,
and :func:`prepare` draws each step's numbers into the layer's device buffers on the host before each eager step
and each replay, from the layer's own generator, as an unstaged forward would.
:func:`replay_matches_eager` finds both kinds of fault: it runs two eager steps and two replays from the same
state and compares the outputs, the gradients and the state they leave. Capture itself raises on a host round
trip. A mechanism that keeps state updates pending (EMA centroids, :attr:`InnerAttention.pending`) has them
applied inside the step, so each replay leaves the state that the next one reads, as the training loop does
after each optimiser step.

Measured on one H200 (docs/speed-and-memory.md#cuda-graphs-and-memory-h200); on CPU nothing here runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["capture", "check_graph_device", "error_line", "prepare", "relative_difference", "replay_matches_eager",
           "training_step"]


def training_step(layer: Any, x: Any, key_padding_mask: Any = None, causal: bool = False) -> Callable[[], Any]:
    """The layer-level training step the benchmark times: gradients cleared (to None, so the captured backward
    allocates them in the graph's memory), forward in train mode, backward of ``output.sum()``, pending state
    updates applied. Returns the function; each call returns the output."""
    import torch

    from ..attention import apply_pending_updates

    def step() -> torch.Tensor:
        layer.train()
        x.grad = None
        layer.zero_grad(set_to_none=True)
        out = layer(x, key_padding_mask=key_padding_mask, causal=causal)
        out.sum().backward()
        apply_pending_updates(layer)
        return out

    return step


def prepare(layer: Any, training: bool) -> None:
    """Before a step or a replay, on the host: the layer in training (or evaluation) mode, and its staged random
    numbers drawn for that step (:func:`clusterformer.attention.restage_draws`; nothing for a layer that draws
    none). The mode is set first, because evaluation draws from the seed alone and training advances the
    generator."""
    from ..attention import restage_draws

    layer.train(training)
    restage_draws(layer)


def capture(step: Callable[[], Any], warmup: int = 3) -> tuple[Any, Any]:
    """Run ``step`` ``warmup`` times on a side stream (lazy state, autotuning and the allocator settle there, as
    PyTorch asks), then capture one call in a ``torch.cuda.CUDAGraph``. Returns (graph, what the captured call
    returned): tensors that every ``graph.replay()`` overwrites in place."""
    import torch

    if not torch.cuda.is_available():
        raise ValueError("capture needs CUDA: a CUDA graph records kernels of a GPU stream")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    return graph, result


def check_graph_device(cuda_graph: bool, device: str) -> None:
    """The benchmarks' ``cuda_graph`` option: a ``ValueError`` unless the device is CUDA."""
    if cuda_graph and not device.startswith("cuda"):
        raise ValueError(f"cuda_graph needs device='cuda' (a CUDA graph replays GPU kernels); got device={device!r}")


def error_line(error: Exception) -> str:
    """An exception as one line of at most 300 characters, for a benchmark record (``graph_error``)."""
    return " ".join(f"{type(error).__name__}: {error}".split())[:300]


def relative_difference(a: Any, b: Any) -> float:
    """``||a - b|| / ||b||`` in float64 (0 when both are zero)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def replay_matches_eager(layer: Any, x: Any, key_padding_mask: Any = None, causal: bool = False,
                         steps: int = 2) -> dict[str, float]:
    """Capture :func:`training_step` of ``layer``, then from one saved state run ``steps`` eager steps and
    ``steps`` replays, and compare. Two steps, so a random number drawn on the host at capture (replayed as a
    constant) or a state update that does not carry from one replay to the next shows as a difference.

    Returns the largest relative difference ``||replay - eager|| / ||eager||`` over the steps, for the output
    (``output``), the gradients of x and of every parameter (``grads``) and every floating-point tensor of the
    state after the steps (``state``; buffers and parameters), and the same three between a second eager run and
    the first (``eager_output``, ``eager_grads``, ``eager_state``): the eager step's own spread. Exact kernels give
    0 for both; atomics (``index_add_`` in a backward, the scatter-adds of an EMA update) give rounding-level
    differences, which a discrete choice downstream (a centroid's nearest keys) can turn into larger ones. A replay
    is as right as the eager step when its difference is within that spread. Leaves the layer's draws staged
    (:func:`prepare` before each further step or replay)."""
    import copy

    import torch

    from ..attention import stage_draws

    stage_draws(layer)  # left on: the layer's random numbers come from its buffers, which prepare() fills
    step = training_step(layer, x, key_padding_mask, causal)
    graph, static_out = capture(step)
    params = [p for p in layer.parameters() if p.requires_grad]
    static_grads = [x.grad, *(p.grad for p in params)]  # the graph's own gradient tensors
    start = copy.deepcopy(layer.state_dict())

    def eager_steps() -> tuple[list, dict]:
        runs = []
        for _ in range(steps):
            prepare(layer, training=True)
            out = step()
            grads = [None if g is None else g.detach().clone() for g in (x.grad, *(p.grad for p in params))]
            runs.append((out.detach().clone(), grads))
        return runs, {k: v.clone() for k, v in layer.state_dict().items() if torch.is_tensor(v)}

    eager, eager_state = eager_steps()
    layer.load_state_dict(start)  # copies into the same tensors, which the graph reads
    again, again_state = eager_steps()  # the eager step against itself: its own run-to-run spread
    layer.load_state_dict(start)
    worst = {"output": 0.0, "grads": 0.0, "state": 0.0}
    spread = {"output": 0.0, "grads": 0.0, "state": 0.0}
    for (out, grads), (out_again, grads_again) in zip(eager, again, strict=True):
        prepare(layer, training=True)
        graph.replay()
        if static_out.is_cuda:
            torch.cuda.synchronize()
        worst["output"] = max(worst["output"], relative_difference(static_out, out))
        spread["output"] = max(spread["output"], relative_difference(out_again, out))
        for static, grad, grad_again in zip(static_grads, grads, grads_again, strict=True):
            if (static is None) != (grad is None):
                raise RuntimeError("the replay and the eager step disagree on which tensors get a gradient")
            if static is not None:
                worst["grads"] = max(worst["grads"], relative_difference(static, grad))
                spread["grads"] = max(spread["grads"], relative_difference(grad_again, grad))
    for name, value in layer.state_dict().items():
        if torch.is_tensor(value) and value.is_floating_point():
            worst["state"] = max(worst["state"], relative_difference(value, eager_state[name]))
            spread["state"] = max(spread["state"], relative_difference(again_state[name], eager_state[name]))
    return {**worst, **{f"eager_{k}": v for k, v in spread.items()}}
