"""The CPU benchmark's two memory measures: the exact tensor-memory counter and the resident-set peak."""

import math

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


class _FakeProcess:
    """A stand-in for ``/proc/self``'s resident set (MB). The resident set moves by ``after_read`` after every read
    of it (an allocator handing memory back) and by ``after_reset`` after ``clear_refs`` (another thread
    allocating); the step moves it by ``step``. As in Linux, growth does not raise the stored high-water mark (it
    is raised lazily), and reading ``VmHWM`` gives the larger of the stored mark and the resident set now."""

    def __init__(self, after_read: float, after_reset: float, step: float) -> None:
        self.rss, self.hwm = 100.0, 100.0
        self.after_read, self.after_reset, self.grow = after_read, after_reset, step

    def read(self, field_name: str) -> float:
        if field_name == "VmHWM":
            return max(self.hwm, self.rss)
        value = self.rss
        self.rss += self.after_read
        return value

    def reset(self) -> bool:
        self.hwm = self.rss
        self.rss += self.after_reset
        return True

    def step(self) -> None:
        self.rss += self.grow
        self.hwm = max(self.hwm, self.rss)


@pytest.mark.parametrize("after_read, after_reset, step, expected", [
    (0.0, 0.0, 5.0, 5.0),  # a quiet process: exactly what the pass adds
    (-1.0, 0.0, 0.0, 0.0),  # memory handed back after the baseline: a baseline read before the reset gave -1
    (0.0, -1.0, 5.0, 5.0),  # memory handed back just before the pass: a baseline read before the reset gave 4
    (0.0, 1.0, -2.0, 0.0),  # another thread grew the resident set, the pass freed more: never below zero
])
def test_the_cpu_peak_counts_what_the_pass_adds_and_never_comes_out_below_zero(monkeypatch, after_read, after_reset,
                                                                               step, expected):
    from clusterformer.bench import attention

    process = _FakeProcess(after_read, after_reset, step)
    monkeypatch.setattr(attention, "_rss_mb", process.read)
    monkeypatch.setattr(attention, "_reset_peak_rss", process.reset)
    assert attention._peak_rss_mb(process.step) == expected


def test_the_cpu_peak_is_nan_where_proc_cannot_reset_it(monkeypatch):
    from clusterformer.bench import attention

    monkeypatch.setattr(attention, "_reset_peak_rss", lambda: False)
    assert math.isnan(attention._peak_rss_mb(lambda: None))
