"""The ops (worker/ops/) choose their kernel once per device and dtype, where they first meet one,
and every later call with that device and dtype takes the same kernel without asking again; a call
whose rows the chosen kernel does not read (another layout) gets PyTorch's ops, with the same answer."""

from __future__ import annotations

import pytest
import torch

from inferplane.worker.ops import native
from inferplane.worker.ops.activation import GatedActivation, gated
from inferplane.worker.ops.norm import RMSNorm, rms_norm

needs_kernels = pytest.mark.skipif(native.kernels() is None, reason="no C compiler or not x86-64 here")


@pytest.fixture
def kernel_lookups(monkeypatch) -> list[int]:
    """Counts the ops' asks for the C kernels from here on."""
    asked = []
    real = native.kernels
    monkeypatch.setattr(native, "kernels", lambda: (asked.append(1), real())[1])
    return asked


@needs_kernels
def test_a_norm_asks_for_its_kernel_once_per_device_and_dtype(kernel_lookups):
    torch.manual_seed(0)
    norm = RMSNorm(24, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2.0)
    weight = norm.weight.detach()
    with torch.inference_mode():
        for rows in (1, 3, 9):
            x = torch.randn(rows, 24)
            torch.testing.assert_close(norm(x), rms_norm(x, weight, 1e-5), rtol=1e-5, atol=1e-6)
            summed, normed = norm.add_and_norm(x.clone(), x)
            torch.testing.assert_close(normed, rms_norm(x + x, weight, 1e-5), rtol=1e-5, atol=1e-6)
        assert len(kernel_lookups) == 1
        strided = torch.randn(24, 4).t()  # not rows the C kernel reads: PyTorch's ops, no new choice
        torch.testing.assert_close(norm(strided), rms_norm(strided, weight, 1e-5))
        assert len(kernel_lookups) == 1
        doubles = torch.randn(2, 24, dtype=torch.float64)  # another dtype: chosen again (PyTorch: no ask)
        assert torch.equal(norm(doubles), rms_norm(doubles, weight, 1e-5))
        assert len(kernel_lookups) == 1


@needs_kernels
@pytest.mark.parametrize("gelu", [False, True])
def test_the_activation_asks_once_and_strided_rows_take_pytorch(kernel_lookups, gelu):
    act = GatedActivation(gelu)
    gate_up = torch.randn(3, 32)
    for _ in range(3):
        torch.testing.assert_close(act.fused(gate_up), gated(*gate_up.chunk(2, dim=-1), gelu), rtol=1e-5, atol=1e-6)
    assert len(kernel_lookups) == 1
    strided = torch.randn(32, 3).t()
    assert torch.equal(act.fused(strided), gated(*strided.chunk(2, dim=-1), gelu))
    assert len(kernel_lookups) == 1
