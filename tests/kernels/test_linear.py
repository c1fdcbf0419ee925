"""The split-K Triton linear (operands through pointers or tensor descriptors) against F.linear in float32, and
the rule that picks its config."""
import pytest
import torch
import torch.nn.functional as F
from kernel_testing import DEVICE, DTYPES, assert_close, cuda_only

from kernels import gated_linear as dispatched_gated_linear, linear as dispatched_linear, reference
from kernels.split_arrivals import arrival_counters
from kernels.triton_linear import (
    MAX_ROWS,
    POINTER_ROWS,
    choose_config,
    decode_linear,
    descriptors_fit,
    gated_linear,
    linear,
)

pytestmark = pytest.mark.usefixtures("poisoned_outputs")

# (rows, outputs, K, config (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps, stages, descriptors)): row and column
# tiles cut short by masks (pointers) or by the descriptor's bounds, K split in 1-4 parts, several row tiles.
CASES = [
    (1, 40, 64, (16, 16, 16, 4, 4, 2, False)),
    (5, 48, 64, (16, 32, 32, 2, 4, 2, False)),
    (17, 64, 128, (16, 16, 32, 1, 4, 2, False)),
    (33, 30, 96, (16, 16, 16, 3, 4, 2, False)),
    (3, 40, 64, (16, 16, 16, 4, 4, 2, True)),
    (70, 48, 128, (64, 32, 32, 2, 4, 2, True)),
    (130, 40, 96, (64, 16, 32, 3, 4, 2, True)),
    *cuda_only((64, 1024, 2048, (64, 32, 128, 4, 4, 4, False)), (128, 4096, 1024, (64, 32, 128, 1, 4, 4, False)),
               (200, 6144, 1024, (64, 128, 64, 1, 4, 4, True)), (96, 1024, 3072, (64, 32, 128, 2, 4, 4, True))),
]


def _inputs(m, n, k, dtype):
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    weight = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    return x, weight, bias


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,config", CASES)
def test_linear_matches_torch(m, n, k, config, dtype, with_bias):
    x, weight, bias = _inputs(m, n, k, dtype)
    bias = bias if with_bias else None
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(dtype)
    assert_close(linear(x, weight, bias, config), expected, dtype)


# (rows, intermediate size I, K, config): gate and up tiles cut short (I not a multiple of BLOCK_N), K split or
# not, through pointers and descriptors.
GATED_CASES = [
    (3, 40, 128, (16, 16, 32, 2, 4, 2, False)),
    (20, 32, 96, (16, 16, 32, 1, 4, 2, False)),
    (70, 48, 128, (64, 32, 64, 2, 4, 2, True)),
    (5, 24, 64, (16, 16, 16, 4, 4, 2, True)),
    *cuda_only((64, 3072, 1024, (64, 16, 128, 1, 4, 4, False)), (200, 3072, 1024, (64, 64, 64, 1, 4, 4, True))),
]


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,inter,k,config", GATED_CASES)
def test_gated_linear_matches_the_projection_then_the_activation(m, inter, k, config, dtype, with_bias, activation):
    """Each program's gate columns meet their own up columns: act(x W_gate^T + b_gate) * (x W_up^T + b_up)."""
    x, weight, bias = _inputs(m, 2 * inter, k, dtype)
    bias = bias if with_bias else None
    expected = reference.gated_linear(x.float(), weight.float(), None if bias is None else bias.float(), activation)
    assert_close(linear(x, weight, bias, config, activation), expected.to(dtype), dtype)


def test_gated_linear_refuses_an_unknown_activation():
    x, weight, _ = _inputs(2, 32, 64, torch.float32)
    with pytest.raises(ValueError, match="'gelu' is not one of silu, gelu_tanh"):
        linear(x, weight, None, (16, 16, 16, 1, 4, 2, False), "gelu")


@pytest.mark.parametrize("m", [3, POINTER_ROWS + 6, MAX_ROWS + 1])
def test_dispatched_gated_linear_matches_the_reference(m):
    """kernels.gated_linear: one launch where choose_config picks the kernel for the [2I, K] product (on CUDA;
    here too when called directly), the projection then the activation above MAX_ROWS or on CPU."""
    x, weight, bias = _inputs(m, 2 * 48, 256, torch.float32)
    expected = reference.gated_linear(x, weight, bias, "silu")
    assert_close(dispatched_gated_linear(x, weight, bias, "silu"), expected, torch.float32)
    assert_close(gated_linear(x, weight, bias, "silu"), expected, torch.float32)


def test_split_k_counters_return_to_zero_at_every_launch():
    """The last part of each tile adds the partials and resets its counter, so the next launch (a graph's
    replay) adds again; a counter left at a count would make later launches skip or repeat the sum."""
    x, weight, _ = _inputs(20, 48, 128, torch.float32)
    expected = F.linear(x, weight)
    for _ in range(3):
        for descriptors in (False, True):
            assert_close(linear(x, weight, None, (16, 16, 32, 4, 4, 2, descriptors)), expected, torch.float32)
            assert not arrival_counters(1, x.device).any()


@pytest.mark.parametrize("descriptors", [False, True])
def test_linear_reads_strided_rows(descriptors):
    """A row stride larger than K (a slice of a wider activation) is read as such."""
    wide, weight, _ = _inputs(6, 32, 128, torch.float32)
    x = wide[:, :64]
    assert_close(linear(x, weight[:, :64].contiguous(), None, (16, 16, 16, 2, 4, 2, descriptors)),
                 F.linear(x, weight[:, :64]), torch.float32)


def test_linear_rejects_k_not_divisible_by_its_split():
    x, weight, _ = _inputs(2, 16, 48, torch.float32)
    with pytest.raises(ValueError, match="multiple of 2 x 32"):
        linear(x, weight, None, (16, 16, 32, 2, 4, 2, False))


def test_misaligned_rows_go_to_cublas_not_descriptors():
    """A descriptor needs 16-byte aligned starts and row strides: a slice that starts one element in is refused by
    the descriptor kernel, and decode_linear computes it with F.linear instead."""
    wide, weight, _ = _inputs(POINTER_ROWS + 8, 64, 257, torch.float32)
    x, weight = wide[:, 1:], weight[:, 1:].contiguous()
    assert not descriptors_fit(x, weight) and descriptors_fit(x.contiguous(), weight)
    with pytest.raises(ValueError, match="16-byte aligned"):
        linear(x, weight, None, (64, 32, 64, 1, 4, 2, True))
    assert_close(decode_linear(x, weight, None), F.linear(x, weight), torch.float32)


H100 = {"sms": 132, "shared_memory": 227 * 1024, "l2_bytes": 50 * 2**20}


@pytest.mark.parametrize("m,n,k,expected", [
    (1, 1024, 2048, (16, 16, 128, 2, 2, 6, False)),    # 64 narrow tiles of 16 columns: two parts fill 128 SMs
    (64, 1024, 3072, (64, 16, 128, 2, 4, 6, False)),
    (16, 4096, 1024, (16, 32, 128, 1, 4, 4, False)),   # wider than NARROW_N: 32 columns, 128 tiles
    (64, 6144, 1024, (64, 32, 128, 1, 4, 4, False)),
    (24, 1024, 384, (64, 16, 128, 1, 4, 6, False)),    # K = 3 x 128 splits in neither 2 nor 4
    (1, 2048, 4096, (16, 16, 128, 2, 2, 6, False)),    # 128 tiles fill the wave, but K is longer than 2,048
    (1, 4096, 12288, (16, 32, 128, 4, 4, 4, False)),   # as long as MAX_SPLIT_K allows
    (64, 2048, 4096, (64, 16, 128, 1, 4, 6, False)),   # 64-row tiles: the wave alone decides
    # descriptors from 65 rows: the widest column tiles that make at least 66 tiles
    (128, 4096, 1024, (64, 64, 128, 1, 4, 6, True)),   # 128 tiles of 64 columns (128 columns: only 64)
    (128, 1024, 2048, (64, 32, 128, 2, 4, 6, True)),   # 32 columns at the least, so 64 tiles: K in two
    (256, 4096, 1024, (64, 128, 128, 1, 4, 4, True)),  # 128 tiles; 4 stages of 48 KB fill shared memory
    (256, 6144, 1024, (64, 128, 64, 1, 4, 4, True)),   # 192 tiles, two per SM: K tiles of 64, 4 stages each
    (256, 1024, 3072, (64, 32, 128, 1, 4, 6, True)),
])
def test_config_fills_one_wave(m, n, k, expected):
    assert choose_config(m, n, k, **H100) == expected


@pytest.mark.parametrize("shared_memory,element_size,stages", [
    (227 * 1024, 2, 6), (227 * 1024, 4, 4),  # float32 tiles of 6 stages need 240 KB
    (99 * 1024, 2, 4),                       # an L4's or A10's 99 KB: 120 KB do not fit
])
def test_narrow_tiles_deepen_their_pipeline_only_where_it_fits(shared_memory, element_size, stages):
    gpu = {**H100, "shared_memory": shared_memory}
    assert choose_config(64, 1024, 2048, **gpu, element_size=element_size)[5] == stages


@pytest.mark.parametrize("m,n,expected_kernel", [
    (64, 151936, True),    # one row tile reads the LM head's 311 MB once
    (65, 151936, False),   # two would read it twice from memory: cuBLAS
    (128, 4096, True),     # 8 MB: the second row tile finds the weight in L2
])
def test_weights_past_l2_keep_one_row_tile(m, n, expected_kernel):
    assert (choose_config(m, n, 1024, **H100) is not None) == expected_kernel


@pytest.mark.parametrize("m,k", [(MAX_ROWS + 1, 1024), (8, 1000), (0, 1024)])
def test_config_leaves_large_batches_odd_k_and_no_rows_to_cublas(m, k):
    assert choose_config(m, 1024, k, **H100) is None


@pytest.mark.parametrize("m", [1, 3])
def test_dispatched_linear_matches_torch(m):
    """kernels.linear: the Triton kernel where the config rule picks it (on CUDA), the reference on CPU;
    either way F.linear's result, bias included, for contiguous and transposed inputs."""
    x, weight, bias = _inputs(m, 64, 256, torch.float32)
    expected = F.linear(x, weight, bias)
    assert_close(dispatched_linear(x, weight, bias), expected, torch.float32)
    assert_close(decode_linear(x, weight, bias), expected, torch.float32)
    x_t = x.t().contiguous().t()  # column-major rows: not this kernel's layout, so cuBLAS
    assert_close(decode_linear(x_t, weight, bias), expected, torch.float32)
