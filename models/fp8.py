"""FP8 checkpoints: what their quantization_config says, how the weight scales load, and what the weights
become once loaded.

Two formats are read, both with e4m3 weights and float32 scales that multiply them:
- `quant_method: "fp8"` (transformers' fine-grained FP8, the Qwen3 `-FP8` checkpoints): `weight_scale_inv`
  per block of weight_block_size (128 x 128), or one per tensor without a block size; dynamic activations.
- `quant_method: "compressed-tensors"` with float 8-bit weights (`float-quantized`): `weight_scale` per output
  channel, per tensor or per block; activations dynamic per token (a static `input_scale` is not used: our
  GEMMs quantize activations per token as they go).

While loading, a layer's scales are kept per output row ([rows, K groups], a block's scale repeated on each
of its rows), so fused projections (q|k|v, gate|up, from parts with scales of their own), row splits across
tensor-parallel ranks and the head layout of models/rotary.py move rows with their scales. Tensor
parallelism must keep K groups whole: a rank's input features must be a multiple of the block's columns.

After loading (finish_fp8): on a GPU with e4m3 conversions (kernels/gpu_features.py) the weights stay FP8 and
the projections run as FP8 GEMMs, `method` choosing ours in Triton (block scales, activations quantized per
token and per 128 columns inside the kernel) or, where the GPU has it, torch._scaled_mm (one scale per row and
per token; block-scaled weights are requantized per row for it). Anywhere else, and wherever
HFENDPOINT_GPU_FEATURES turns e4m3 off, they are dequantized into the model's dtype.
"""

import re
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels import dequantize_fp8, gpu_features

E4M3 = torch.float8_e4m3fn
FP8_GEMMS = ("scaled_mm", "triton")  # the first is the default: bench/RESULTS.md says why
TRITON_GROUP_K = 128  # the Triton kernel's K tile: weight scale groups must be multiples of it
REQUANTIZE_ROWS = 4096  # rows dequantized at a time when requantizing for torch._scaled_mm


@dataclass(frozen=True)
class Fp8Format:
    """block: (rows, columns) of weight sharing one scale; None for one scale per output row or per tensor."""

    block: tuple[int, int] | None
    ignored: tuple[str, ...]
    method: str  # the GEMM on Hopper: "triton" or "scaled_mm"

    def groups(self, in_features: int) -> int:
        """Scale columns of a weight with `in_features` columns."""
        return -(-in_features // self.block[1]) if self.block else 1

    def is_ignored(self, name: str) -> bool:
        """Whether the checkpoint left module `name` unquantized (transformers' matching: a prefix at a module
        boundary, a regex, or a suffix; compressed-tensors' "re:" regexes)."""
        for pattern in self.ignored:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], name):
                    return True
            elif re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", name) or name.endswith(pattern):
                return True
        return False


def fp8_format(hf_config, method: str = "scaled_mm") -> Fp8Format | None:
    """The checkpoint's FP8 format from its quantization_config (None without one); ValueError naming the
    field for a quantization we cannot serve."""
    if method not in FP8_GEMMS:
        raise ValueError(f"fp8_gemm must be one of {', '.join(FP8_GEMMS)}, got {method!r}")
    quant = getattr(hf_config, "quantization_config", None)
    if quant is None:
        return None
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    kind = quant.get("quant_method")
    if kind == "fp8":
        return _finegrained_format(quant, method)
    if kind == "compressed-tensors":
        return _compressed_tensors_format(quant, method)
    if kind == "mxfp4":  # gpt-oss: only its experts, kept in MXFP4 by models/moe.py
        if getattr(hf_config, "model_type", None) != "gpt_oss":
            raise ValueError(f"quantization_config.quant_method 'mxfp4' is supported for gpt-oss's experts only (the "
                             f"format transformers defines), not for model type {hf_config.model_type!r}")
        return None
    raise ValueError(f"quantization_config.quant_method {kind!r} is not supported (supported: 'fp8' and "
                     "'compressed-tensors' with FP8 weights)")


def _finegrained_format(quant: dict, method: str) -> Fp8Format:
    _require(quant.get("fmt", "e4m3") == "e4m3", "fmt", quant.get("fmt"), "'e4m3'")
    _require(quant.get("activation_scheme", "dynamic") == "dynamic", "activation_scheme",
             quant.get("activation_scheme"), "'dynamic'")
    block = quant.get("weight_block_size")
    _require(block is None or (len(block) == 2 and all(int(b) > 0 for b in block)), "weight_block_size", block,
             "two positive integers or null")
    ignored = quant.get("modules_to_not_convert") or quant.get("ignored_layers") or ()
    return Fp8Format(tuple(int(b) for b in block) if block else None, tuple(ignored), method)


def _compressed_tensors_format(quant: dict, method: str) -> Fp8Format:
    _require(quant.get("format") == "float-quantized", "format", quant.get("format"), "'float-quantized' (FP8)")
    _require(quant.get("kv_cache_scheme") is None, "kv_cache_scheme", quant.get("kv_cache_scheme"),
             "null (an FP8 KV cache is not supported)")
    groups = list((quant.get("config_groups") or {}).values())
    _require(len(groups) > 0, "config_groups", None, "at least one group")
    weights = [group.get("weights") or {} for group in groups]
    _require(all(w == weights[0] for w in weights), "config_groups", "groups with different weight schemes",
             "one weight scheme")
    scheme = weights[0]
    _require(scheme.get("type") == "float" and scheme.get("num_bits") == 8, "config_groups.weights",
             f"type {scheme.get('type')!r}, num_bits {scheme.get('num_bits')}", "type 'float', num_bits 8")
    _require(scheme.get("symmetric", True) and not scheme.get("dynamic", False), "config_groups.weights",
             "asymmetric or dynamic weights", "symmetric static weights")
    strategy = scheme.get("strategy")
    _require(strategy in ("channel", "tensor", "block"), "config_groups.weights.strategy", strategy,
             "'channel', 'tensor' or 'block'")
    for group in groups:
        activations = group.get("input_activations")
        _require(activations is None or (activations.get("type") == "float" and activations.get("num_bits") == 8),
                 "config_groups.input_activations", activations, "FP8 or null")
        _require("Linear" in group.get("targets", ["Linear"]), "config_groups.targets", group.get("targets"),
                 "['Linear']")
    block = tuple(int(b) for b in scheme["block_structure"]) if strategy == "block" else None
    return Fp8Format(block, tuple(quant.get("ignore") or ()), method)


def _require(ok: bool, field: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"quantization_config.{field} = {value!r} is not supported (supported: {allowed})")


def is_fp8(loaded) -> bool:
    """Whether a checkpoint tensor or safetensors slice holds e4m3 values."""
    if isinstance(loaded, Tensor):
        return loaded.dtype == E4M3
    return loaded.get_dtype() == "F8_E4M3"


# ---- after loading ----------------------------------------------------------------------------------

def fp8_gemm_for(layer, device: torch.device) -> str | None:
    """The FP8 GEMM a layer's projection runs on device: its format's method where the device has it
    (torch._scaled_mm also needs what _scaled_mm_takes says), else "triton"; None where the device has no e4m3
    conversions (the weight is dequantized). The one place kernels/gpu_features.py decides FP8 weights."""
    if not gpu_features.device_supports("e4m3", device):
        return None
    if layer.quant.method == "scaled_mm" and _scaled_mm_takes(layer) and gpu_features.device_supports("scaled_mm",
                                                                                                       device):
        return "scaled_mm"
    return "triton"


def finish_fp8(layer) -> None:
    """Turn a loaded layer's FP8 weight and per-row scales [N, G] into what its forward uses: a dequantized
    weight (scale_block None), or FP8 with the scales its GEMM reads (layer.scale_block = rows and columns
    of weight per scale). The Triton kernel takes where torch._scaled_mm cannot (see _scaled_mm_takes); a
    checkpoint whose scale blocks split the kernel's 128-column tiles is dequantized."""
    weight, scale, fmt = layer.weight.data, layer.weight_scale.data, layer.quant
    block_cols = fmt.block[1] if fmt.block else weight.shape[1]
    method = fp8_gemm_for(layer, weight.device)
    triton_fits = block_cols % TRITON_GROUP_K == 0 or block_cols >= weight.shape[1]
    if method is None or (method == "triton" and not triton_fits):
        layer.dequantize_weight()
        return
    layer.fp8_method = method
    if method == "triton":
        layer.set_fp8_weight(weight, *_compact_block_rows(scale, fmt, block_cols))
    elif scale.shape[1] == 1:
        layer.set_fp8_weight(weight, scale, (1, weight.shape[1]))
    else:
        layer.set_fp8_weight(*requantize_rows(weight, scale, block_cols), (1, weight.shape[1]))


def _scaled_mm_takes(layer) -> bool:
    """torch._scaled_mm's row-wise mode writes bfloat16 only, for N and K multiples of 16."""
    rows, cols = layer.weight.shape
    return layer.dtype == torch.bfloat16 and rows % 16 == 0 and cols % 16 == 0


def _compact_block_rows(scale: Tensor, fmt: Fp8Format, block_cols: int) -> tuple[Tensor, tuple[int, int]]:
    """The per-row scales as one row per block when every block of rows shares its scales (projections
    whose parts and rank split are block-aligned), else as they are."""
    block_rows = fmt.block[0] if fmt.block else 1
    rows = scale.shape[0]
    if block_rows > 1 and rows % block_rows == 0:
        blocks = scale.view(rows // block_rows, block_rows, -1)
        if torch.equal(blocks, blocks[:, :1].expand_as(blocks)):
            return blocks[:, 0].contiguous(), (block_rows, block_cols)
    return scale.contiguous(), (1, block_cols)


def requantize_rows(weight: Tensor, scale: Tensor, block_cols: int) -> tuple[Tensor, Tensor]:
    """Block-scaled FP8 as FP8 with one scale per row (what torch._scaled_mm's row-wise mode reads): each row
    dequantized, then scaled so its largest magnitude is e4m3's largest."""
    out, row_scales = torch.empty_like(weight), torch.empty(weight.shape[0], 1, device=weight.device)
    for start in range(0, weight.shape[0], REQUANTIZE_ROWS):
        rows = slice(start, start + REQUANTIZE_ROWS)
        values = dequantize_fp8(weight[rows], scale[rows], (1, block_cols), torch.float32)
        row_scales[rows] = values.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / torch.finfo(E4M3).max
        out[rows] = (values / row_scales[rows]).to(E4M3)
    return out, row_scales
