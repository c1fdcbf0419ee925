"""MXFP4 dequantization against values quantized here from the format's definition, and against transformers'
own dequantization of gpt-oss checkpoints."""
import pytest
import torch
from moe_testing import quantize_mxfp4

from kernels.mxfp4 import dequantize_mxfp4
from models.moe import require_mxfp4


def test_dequantize_gives_the_quantized_values():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 128) * torch.logspace(-3, 2, 5)[None, :, None]  # groups of very different scales
    x[0, 0, :32] = 0.0  # an all-zero group
    blocks, scales, values = quantize_mxfp4(x)
    out = dequantize_mxfp4(blocks.flatten(-2), scales, torch.float32)
    assert out.shape == x.shape
    assert torch.equal(out, values)
    assert (out - x).abs().max() <= x.abs().max() / 6  # really a quantization of x, not something else
    assert torch.equal(dequantize_mxfp4(blocks.flatten(-2), scales, torch.bfloat16), values.to(torch.bfloat16))


def test_dequantize_matches_transformers():
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    torch.manual_seed(1)
    blocks, scales, _ = quantize_mxfp4(torch.randn(4, 6, 64))  # [E, rows, K]: gpt-oss's expert layout
    expected = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # transposed: [E, K, rows]
    assert torch.equal(dequantize_mxfp4(blocks.flatten(-2), scales, torch.float32), expected.transpose(1, 2))


def test_dequantize_rejects_mismatched_scales():
    blocks = torch.zeros(2, 64, dtype=torch.uint8)  # four groups' codes a row
    with pytest.raises(ValueError, match="do not fit scales"):
        dequantize_mxfp4(blocks, torch.zeros(2, 3, dtype=torch.uint8), torch.float32)
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize_mxfp4(blocks, torch.zeros(2, 4), torch.float32)


def test_mxfp4_experts_are_refused_at_load_on_a_gpu_that_cannot_read_them(monkeypatch):
    """A T4 (7.5) cannot compile tl.dot_scaled: refused when the model is built, naming what to deploy on."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(ValueError, match=r"MXFP4, which needs compute capability 8\.0 .* this GPU has 7\.5"):
        require_mxfp4(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    require_mxfp4(torch.device("cuda"))
    require_mxfp4(torch.device("cpu"))
