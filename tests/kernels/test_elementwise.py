"""Triton norm and activation (SiLU and tanh-GELU gates) kernels against the torch reference."""
import pytest
import torch
from kernel_testing import DEVICE, DTYPES, assert_close, cuda_only

from kernels import reference
from kernels.triton_activation import gelu_tanh_and_mul, silu_and_mul
from kernels.triton_norm import add_rms_norm, rms_norm

pytestmark = pytest.mark.usefixtures("poisoned_outputs")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (5, 100), (3, 1024)] + cuda_only((4096, 1024), (7, 5120)))
def test_rms_norm(tokens, hidden, dtype):
    x = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    assert_close(rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), dtype)


def test_rms_norm_per_head_3d_view():
    """Qwen3's q/k norm normalises each head: x [T, heads, D] with weight [D]."""
    x = torch.randn(3, 4, 64, device=DEVICE)
    weight = torch.randn(64, device=DEVICE)
    out = rms_norm(x, weight, 1e-6)
    assert out.shape == x.shape
    assert_close(out, reference.rms_norm(x, weight, 1e-6), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (6, 96), (2, 1024)] + cuda_only((4096, 1024)))
def test_add_rms_norm(tokens, hidden, dtype):
    x = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    residual = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    weight = torch.randn(hidden, device=DEVICE).to(dtype)
    normed, new_residual = add_rms_norm(x, residual, weight, 1e-5)
    expected_normed, expected_residual = reference.add_rms_norm(x, residual, weight, 1e-5)
    assert_close(new_residual, expected_residual, dtype)
    assert_close(normed, expected_normed, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 16), (4, 100), (3, 1500)] + cuda_only((2048, 3072)))
def test_silu_and_mul(tokens, inter, dtype):
    x = torch.randn(tokens, 2 * inter, device=DEVICE).to(dtype)
    assert_close(silu_and_mul(x), reference.silu_and_mul(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 16), (4, 100), (3, 1500)] + cuda_only((2048, 3072)))
def test_gelu_tanh_and_mul(tokens, inter, dtype):
    x = torch.randn(tokens, 2 * inter, device=DEVICE).mul(4).to(dtype)  # into tanh's saturated tails too
    x[0, :4] = torch.tensor([-60.0, 60.0, -1e-4, 0.0])
    assert_close(gelu_tanh_and_mul(x), reference.gelu_tanh_and_mul(x), dtype)
