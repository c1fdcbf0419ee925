"""The fused attention prologue (q/k norm, rotary, KV store) against the torch reference's separate steps."""
import pytest
import torch
from kernel_testing import DEVICE, DTYPES, assert_close, cos_sin_cache

from kernels import reference
from kernels.triton_prologue import qkv_prologue

pytestmark = pytest.mark.usefixtures("poisoned_outputs")


def _case(tokens, num_q_heads, num_kv_heads, head_dim, dtype, qk_norm, num_blocks=5, block_size=4):
    qkv = torch.randn(tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, device=DEVICE).to(dtype)
    positions = torch.randint(0, 64, (tokens,), device=DEVICE)
    norms = (None, None)
    if qk_norm:
        norms = tuple((1 + 0.3 * torch.randn(head_dim, device=DEVICE)).to(dtype) for _ in range(2))
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), device=DEVICE, dtype=dtype)
    v_cache = torch.full(shape, float("nan"), device=DEVICE, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    slots[::3] = -1
    return qkv, positions, cos_sin_cache(64, head_dim), norms, k_cache, v_cache, slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (4, 2), (8, 1), (6, 2)])
def test_prologue_with_cache_matches_reference(num_q_heads, num_kv_heads, head_dim, qk_norm, dtype):
    qkv, positions, cos_sin, norms, k_cache, v_cache, slots = _case(7, num_q_heads, num_kv_heads, head_dim, dtype,
                                                                   qk_norm)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    before = qkv.clone()
    q, k, v = qkv_prologue(qkv, positions, cos_sin, num_q_heads, num_kv_heads, *norms, 1e-6, k_cache, v_cache, slots,
                           return_kv=False)
    q_ref, _, _ = reference.qkv_prologue(qkv, positions, cos_sin, num_q_heads, num_kv_heads, *norms, 1e-6,
                                        k_expected, v_expected, slots)
    assert k is None and v is None
    assert q.shape == (7, num_q_heads, head_dim) and q.is_contiguous()
    assert_close(q, q_ref, dtype)
    stored = (slots >= 0).sum().item()
    assert k_cache.isnan().sum() == k_expected.isnan().sum() == k_cache.numel() - stored * num_kv_heads * head_dim
    torch.testing.assert_close(k_cache.float(), k_expected.float(), rtol=2e-2 if dtype != torch.float32 else 2e-5,
                               atol=2e-2 if dtype != torch.float32 else 2e-5, equal_nan=True)
    torch.testing.assert_close(v_cache, v_expected, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 2), (8, 1)])
def test_prologue_without_cache_returns_k_and_v(num_q_heads, num_kv_heads, qk_norm):
    qkv, positions, cos_sin, norms, *_ = _case(5, num_q_heads, num_kv_heads, 64, torch.float32, qk_norm)
    q, k, v = qkv_prologue(qkv, positions, cos_sin, num_q_heads, num_kv_heads, *norms, 1e-5)
    expected = reference.qkv_prologue(qkv, positions, cos_sin, num_q_heads, num_kv_heads, *norms, 1e-5)
    for actual, wanted in zip((q, k, v), expected):
        assert actual.shape == wanted.shape
        assert_close(actual, wanted, torch.float32)
    assert v.data_ptr() == expected[2].data_ptr()  # v is the qkv slice itself, not a copy


def test_prologue_stores_and_returns_kv():
    """A cache and return_kv together: the returned q, k, v and the stored slots equal the reference's."""
    qkv, positions, cos_sin, norms, k_cache, v_cache, slots = _case(6, 4, 2, 64, torch.float32, True)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    got = qkv_prologue(qkv, positions, cos_sin, 4, 2, *norms, 1e-6, k_cache, v_cache, slots)
    expected = reference.qkv_prologue(qkv, positions, cos_sin, 4, 2, *norms, 1e-6, ref_k_cache, ref_v_cache, slots)
    for actual, wanted in zip(got, expected):
        assert_close(actual, wanted, torch.float32)
    keep = slots[slots >= 0]
    assert_close(k_cache.view(-1, 2, 64)[keep], ref_k_cache.view(-1, 2, 64)[keep], torch.float32)
    assert_close(v_cache.view(-1, 2, 64)[keep], ref_v_cache.view(-1, 2, 64)[keep], torch.float32)


def test_prologue_empty_batch():
    qkv, positions, cos_sin, norms, k_cache, v_cache, slots = _case(0, 4, 2, 64, torch.float32, True)
    q, k, v = qkv_prologue(qkv, positions, cos_sin, 4, 2, *norms, 1e-6, k_cache, v_cache, slots)
    assert q.shape == (0, 4, 64) and k.shape == v.shape == (0, 2, 64)
    assert k_cache.isnan().all()


@pytest.mark.skipif(DEVICE.type != "cuda", reason="large shape: CUDA only")
@pytest.mark.parametrize("tokens", [1, 1024, 4096])
def test_prologue_qwen3_shape(tokens):
    qkv = torch.randn(tokens, (16 + 2 * 8) * 128, device=DEVICE, dtype=torch.bfloat16)
    positions = torch.randint(0, 8192, (tokens,), device=DEVICE)
    cos_sin = cos_sin_cache(8192, 128)
    norms = tuple(torch.rand(128, device=DEVICE, dtype=torch.bfloat16) + 0.5 for _ in range(2))
    shape = (600, 16, 8, 128)
    k_cache, v_cache = (torch.zeros(shape, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(600 * 16, device=DEVICE)[:tokens]
    q, _, _ = qkv_prologue(qkv, positions, cos_sin, 16, 8, *norms, 1e-6, k_cache, v_cache, slots, return_kv=False)
    q_ref, _, _ = reference.qkv_prologue(qkv, positions, cos_sin, 16, 8, *norms, 1e-6, k_expected, v_expected, slots)
    assert_close(q, q_ref, torch.bfloat16)
    assert_close(k_cache, k_expected, torch.bfloat16)
    assert torch.equal(v_cache, v_expected)
