"""FP8 checkpoints (block-wise "fp8", compressed-tensors per channel and per tensor) made here from tiny random
models: dequantized at load off Hopper, they compute what transformers computes on the dequantized weights; on
the FP8-GEMM path (forced here, run by the torch reference kernel) the weights keep their values and scales.
Bad formats, tensor-parallel sizes that split blocks, and weights that are not what the config says are
named."""
import pytest
import torch
from decoder_testing import COMMON, CONFIGS, varlen_metadata
from gpu_capability import pretend_capability
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from kernels import dequantize_fp8
from models import fp8
from models.llama import check_tensor_parallel
from models.parallel_layers import ParallelLinear
from models.registry import load_model
from random_decoders import save_fp8_decoder

CPU = torch.device("cpu")
HOPPER = (9, 0)
CHECKPOINTS = {  # name: (config, format, block overriding the format's)
    "llama-block": ("llama-gqa", "fp8-block", None),
    "llama-unaligned-blocks": ("llama-gqa", "fp8-block", (48, 32)),  # q|k|v parts straddle blocks
    "qwen3-channel": ("qwen3", "compressed-channel", None),
    "qwen2-tensor": ("qwen2", "compressed-tensor", None),  # q/k/v biases; a scale per tensor and input_scale
    "phi3-fused-block": ("phi3-longrope", "fp8-block", None),  # fused qkv_proj, padded heads
}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    config, fmt, block = CHECKPOINTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    return path, save_fp8_decoder(CONFIGS[config](), path, fmt, block)


def logits(model, prompt: torch.Tensor) -> torch.Tensor:
    hidden = model(prompt, torch.arange(len(prompt)), varlen_metadata([len(prompt)]))
    return model.compute_logits(hidden).float()


PROMPT = torch.randint(0, 320, (13,), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def test_dequantized_at_load_matches_transformers(checkpoint):
    path, reference = checkpoint
    model = load_model(str(path), torch.float32, CPU).model
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(layer.weight_scale is None for layer in model.modules() if isinstance(layer, ParallelLinear))
    torch.testing.assert_close(logits(model, PROMPT), reference(PROMPT[None]).logits[0], atol=1e-4, rtol=1e-4)


GEMM_CHECKPOINTS = {  # 128 x 128 blocks, as the Triton kernel's tiles need
    "llama-wide-block": (lambda: LlamaConfig(**{**COMMON, "hidden_size": 128, "intermediate_size": 256},
                                             num_key_value_heads=2), "fp8-block", (128, 128)),
    "qwen3-channel": (CONFIGS["qwen3"], "compressed-channel", None),
    "phi3-fused-block": (CONFIGS["phi3-longrope"], "fp8-block", (128, 128)),
}


@pytest.fixture(scope="module", params=sorted(GEMM_CHECKPOINTS))
def gemm_checkpoint(request, tmp_path_factory):
    config, fmt, block = GEMM_CHECKPOINTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    return path, save_fp8_decoder(config(), path, fmt, block)


@pytest.mark.parametrize("method", ["triton", "scaled_mm"])
@torch.no_grad()
def test_fp8_gemm_path_keeps_the_weights(gemm_checkpoint, method, monkeypatch):
    """Where FP8 GEMMs run, each projection stays e4m3 with the scales of its GEMM: the same values as the
    dequantized weight (block scales compacted back where whole blocks of rows share them, for the Triton
    kernel; requantized per row, to within e4m3's rounding, for torch._scaled_mm). The logits stay near the
    dequantized model's: e4m3 activations move each projection by a few percent, more after a few layers of
    a tiny random model; a wrong scale moves them by far more."""
    path, _ = gemm_checkpoint
    dequantized = load_model(str(path), torch.bfloat16, CPU).model
    pretend_capability(monkeypatch, HOPPER)
    model = load_model(str(path), torch.bfloat16, CPU, fp8_gemm=method).model
    layers = dict(dequantized.named_modules())
    kept = 0
    for name, layer in model.named_modules():
        if not isinstance(layer, ParallelLinear) or layer.weight_scale is None:
            continue
        kept += 1
        assert layer.weight.dtype == fp8.E4M3 and layer.fp8_method == method
        values = dequantize_fp8(layer.weight, layer.weight_scale, layer.scale_block, torch.float32)
        expected = layers[name].weight.float()
        if method == "triton":
            torch.testing.assert_close(values, expected, rtol=2 ** -8, atol=0)  # the bfloat16 rounding alone
        else:
            assert layer.scale_block == (1, layer.weight.shape[1])
            torch.testing.assert_close(values, expected, rtol=2 ** -3, atol=expected.abs().max().item() * 2 ** -9)
    assert kept >= 6  # every projection but a padded head layout's o_proj (dequantized)
    want = logits(dequantized, PROMPT)
    assert (logits(model, PROMPT) - want).abs().max() < 0.5 * want.abs().max()


def test_block_scales_are_compacted_where_rows_share_them(tmp_path, monkeypatch):
    pretend_capability(monkeypatch, HOPPER)
    config, fmt, block = GEMM_CHECKPOINTS["llama-wide-block"]
    save_fp8_decoder(config(), tmp_path, fmt, block)
    layer = load_model(str(tmp_path), torch.float32, CPU).model.model.layers[0]
    assert layer.self_attn.qkv_proj.scale_block == (1, 128)  # k's 64 rows end inside a block: scales per row
    assert layer.self_attn.qkv_proj.weight_scale.shape == (256, 1)
    assert layer.mlp.gate_up_proj.scale_block == (128, 128) and layer.mlp.gate_up_proj.weight_scale.shape == (4, 1)
    assert layer.mlp.down_proj.scale_block == (128, 128) and layer.mlp.down_proj.weight_scale.shape == (1, 2)


def test_ignored_projections_stay_unquantized(tmp_path):
    reference = save_fp8_decoder(CONFIGS["llama-gqa"](), tmp_path, "fp8-block",
                                 unquantized=("model.layers.1.mlp.down_proj",))
    model = load_model(str(tmp_path), torch.float32, CPU).model
    torch.testing.assert_close(logits(model, PROMPT), reference(PROMPT[None]).logits[0], atol=1e-4, rtol=1e-4)


def test_partly_ignored_fused_projection_is_refused(tmp_path):
    save_fp8_decoder(CONFIGS["llama-gqa"](), tmp_path, "fp8-block", unquantized=("model.layers.0.self_attn.k_proj",))
    with pytest.raises(ValueError, match=r"leaves \['model.layers.0.self_attn.k_proj'\] unquantized but not the rest"):
        load_model(str(tmp_path), torch.float32, CPU)


def test_weight_that_is_not_fp8_is_named(tmp_path):
    save_fp8_decoder(CONFIGS["llama-gqa"](), tmp_path, "fp8-block")
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.0.mlp.up_proj.weight"] = weights["model.layers.0.mlp.up_proj.weight"].float()
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="'model.layers.0.mlp.up_proj.weight' is not FP8 but the quantization_config"):
        load_model(str(tmp_path), torch.float32, CPU)


def test_tensor_parallel_size_that_splits_blocks_is_refused():
    config = CONFIGS["llama-gqa"]()
    config.quantization_config = {"quant_method": "fp8", "weight_block_size": [32, 32]}
    check_tensor_parallel(config, 1)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 splits the FP8 weight blocks of down_proj: its 112"):
        check_tensor_parallel(config, 2)


@pytest.mark.parametrize("quantization,message", [
    ({"quant_method": "awq"}, "quant_method 'awq' is not supported"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme = 'static' is not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt = 'e5m2' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "format = 'pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "kv_cache_scheme": {"num_bits": 8},
      "config_groups": {}}, "kv_cache_scheme"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"type": "int", "num_bits": 4, "strategy": "group"}}}},
     r"config_groups.weights = \"type 'int', num_bits 4\""),
    ({"quant_method": "mxfp4"}, "'mxfp4' is supported for gpt-oss's experts only.*not for model type 'llama'"),
])
def test_unsupported_quantization_is_named(quantization, message):
    config = CONFIGS["llama-gqa"]()
    config.quantization_config = quantization
    with pytest.raises(ValueError, match=message):
        fp8.fp8_format(config)
