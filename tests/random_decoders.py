"""Tiny random decoders saved as transformers checkpoints, shared by the test folders (tests/ is on the import
path: its conftest.py puts it there)."""
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, PretrainedConfig


def save_random_decoder(config: PretrainedConfig, path, random_biases_and_norms: bool = True, **save_kwargs):
    """A seeded random transformers model of `config` saved under `path`; returns it in eval mode. With
    random_biases_and_norms, biases and norm weights are drawn too, so a wrong weight mapping (or a bias
    applied twice) cannot hide behind zeros and ones."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if random_biases_and_norms:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    param.copy_(torch.randn_like(param) * 0.5 + (0.0 if name.endswith("bias") else 1.0))
    model.save_pretrained(path, **save_kwargs)
    return model.eval()


FP8_MAX = 448.0


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] as e4m3 with one float32 scale per block (the block's largest magnitude maps to 448):
    (values, scales [ceil(N / rows), ceil(K / cols)]). block (N, K): one scale; (1, K): one per row."""
    rows, cols = block
    n, k = weight.shape
    padded = torch.nn.functional.pad(weight.float(), (0, -k % cols, 0, -n % rows))
    blocks = padded.view(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)
    scales = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    values = (blocks / scales[:, None, :, None]).to(torch.float8_e4m3fn).view(padded.shape)[:n, :k]
    return values.contiguous(), scales


def dequantized(values: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = block
    full = scales.repeat_interleave(rows, 0)[:values.shape[0]].repeat_interleave(cols, 1)[:, :values.shape[1]]
    return values.float() * full


FP8_FORMATS = {
    # name: (quantization_config, scale tensor name, block of the scales given the weight's shape)
    "fp8-block": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [32, 32]}, "weight_scale_inv", lambda n, k: (32, 32)),
    "compressed-channel": ({"quant_method": "compressed-tensors", "format": "float-quantized",
                            "quantization_status": "compressed", "ignore": ["lm_head"], "kv_cache_scheme": None,
                            "config_groups": {"group_0": {
                                "targets": ["Linear"],
                                "weights": {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True,
                                            "dynamic": False},
                                "input_activations": {"type": "float", "num_bits": 8, "strategy": "token",
                                                      "symmetric": True, "dynamic": True}}}},
                           "weight_scale", lambda n, k: (1, k)),
}


@torch.no_grad()
def save_fp8_decoder(config: PretrainedConfig, path, fmt: str, block: tuple[int, int] | None = None,
                     unquantized: tuple[str, ...] = ()):
    """A seeded random model of `config` whose decoder-layer projections are saved as FP8 in format `fmt`
    (FP8_FORMATS; block overrides fp8-block's weight_block_size), with the config's quantization_config.
    Modules named in `unquantized` stay in float32 and are listed as not converted. Returns the transformers
    model holding the dequantized weights, the reference the FP8 checkpoint should decode like."""
    quantization, scale_name, block_of = FP8_FORMATS[fmt]
    quantization = dict(quantization)
    if block is not None:
        quantization["weight_block_size"] = list(block)
        block_of = lambda n, k: block  # noqa: E731
    if unquantized:
        quantization["modules_to_not_convert" if fmt.startswith("fp8") else "ignore"] = list(unquantized)
    model = save_random_decoder(config, path)
    tensors = {}
    for name, param in model.state_dict().items():
        module = name.rpartition(".")[0]
        if ".layers." in name and name.endswith("proj.weight") and module not in unquantized:
            values, scales = quantize_blocks(param, block_of(*param.shape))
            param.copy_(dequantized(values, scales, block_of(*param.shape)))
            tensors[f"{module}.{scale_name}"] = scales if fmt.startswith("fp8") else scales.view(-1, 1)
            param = values
        tensors[name] = param.contiguous()
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    model.config.quantization_config = quantization
    model.config.save_pretrained(path)
    return model
