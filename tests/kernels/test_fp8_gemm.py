"""The FP8 GEMMs (our Triton block-scaled kernel, and torch._scaled_mm after our per-row quantizer) against the
torch reference: activations quantized to e4m3 per token, times the dequantized weight.

Triton's interpreter converts float32 to e4m3 wrongly where rounding carries into the exponent (124.9 comes
out as 64, not 128), so on the CPU the activations are built from e4m3 values times a power of two, with
each row's largest magnitude 448 times it in every 128-column tile: quantizing them is exact, and the test
still checks every scale, block, mask and split. On CUDA they are random."""
import pytest
import torch
from kernel_testing import DEVICE, ON_CUDA

from kernels import reference
from kernels.triton_fp8_gemm import choose_config, quantize_rows, scaled_mm_linear, triton_fp8_linear

pytestmark = pytest.mark.usefixtures("poisoned_outputs")
E4M3 = torch.float8_e4m3fn
# Hopper's FP8 tensor cores (the 64- and 128-row tiles) add products in fewer bits than float32 within a K tile
# (DeepSeek-V3's report, 3.3.2), so their float32 outputs stray from the reference past float32's own tolerance.
FLOAT32_TOLERANCE = 1e-3 if ON_CUDA else 1e-4


def activations(m: int, k: int, dtype: torch.dtype, group: int = 128) -> torch.Tensor:
    """[m, k] activations whose per-token, per-`group` quantization is exact off CUDA (see the docstring)."""
    if ON_CUDA:
        return torch.randn(m, k, device=DEVICE).to(dtype)
    values = torch.randn(m, k).mul(100).clamp(-440, 440).to(E4M3).float()
    values[:, ::group] = 448.0
    scale = 2.0 ** torch.randint(-6, 2, (m, 1)).float()
    return (values * scale).to(dtype).to(DEVICE)


def weights(n: int, k: int, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = block
    weight = torch.randn(n, k, device=DEVICE).mul(64).clamp(-448, 448).to(E4M3)
    scale = torch.rand(-(-n // rows), -(-k // cols), device=DEVICE) * 0.02 + 0.001
    return weight, scale


def assert_close_to_scale(out: torch.Tensor, expected: torch.Tensor, tolerance: float) -> None:
    """Close within tolerance of the output's largest magnitude (float32 sums in another order)."""
    torch.testing.assert_close(out.float(), expected.float(), rtol=0,
                               atol=tolerance * expected.float().abs().max().item())


CASES = [  # m, n, k, weight scale block
    (1, 64, 256, (128, 128)),
    (3, 96, 200, (1, 128)),  # K not a multiple of the tile, per-row block scales
    (16, 48, 128, (1, 128)),
    (17, 64, 384, (128, 128)),  # two row tiles
    (5, 32, 96, (1, 96)),  # per-channel scales: one column group
    (130, 64, 256, (128, 256)),  # past the decode sizes: 128 x 128 tiles; 256-column scale blocks
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if ON_CUDA else [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k,block", CASES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_triton_fp8_gemm_matches_reference(m, n, k, block, dtype, with_bias):
    x = activations(m, k, dtype)
    weight, scale = weights(n, k, block)
    bias = torch.randn(n, device=DEVICE).to(dtype) if with_bias else None
    expected = reference.fp8_linear(x, weight, scale, block, bias, method="triton")
    out = triton_fp8_linear(x, weight, scale, block, bias)
    assert out.dtype == dtype
    assert_close_to_scale(out, expected, FLOAT32_TOLERANCE if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("split_k", [1, 2, 4])
def test_triton_fp8_gemm_split_k_adds_every_part(split_k):
    """K = 5 tiles split 2 or 4 ways: some splits hold fewer tiles (or none), each tile sums all of them."""
    m, n, k, block = 4, 64, 640, (128, 128)
    x, (weight, scale) = activations(m, k, torch.float32), weights(n, k, block)
    expected = reference.fp8_linear(x, weight, scale, block)
    out = triton_fp8_linear(x, weight, scale, block, config=(16, 32, split_k, 4, 2))
    assert_close_to_scale(out, expected, 1e-5)


def test_decode_sizes_split_k_to_fill_the_gpu():
    assert choose_config(1, 4096, 4096, sms=132)[:3] == (16, 32, 1)  # 128 tiles: one wave already
    assert choose_config(1, 2048, 4096, sms=132)[:3] == (16, 32, 2)
    assert choose_config(40, 1024, 4096, sms=132)[:3] == (64, 32, 4)
    assert choose_config(512, 4096, 4096, sms=132)[:3] == (128, 128, 1)


def test_quantize_rows_is_per_token():
    x = activations(6, 300, torch.float32, group=300)
    values, scales = quantize_rows(x)
    expected_values, expected_scales = reference.quantize_fp8(x, (1, 300))
    assert values.dtype == E4M3 and scales.shape == (6, 1)
    torch.testing.assert_close(scales, expected_scales)
    assert torch.equal(values.float(), expected_values.float())


@pytest.mark.parametrize("with_bias", [False, True])
def test_scaled_mm_path_matches_reference(with_bias):
    """torch._scaled_mm with row-wise scales (bfloat16 out, as on Hopper; the CPU build has it too)."""
    m, n, k = 5, 48, 256
    x = activations(m, k, torch.bfloat16, group=k)
    weight, scale = weights(n, k, (1, k))
    bias = torch.randn(n, device=DEVICE).to(torch.bfloat16) if with_bias else None
    expected = reference.fp8_linear(x, weight, scale, (1, k), bias, method="scaled_mm")
    out = scaled_mm_linear(x, weight, scale, bias)
    assert_close_to_scale(out, expected, 1e-2)


def test_block_columns_must_hold_whole_tiles():
    x, (weight, scale) = activations(2, 256, torch.float32), weights(32, 256, (1, 64))
    with pytest.raises(ValueError, match="blocks of 64 columns"):
        triton_fp8_linear(x, weight, scale, (1, 64))
