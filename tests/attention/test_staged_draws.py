"""Staged draws (clusterformer.attention.stage_draws / restage_draws): the random numbers of a training
step drawn on the host before the step, into device buffers, so the step itself can be captured in a CUDA graph.

Two things must hold on every device, and are checked here on the CPU:

* staged steps compute what unstaged steps compute, bit for bit, over several steps, and leave the generator (so
  the checkpoint) in the same state;
* a staged step does no host work: no read of a tensor's value on the host (``.item()``, ``int(t)``,
  ``bool(t)``: ``aten._local_scalar_dense``), no data-dependent shape (``nonzero``), no random op. This is what
  makes a capture fail or replay stale numbers on a GPU. A :class:`TorchDispatchMode` sees every such op; the
  one exception is ``one_hot``'s range check, which runs on the CPU only (on CUDA ``one_hot`` skips it).

The real capture runs in tests/attention/test_cuda.py (``test_cuda_graph_replay_matches_the_eager_training_step``).
"""

from __future__ import annotations

import copy
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from clusterformer.attention import build, restage_draws, stage_draws
from seeds import fixed_seed

STAGED = ["lsh", "clustered", "improved-clustered"]  # the mechanisms that draw in every training forward
HOST_READS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default"}


class HostWorkSpy(TorchDispatchMode):
    """Records the ops of a step that read a tensor's value on the host or draw random numbers there."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name in HOST_READS or any(word in name for word in ("rand", "normal", "bernoulli", "multinomial")):
            caller = [f for f in traceback.extract_stack() if "clusterformer" in f.filename][-1:]
            line = caller[0].line if caller else ""
            if not ("one_hot" in (line or "") and name == "aten._local_scalar_dense.default"):  # CPU-only check
                self.found.append(f"{name} at {caller[0].filename.split('src/')[-1]}:{caller[0].lineno}"
                                  if caller else name)
        return func(*args, **(kwargs or {}))


def _layer(name: str, **options):
    torch.manual_seed(fixed_seed())
    seed = fixed_seed()
    needs_seed = name in STAGED
    return build(name, dim=24, heads=3, **({"seed": seed} if needs_seed else {}), **options).double()


def _step(layer, x, pad=None, causal=False):
    layer.train()
    layer.zero_grad(set_to_none=True)
    x.grad = None
    out = layer(x, key_padding_mask=pad, causal=causal)
    out.sum().backward()
    grads = [None if p.grad is None else p.grad.clone() for p in layer.parameters()]
    return out.detach().clone(), x.grad.clone(), grads


def _inputs(B: int, N: int, masked: bool):
    x = torch.randn(B, N, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(fixed_seed()),
                    requires_grad=True)
    pad = None
    if masked:
        pad = torch.zeros(B, N, dtype=torch.bool)
        pad[-1, N - N // 3:] = True  # the last sequence a third shorter
    return x, pad


@pytest.mark.parametrize(("name", "causal", "masked"), [
    ("lsh", False, False), ("lsh", True, False), ("lsh", False, True), ("lsh", True, True),
    ("clustered", False, False), ("clustered", False, True),
    ("improved-clustered", False, False), ("improved-clustered", False, True),
])
@pytest.mark.parametrize("N", [37, 130])
def test_staged_steps_match_unstaged_steps_bit_for_bit(name, causal, masked, N):
    unstaged = _layer(name)
    staged = copy.deepcopy(unstaged)
    stage_draws(staged)
    x, pad = _inputs(2, N, masked)
    for step in range(3):
        restage_draws(staged)  # once before every step: a no-op before the first, which records the buffers
        expected = _step(unstaged, x, pad, causal)
        got = _step(staged, x, pad, causal)
        assert torch.equal(got[0], expected[0]), f"output differs at step {step}"
        assert torch.equal(got[1], expected[1]), f"x's gradient differs at step {step}"
        same = [torch.equal(a, b) for a, b in zip(got[2], expected[2], strict=True)]
        assert all(same), f"a parameter's gradient differs at step {step}"
    assert staged.inner.staged, "the staged layer drew nothing through its buffers"
    # the generator, so the checkpoint, is where the unstaged steps left it
    assert torch.equal(staged.inner.generator.get_state(), unstaged.inner.generator.get_state())
    assert staged.state_dict().keys() == unstaged.state_dict().keys()
    # evaluation: restaged from the seed alone, the same output every time, and the unstaged layer's
    staged.eval()
    unstaged.eval()
    with torch.no_grad():
        restage_draws(staged)
        first = staged(x, key_padding_mask=pad, causal=causal)
        restage_draws(staged)
        again = staged(x, key_padding_mask=pad, causal=causal)
        assert torch.equal(first, again)
        assert torch.equal(first, unstaged(x, key_padding_mask=pad, causal=causal))


def test_a_step_without_restaging_reuses_the_numbers():
    """The staged buffers are what the step reads: not restaged, a training step sees the last step's planes (so
    the equality above is the restaging's doing, not the unstaged path's)."""
    unstaged = _layer("clustered", num_clusters=4)
    staged = copy.deepcopy(unstaged)
    stage_draws(staged)
    x, _ = _inputs(2, 64, False)
    _step(unstaged, x)
    _step(staged, x)
    expected = _step(unstaged, x)
    got = _step(staged, x)  # no restage_draws: the first step's planes again
    assert not torch.equal(got[0], expected[0])


@pytest.mark.parametrize(("name", "causal"), [
    ("lsh", False), ("lsh", True), ("clustered", False), ("improved-clustered", False),
    # captured on an H200 (docs/speed-and-memory.md#cuda-graphs-and-memory-h200): the spy must agree that they do no
    # host work
    ("neural-clustering", False), ("neural-clustering", True), ("kmeans", False), ("routing", False),
    ("sliding-window", False), ("full", False),
])
def test_a_staged_step_does_no_host_work(name, causal):
    layer = _layer(name)
    stage_draws(layer)
    x, _ = _inputs(2, 96, False)
    _step(layer, x, causal=causal)  # the first staged step records the buffers (and may draw)
    restage_draws(layer)  # on the host, outside the step
    spy = HostWorkSpy()
    with spy:
        _step(layer, x, causal=causal)
    assert spy.found == []


@pytest.mark.parametrize("name", STAGED)
def test_the_spy_sees_an_unstaged_draw(name):
    """The spy is what the test above trusts: unstaged, the same step is caught drawing on the host."""
    layer = _layer(name)
    x, _ = _inputs(2, 96, False)
    _step(layer, x)
    spy = HostWorkSpy()
    with spy:
        _step(layer, x)
    assert any("rand" in found for found in spy.found), spy.found


def test_a_masked_lsh_step_reads_the_host_and_the_spy_says_where():
    """With a padding mask lsh reads its bucket count from the lengths (one host read): such a step is not
    capturable, and the spy names the line."""
    layer = _layer("lsh")
    stage_draws(layer)
    x, pad = _inputs(2, 96, True)
    _step(layer, x, pad)
    restage_draws(layer)
    spy = HostWorkSpy()
    with spy:
        _step(layer, x, pad)
    assert any("_local_scalar_dense" in found and "lsh.py" in found for found in spy.found), spy.found


def test_a_staged_step_of_another_shape_is_refused():
    layer = _layer("lsh", chunk_size=8)  # num_clusters="auto": the rotations' width follows the length
    stage_draws(layer)
    _step(layer, _inputs(1, 32, False)[0])
    restage_draws(layer)
    with pytest.raises(RuntimeError, match="static shape"):
        _step(layer, _inputs(1, 64, False)[0])
    stage_draws(layer)  # staging again forgets the recorded shape
    _step(layer, _inputs(1, 64, False)[0])


def test_staging_off_draws_on_the_host_again():
    layer = _layer("clustered")
    stage_draws(layer)
    x, _ = _inputs(1, 40, False)
    _step(layer, x)
    stage_draws(layer, on=False)
    assert layer.inner.staged is None
    spy = HostWorkSpy()
    with spy:
        _step(layer, x)
    assert any("rand" in found for found in spy.found)
