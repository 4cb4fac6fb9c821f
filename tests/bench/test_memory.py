"""The exact tensor-memory counter used by the CPU benchmark."""

import torch

from clusterformer.bench.memory import TensorMemoryTracker

MIB = 2**20


def test_counts_new_storages_once_and_subtracts_freed_ones():
    before = torch.ones(4 * MIB // 4)  # exists before tracking: never counted, even when changed in place
    with TensorMemoryTracker() as m:
        a = torch.ones(MIB // 4)  # 1 MiB
        b = a * 2  # 2 MiB alive
        view = b[10:]  # a view allocates nothing
        before.add_(1)
        del a  # 1 MiB alive
        c = b + 1  # 2 MiB alive again
        del view
    assert m.peak_bytes == 2 * MIB
    assert m.current_bytes == 2 * MIB
    assert c.shape == b.shape


def test_sees_the_backward_pass():
    w = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(512, 256)
    with TensorMemoryTracker() as m:
        (x @ w).relu().sum().backward()
    # forward: x @ w and its relu (512 KiB each); backward: at least the gradient of w (256 KiB)
    assert m.peak_bytes >= 2 * 512 * 256 * 4
    assert m.current_bytes >= 256 * 256 * 4  # w.grad stays alive
