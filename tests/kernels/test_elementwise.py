"""Triton norm, rotary, activation (SiLU and tanh-GELU gates) and KV-store kernels against the torch reference."""
import pytest
import torch
from kernel_testing import DEVICE, DTYPES, assert_close, cos_sin_cache, cuda_only

from kernels import reference
from kernels.triton_activation import gelu_tanh_and_mul, silu_and_mul
from kernels.triton_kv_cache import store_kv_cache
from kernels.triton_norm import add_rms_norm, rms_norm
from kernels.triton_rotary import apply_rotary

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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (4, 2), (8, 1), (6, 3)])
def test_apply_rotary_on_fused_qkv_views(num_q_heads, num_kv_heads, head_dim, dtype):
    tokens = 5
    qkv = torch.randn(tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, device=DEVICE).to(dtype)
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(tokens, num_q_heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(tokens, num_kv_heads, head_dim)
    positions = torch.tensor([0, 7, 3, 63, 1], device=DEVICE)
    cos_sin = cos_sin_cache(64, head_dim)
    before = qkv.clone()
    q_out, k_out = apply_rotary(q, k, positions, cos_sin)
    q_expected, k_expected = reference.apply_rotary(q, k, positions, cos_sin)
    assert_close(q_out, q_expected, dtype)
    assert_close(k_out, k_expected, dtype)
    assert torch.equal(qkv, before)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="large shape: CUDA only")
def test_apply_rotary_large():
    q = torch.randn(4096, 16, 128, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(4096, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    positions = torch.randint(0, 8192, (4096,), device=DEVICE)
    cos_sin = cos_sin_cache(8192, 128)
    expected = reference.apply_rotary(q, k, positions, cos_sin)
    for actual, wanted in zip(apply_rotary(q, k, positions, cos_sin), expected):
        assert_close(actual, wanted, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(2, 64, 16), (1, 128, 16), (8, 128, 32), (3, 64, 256)])
def test_store_kv_cache_writes_exactly_its_slots(num_kv_heads, head_dim, block_size, dtype):
    num_blocks, tokens = 6, 11
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    slots[[2, 7]] = -1
    kv = torch.randn(tokens, 2, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    k, v = kv[:, 0], kv[:, 1]  # strided views, as from a fused projection
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), device=DEVICE, dtype=dtype)
    v_cache = torch.full(shape, float("nan"), device=DEVICE, dtype=dtype)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    store_kv_cache(k, v, k_cache, v_cache, slots)
    reference.store_kv_cache(k, v, k_expected, v_expected, slots)
    torch.testing.assert_close(k_cache, k_expected, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_expected, rtol=0, atol=0, equal_nan=True)
    assert k_cache.isnan().sum() == (num_blocks * block_size - 9) * num_kv_heads * head_dim


@pytest.mark.skipif(DEVICE.type != "cuda", reason="large shape: CUDA only")
def test_store_kv_cache_large():
    tokens, shape = 8192, (1024, 16, 8, 128)
    slots = torch.randperm(1024 * 16, device=DEVICE)[:tokens]
    k = torch.randn(tokens, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    k_cache, v_cache = (torch.zeros(shape, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    store_kv_cache(k, v, k_cache, v_cache, slots)
    reference.store_kv_cache(k, v, k_expected, v_expected, slots)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
