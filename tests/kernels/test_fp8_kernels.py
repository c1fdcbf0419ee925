"""The FP8 (e4m3) KV cache in the Triton kernels against the torch reference: the quantizing stores (prologue and
fused decode) bit for bit, and decode, prefill and mixed attention reading the cache with per-KV-head scales."""
import os

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

import kernels
from kernels import reference
from kernels.triton_attention import (
    DECODE_TILES,
    FP8_DECODE_TILES,
    DecodeTiles,
    decode_attention,
    decode_tiles,
    paged_attention,
    qkv_decode_attention,
)
from kernels.triton_fp8 import ptx_conversion
from kernels.triton_prologue import qkv_prologue

pytestmark = pytest.mark.usefixtures("poisoned_outputs")

FP8 = torch.float8_e4m3fn
HEADS = [(2, 2), (4, 2), (8, 1), (6, 2)]  # GQA ratios 1, 2, 8 and a non-power-of-two 3


def codes(cache):
    return cache.view(torch.uint8)


def random_scales(num_kv_heads):
    """Per-head scales that are not powers of two (the division rounds), keeping randn / scale within +-448."""
    return (0.02 + 0.1 * torch.rand(num_kv_heads, device=DEVICE)).float()


def quantized(cache, scale):
    """A [blocks, block_size, n_kv, D] cache as the FP8 cache holds it (GARBAGE saturates to +-448 * scale)."""
    return reference.quantize_kv(cache.flatten(0, 1), scale).view(cache.shape)


def fp8_paged_batch(q_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype):
    q, k_cache, v_cache, meta = paged_batch(q_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size,
                                            torch.float32)
    k_scale, v_scale = random_scales(num_kv_heads), random_scales(num_kv_heads)
    return q.to(dtype), quantized(k_cache, k_scale), quantized(v_cache, v_scale), meta, k_scale, v_scale


# ---- the stores -----------------------------------------------------------------------------------------------

def e4m3_edge_values(count):
    """Every finite e4m3 value, the midpoints between neighbours (ties), the floats just either side of them, and
    values past +-448, times 0.5 (the scale they are stored with), signs and order shuffled, cut or repeated to
    `count`."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    values = values[values.isfinite()].unique()
    midpoints = (values[1:] + values[:-1]) / 2
    up, down = torch.tensor(1e4), torch.tensor(-1e4)
    edges = torch.cat([values, midpoints, midpoints.nextafter(up), midpoints.nextafter(down),
                       torch.tensor([449.0, 464.0, 1e4, -1e9, 0.0, -0.0, 1e-30])])
    edges = edges[torch.randperm(len(edges))] * torch.where(torch.rand(len(edges)) < 0.5, -1.0, 1.0)
    return (0.5 * edges).repeat(-(-count // len(edges)))[:count]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("head_dim", [64, pytest.param(128, marks=pytest.mark.slow)])  # 128: twice the interpreting
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (4, 2), (8, 1), (6, 2)])
def test_prologue_stores_like_the_reference_bit_for_bit(num_q_heads, num_kv_heads, head_dim, qk_norm, dtype):
    """The keys the kernel rotated and the values (e4m3 edge cases: ties, neighbours of ties, subnormals,
    saturation) quantized with non-power-of-two scales give the reference's codes exactly; slots -1 stay."""
    tokens, num_blocks, block_size = 24, 8, 4
    qkv = torch.randn(tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, device=DEVICE)
    if dtype == torch.float32:  # values in other dtypes would be rounded away from the edges first
        qkv[:, (num_q_heads + num_kv_heads) * head_dim:] = e4m3_edge_values(tokens * num_kv_heads * head_dim).view(
            tokens, -1).to(DEVICE)
    qkv = qkv.to(dtype)
    positions = torch.randint(0, 64, (tokens,), device=DEVICE)
    norms = tuple((1 + 0.3 * torch.randn(head_dim, device=DEVICE)).to(dtype) for _ in range(2)) if qk_norm else (
        None, None)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.full(shape, float("nan"), device=DEVICE).to(FP8) for _ in range(2))
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    slots[::5] = -1
    k_scale = random_scales(num_kv_heads)
    v_scale = torch.full((num_kv_heads,), 0.5, device=DEVICE) if dtype == torch.float32 else random_scales(
        num_kv_heads)
    q, k, v = qkv_prologue(qkv, positions, cos_sin_cache(64, head_dim), num_q_heads, num_kv_heads, *norms, 1e-6,
                           k_cache, v_cache, slots, return_kv=True, k_scale=k_scale, v_scale=v_scale)
    reference.store_kv_cache(k, v, k_expected, v_expected, slots, k_scale, v_scale)
    assert torch.equal(codes(k_cache), codes(k_expected)) and torch.equal(codes(v_cache), codes(v_expected))
    assert k_cache.float().isnan().sum() == k_cache.numel() - (slots >= 0).sum() * num_kv_heads * head_dim
    q_ref, k_ref, _ = reference.qkv_prologue(qkv, positions, cos_sin_cache(64, head_dim), num_q_heads, num_kv_heads,
                                             *norms, 1e-6)
    assert_close(q, q_ref, dtype)
    assert_close(k, k_ref, dtype)


def test_prologue_quantizes_where_a_plain_copy_would_not():
    """Values past e4m3's range saturate, small ones keep their precision with a small scale: the stored codes
    are x / scale, not x."""
    qkv = torch.zeros(1, 4 * 64, device=DEVICE)
    qkv[0, 3 * 64:] = torch.tensor([1000.0, -1000.0, 0.01, -0.01] * 16)
    k_cache, v_cache = (torch.zeros(1, 4, 1, 64, device=DEVICE).to(FP8) for _ in range(2))
    scales = torch.tensor([2 ** -10], device=DEVICE)
    qkv_prologue(qkv, torch.zeros(1, dtype=torch.int64, device=DEVICE), cos_sin_cache(4, 64), 2, 1, k_cache=k_cache,
                 v_cache=v_cache, slot_mapping=torch.tensor([2], device=DEVICE), k_scale=scales, v_scale=scales)
    assert v_cache[0, 2, 0, :4].float().tolist() == [448.0, -448.0, 10.0, -10.0]  # 0.01 * 1024 = 10.24 -> 10


# ---- attention reading the cache ------------------------------------------------------------------------------

DECODE_CONTEXTS = [1, 15, 16, 17, 64, 65, 127, 128, 129, 300]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 16), (128, 128)])
def test_decode(head_dim, block_size, num_q_heads, num_kv_heads, num_splits):
    q, k_cache, v_cache, meta, k_scale, v_scale = fp8_paged_batch([1] * len(DECODE_CONTEXTS), DECODE_CONTEXTS,
                                                                  num_q_heads, num_kv_heads, head_dim, block_size,
                                                                  torch.float32)
    out = decode_attention(q, k_cache, v_cache, meta, head_dim**-0.5, num_splits=num_splits, k_scale=k_scale,
                           v_scale=v_scale)
    expected = reference.paged_attention(q, k_cache, v_cache, meta, head_dim**-0.5, k_scale=k_scale, v_scale=v_scale)
    assert_close(out, expected, torch.float32)


def test_values_convert_by_ptx_only_in_compiled_kernels():
    """The interpreter runs no PTX: it must convert with `.to()`. Compiled for a GPU with e4m3 conversions, the
    decode and prefill kernels convert values by PTX (the tests above then check that path on the GPU)."""
    compiled = os.environ.get("TRITON_INTERPRET") != "1"
    assert not ptx_conversion(torch.zeros(1))
    if torch.cuda.is_available():
        on_gpu = torch.zeros(1, device="cuda")
        assert ptx_conversion(on_gpu) == (compiled and torch.cuda.get_device_capability(0) >= (8, 9))


def test_float32_queries_keep_the_16_bit_tiles():
    """They convert the keys to float32, operands of twice the registers, which FP8's register cap would spill (and
    FP8 tiles of 128 keys gave wrong outputs on the H100: test_decode[128-16-8-1-3])."""
    assert decode_tiles(FP8, torch.float32) == DECODE_TILES
    assert decode_tiles(FP8, torch.bfloat16) == decode_tiles(FP8, torch.float16) == FP8_DECODE_TILES
    assert decode_tiles(torch.bfloat16, torch.bfloat16) == DECODE_TILES


def test_split_launches_take_their_own_register_cap():
    """Small batches (split contexts) ran faster at 104 registers than at the unsplit launches' 96."""
    tiles = DecodeTiles(64, 4, 2, max_registers=96, split_max_registers=104)
    assert (tiles.registers(split=False), tiles.registers(split=True)) == (96, 104)
    assert DecodeTiles(64, 4, 2, max_registers=96).registers(split=True) == 96


def test_reference_reads_keys_and_values_times_their_scales():
    """The scales matter: attention over the FP8 cache equals attention over its dequantized float32 copy, and
    not over the cache read without its scales."""
    q, k_cache, v_cache, meta, k_scale, v_scale = fp8_paged_batch([1, 1], [20, 70], 4, 2, 64, 16, torch.float32)
    out = decode_attention(q, k_cache, v_cache, meta, 0.125, num_splits=2, k_scale=k_scale, v_scale=v_scale)
    k_float = k_cache.float() * k_scale[:, None]
    v_float = v_cache.float() * v_scale[:, None]
    assert_close(out, reference.paged_attention(q, k_float, v_float, meta, 0.125), torch.float32)
    unscaled = reference.paged_attention(q, k_cache.float(), v_cache.float(), meta, 0.125)
    assert not torch.allclose(out, unscaled, atol=1e-2)


@pytest.mark.slow  # interpreted at five tile shapes
@pytest.mark.parametrize("tiles", [DecodeTiles(16, 4, 2, 16), DecodeTiles(32, 4, 2, 64), DecodeTiles(64, 8, 3),
                                   DecodeTiles(128, 4, 2), DecodeTiles(256, 8, 2, 512)])
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_decode_tiles_change_no_result(tiles, num_splits):
    """Tiles of every size, register cap and split threshold compute the same attention."""
    contexts = [1, 16, 100, 129, 255, 256, 257, 600]
    q, k_cache, v_cache, meta, k_scale, v_scale = fp8_paged_batch([1] * len(contexts), contexts, 8, 2, 64, 16,
                                                                  torch.float32)
    out = decode_attention(q, k_cache, v_cache, meta, 0.125, num_splits, k_scale=k_scale, v_scale=v_scale, tiles=tiles)
    expected = reference.paged_attention(q, k_cache, v_cache, meta, 0.125, k_scale=k_scale, v_scale=v_scale)
    assert_close(out, expected, torch.float32)


MIXED_Q_LENS = [1, 17, 1, 5, 33]  # decode over 1 token, fresh prefill, decode, chunks after a cached prefix
MIXED_SEQ_LENS = [1, 17, 40, 37, 70]


@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 16), (64, 128)])
def test_prefill_and_mixed(head_dim, block_size, num_q_heads, num_kv_heads):
    q, k_cache, v_cache, meta, k_scale, v_scale = fp8_paged_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, num_q_heads,
                                                                  num_kv_heads, head_dim, block_size, torch.float32)
    out = paged_attention(q, k_cache, v_cache, meta, head_dim**-0.5, k_scale=k_scale, v_scale=v_scale)
    expected = reference.paged_attention(q, k_cache, v_cache, meta, head_dim**-0.5, k_scale=k_scale, v_scale=v_scale)
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "q_lens,seq_lens,num_q_heads,num_kv_heads,head_dim,block_size",
    [([1, 1, 1], [1, 33, 600], 4, 2, 64, 16), ([3, 1, 20], [3, 50, 29], 8, 1, 64, 16)]
    + cuda_only(([1] * 6, [8192, 1, 4095, 4096, 4097, 513], 16, 8, 128, 16), ([1] * 256, [2048] * 256, 16, 8, 128, 16),
                ([1] * 64, [8000] * 3 + [17] * 61, 32, 4, 128, 256), ([1, 1], [300, 7000], 8, 8, 64, 32),
                ([1024], [1024], 16, 8, 128, 16), ([1, 300, 1, 2048], [8192, 4396, 2, 2048], 16, 8, 128, 16),
                ([129] * 8, [4000 + i for i in range(8)], 8, 8, 128, 32)),
)
def test_dtypes_and_long_contexts(q_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype):
    """16-bit queries meet the cache's keys and values in float16 (bfloat16 queries too); float32 stays float32."""
    q, k_cache, v_cache, meta, k_scale, v_scale = fp8_paged_batch(q_lens, seq_lens, num_q_heads, num_kv_heads,
                                                                  head_dim, block_size, dtype)
    out = paged_attention(q, k_cache, v_cache, meta, 0.1, k_scale=k_scale, v_scale=v_scale)
    assert out.dtype == dtype
    assert_close(out, reference.paged_attention(q, k_cache, v_cache, meta, 0.1, k_scale=k_scale, v_scale=v_scale),
                 dtype)


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("q_lens,seq_lens", [([1] * 8, [1, 15, 16, 17, 64, 65, 100, 150]),
                                             ([1, 40, 1, 5, 33, 70], [1, 40, 90, 37, 120, 150])])
@pytest.mark.parametrize("window", [1, 16, 20, 100])
def test_window_and_sinks(window, q_lens, seq_lens, with_sinks):
    """Decode (split in 3) and prefill/mixed with a window, the blocks before it freed (NaN), and sinks."""
    q, k_cache, v_cache, meta, k_scale, v_scale = fp8_paged_batch(q_lens, seq_lens, 4, 2, 64, 16, torch.float32)
    free_blocks_before_window(k_cache, v_cache, meta, window)
    sinks = 2 * torch.randn(4, device=DEVICE) if with_sinks else None
    if meta.is_decode:
        out = decode_attention(q, k_cache, v_cache, meta, 0.125, 3, window, sinks, k_scale, v_scale)
    else:
        out = paged_attention(q, k_cache, v_cache, meta, 0.125, window, sinks, k_scale, v_scale)
    expected = reference.paged_attention(q, k_cache, v_cache, meta, 0.125, window, sinks, k_scale, v_scale)
    assert_close(out, expected, torch.float32)


# ---- the fused decode: prologue, quantizing store and attention in one kernel ----------------------------------

def check_fused_decode(contexts, num_q_heads, num_kv_heads, head_dim, block_size, dtype, qk_norm, num_splits,
                       window=0, with_sinks=False, shifted=False):
    """Against the reference's prologue storing into an FP8 cache, then its attention. The new tokens' slots hold
    NaN until stored (row 2 is graph padding: slot -1, nothing stored); a window frees the blocks before it.
    shifted: the rotary positions are given, each before its slot's (an M-RoPE model's)."""
    q, k_cache, v_cache, meta, k_scale, v_scale = fp8_paged_batch([1] * len(contexts), contexts, num_q_heads,
                                                                  num_kv_heads, head_dim, block_size, dtype)
    qkv = torch.randn(len(contexts), (num_q_heads + 2 * num_kv_heads) * head_dim, device=DEVICE).to(dtype)
    norms = tuple((1 + 0.3 * torch.randn(head_dim, device=DEVICE)).to(dtype) for _ in range(2)) if qk_norm else (
        None, None)
    positions = meta.seq_lens.long() - 1
    rows = torch.arange(len(contexts), device=DEVICE)
    slots = meta.block_tables[rows, positions // block_size].long() * block_size + positions % block_size
    slots[2] = -1
    for cache in (k_cache, v_cache):
        cache.view(-1, num_kv_heads, head_dim)[slots[slots >= 0]] = float("nan")
    meta.slot_mapping = slots
    if window:
        free_blocks_before_window(k_cache, v_cache, meta, window)
    sinks = (2 * torch.randn(num_q_heads, device=DEVICE)).to(dtype) if with_sinks else None
    cos_sin = cos_sin_cache(max(contexts), head_dim)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    rotary = positions - positions // 2 if shifted else positions
    q, _, _ = reference.qkv_prologue(qkv, rotary, cos_sin, num_q_heads, num_kv_heads, *norms, 1e-6, k_expected,
                                     v_expected, slots, False, k_scale, v_scale)
    expected = reference.paged_attention(q, k_expected, v_expected, meta, head_dim**-0.5, window, sinks, k_scale,
                                         v_scale)
    out = qkv_decode_attention(qkv, cos_sin, num_q_heads, num_kv_heads, *norms, 1e-6, k_cache, v_cache, meta,
                               head_dim**-0.5, num_splits=num_splits, window=window, sinks=sinks, k_scale=k_scale,
                               v_scale=v_scale, positions=rotary if shifted else None)
    assert_close(out, expected, dtype)
    assert torch.equal(codes(v_cache), codes(v_expected))  # the values are copied: their codes are the reference's
    # The keys are normed and rotated first, which may round differently in the last bit: at most a neighbouring
    # code, rarely.
    key_steps = (codes(k_cache).int() - codes(k_expected).int()).abs()
    assert key_steps.max() <= 1 and key_steps.float().mean() < 0.01


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 2), (8, 1), (6, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fused_decode(head_dim, num_q_heads, num_kv_heads, qk_norm, num_splits):
    check_fused_decode([1, 15, 16, 17, 65, 100], num_q_heads, num_kv_heads, head_dim, 16, torch.float32, qk_norm,
                       num_splits)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_fused_decode_at_given_positions(num_splits):
    check_fused_decode([1, 15, 16, 17, 65, 100], 4, 2, 64, 16, torch.float32, True, num_splits, shifted=True)


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("window", [1, 16, 70])
def test_fused_decode_with_window_and_sinks(window, with_sinks):
    check_fused_decode([1, 15, 16, 17, 65, 100, 150], 4, 2, 64, 16, torch.float32, True, 3, window, with_sinks)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "contexts,num_q_heads,num_kv_heads,head_dim,block_size,num_splits",
    [([1, 33, 600], 4, 2, 64, 16, None)]
    + cuda_only(([2048] * 256, 16, 8, 128, 16, None), ([8192, 1, 4095, 4096, 4097, 513], 16, 8, 128, 16, None),
                ([8000] * 3 + [17] * 61, 32, 4, 128, 256, None), ([300, 7000, 9], 8, 8, 64, 32, 8)),
)
def test_fused_decode_shapes_and_dtypes(contexts, num_q_heads, num_kv_heads, head_dim, block_size, num_splits, dtype):
    check_fused_decode(contexts, num_q_heads, num_kv_heads, head_dim, block_size, dtype, True, num_splits)


# ---- the dispatch's checks ------------------------------------------------------------------------------------

def test_dispatch_refuses_missing_or_misplaced_scales():
    q, k_cache, v_cache, meta, k_scale, v_scale = fp8_paged_batch([1], [20], 4, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="needs k_scale"):
        kernels.paged_attention(q, k_cache, v_cache, meta, 0.125)
    with pytest.raises(ValueError, match=r"needs v_scale: float32 \(2,\)"):
        kernels.paged_attention(q, k_cache, v_cache, meta, 0.125, k_scale=k_scale, v_scale=v_scale[:1])
    with pytest.raises(ValueError, match="belong to an FP8"):
        kernels.paged_attention(q, k_cache.float(), v_cache.float(), meta, 0.125, k_scale=k_scale, v_scale=v_scale)
    with pytest.raises(ValueError, match="one dtype"):
        kernels.paged_attention(q, k_cache, v_cache.float(), meta, 0.125, k_scale=k_scale, v_scale=v_scale)
