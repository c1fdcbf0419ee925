"""The decode attention kernel with the qkv prologue inside it (qkv_decode_attention) against the torch
reference's separate steps: prologue (q/k norm, rotary, KV store), then paged attention."""
import pytest
import torch
from kernel_testing import (
    DEVICE,
    DTYPES,
    assert_close,
    cos_sin_cache,
    cuda_only,
    free_blocks_before_window,
    paged_batch,
)

from kernels import reference
from kernels.triton_attention import qkv_decode_attention

pytestmark = pytest.mark.usefixtures("poisoned_outputs")


def decode_case(contexts, num_q_heads, num_kv_heads, head_dim, block_size, dtype, qk_norm, unstored_rows=()):
    """A decode batch whose new tokens' keys and values are not in the cache yet (their slots hold NaN, so a
    read before the store shows), except for unstored_rows (slot -1: graph padding), which keep a value."""
    _, k_cache, v_cache, meta = paged_batch([1] * len(contexts), contexts, num_q_heads, num_kv_heads, head_dim,
                                            block_size, dtype)
    qkv = torch.randn(len(contexts), (num_q_heads + 2 * num_kv_heads) * head_dim, device=DEVICE).to(dtype)
    norms = (None, None)
    if qk_norm:
        norms = tuple((1 + 0.3 * torch.randn(head_dim, device=DEVICE)).to(dtype) for _ in range(2))
    positions = meta.seq_lens.long() - 1
    rows = torch.arange(len(contexts), device=DEVICE)
    slots = meta.block_tables[rows, positions // block_size].long() * block_size + positions % block_size
    stored = torch.ones(len(contexts), dtype=torch.bool, device=DEVICE)
    stored[list(unstored_rows)] = False
    for cache in (k_cache, v_cache):
        cache.view(-1, num_kv_heads, head_dim)[slots[stored]] = float("nan")
    meta.slot_mapping = torch.where(stored, slots, -1)
    return qkv, positions, cos_sin_cache(max(contexts), head_dim), norms, k_cache, v_cache, meta


def check_against_reference(contexts, num_q_heads, num_kv_heads, head_dim, block_size, dtype, qk_norm, num_splits,
                            unstored_rows=(), window=0, with_sinks=False):
    """With a window, the blocks before it are freed (NaN) before the launch."""
    qkv, positions, cos_sin, norms, k_cache, v_cache, meta = decode_case(
        contexts, num_q_heads, num_kv_heads, head_dim, block_size, dtype, qk_norm, unstored_rows)
    if window:
        free_blocks_before_window(k_cache, v_cache, meta, window)
    sinks = (2 * torch.randn(num_q_heads, device=DEVICE)).to(dtype) if with_sinks else None
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    q, _, _ = reference.qkv_prologue(qkv, positions, cos_sin, num_q_heads, num_kv_heads, *norms, 1e-6, k_expected,
                                     v_expected, meta.slot_mapping, return_kv=False)
    expected = reference.paged_attention(q, k_expected, v_expected, meta, head_dim**-0.5, window, sinks)
    before = qkv.clone()
    out = qkv_decode_attention(qkv, cos_sin, num_q_heads, num_kv_heads, *norms, 1e-6, k_cache, v_cache, meta,
                               head_dim**-0.5, num_splits=num_splits, window=window, sinks=sinks)
    assert_close(out, expected, dtype)
    stored = k_cache.isnan().sum() == k_expected.isnan().sum() and v_cache.isnan().sum() == v_expected.isnan().sum()
    assert stored  # every new key and value stored (NaN left only in the freed block)
    assert_close(k_cache.nan_to_num(), k_expected.nan_to_num(), dtype)
    assert torch.equal(v_cache.nan_to_num(), v_expected.nan_to_num()) and torch.equal(qkv, before)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 2), (8, 1), (6, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fused_decode_matches_prologue_then_attention(head_dim, num_q_heads, num_kv_heads, qk_norm, num_splits):
    check_against_reference([1, 15, 16, 17, 65, 100], num_q_heads, num_kv_heads, head_dim, 16, torch.float32,
                            qk_norm, num_splits, unstored_rows=(3,))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "contexts,num_q_heads,num_kv_heads,head_dim,block_size,num_splits",
    [([1, 33, 600], 4, 2, 64, 16, None)]
    + cuda_only(([2048] * 256, 16, 8, 128, 16, None), ([8192, 1, 4095, 4096, 4097, 513], 16, 8, 128, 16, None),
                ([8000] * 3 + [17] * 61, 32, 4, 128, 256, None), ([300, 7000], 8, 8, 64, 32, 8)),
)
def test_fused_decode_shapes_and_dtypes(contexts, num_q_heads, num_kv_heads, head_dim, block_size, num_splits,
                                        dtype):
    check_against_reference(contexts, num_q_heads, num_kv_heads, head_dim, block_size, dtype, True, num_splits)


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [1, 16, 20, 70])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(4, 2, 64), (8, 1, 128), (2, 1, 256)])
def test_fused_decode_with_window_and_sinks(num_q_heads, num_kv_heads, head_dim, window, num_splits, with_sinks):
    """The new key is stored by the program whose keys end at it also when the window starts the keys late,
    and the blocks before the window (freed, NaN) are never read."""
    check_against_reference([1, 15, 16, 17, 65, 100, 150], num_q_heads, num_kv_heads, head_dim, 16, torch.float32,
                            True, num_splits, unstored_rows=(3,), window=window, with_sinks=with_sinks)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "contexts,num_q_heads,num_kv_heads,head_dim,window",
    [([1, 33, 600], 4, 2, 64, 100)]
    + cuda_only(([5000 + 37 * i for i in range(64)], 32, 8, 128, 4096), ([3000] * 16, 4, 1, 256, 512),
                ([2000] * 64, 64, 8, 64, 128)),
)
def test_fused_decode_window_shapes_and_dtypes(contexts, num_q_heads, num_kv_heads, head_dim, window, dtype):
    check_against_reference(contexts, num_q_heads, num_kv_heads, head_dim, 16, dtype, True, None, window=window,
                            with_sinks=True)
