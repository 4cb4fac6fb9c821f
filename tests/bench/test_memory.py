"""The exact tensor-memory counter used by the CPU benchmark."""

import pytest
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


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_counts_a_sparse_tensors_index_and_value_storages():
    """A CSR matrix has no storage of its own (ops/key_lists.py builds them): the tracker counts its row pointers,
    column indices and values, and does not fail on it."""
    with TensorMemoryTracker() as m:
        dense = torch.eye(512, dtype=torch.float64)  # 2 MiB
        matrix = dense.to_sparse_csr()  # 513 row pointers, 512 columns, 512 values: 8 bytes each
        del dense
    assert m.peak_bytes >= 2 * MIB
    parts = {part.untyped_storage().data_ptr(): part.untyped_storage().nbytes()
             for part in (matrix.crow_indices(), matrix.col_indices(), matrix.values())}
    assert m.current_bytes == sum(parts.values()) >= (513 + 512 + 512) * 8  # an index may view a larger storage
    assert matrix.values().sum().item() == 512
