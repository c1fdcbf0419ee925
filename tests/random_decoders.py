"""Tiny random decoders saved as transformers checkpoints (FP8 ones too) and transformers' greedy output on
them, shared by the test folders (tests/ is on the import path: its conftest.py puts it there)."""
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, PretrainedConfig

from kernels.reference import quantize_fp8

MISTRAL_WINDOW = 20  # the tiny Mistral's sliding window: shorter than most test prompts
TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, bos_token_id=None,
            eos_token_id=None, pad_token_id=None)  # the engine tests' decoders


class Reference:
    """A saved tiny model plus the transformers module that greedy outputs are compared against."""

    def __init__(self, path, hf_model):
        self.path, self.hf_model = path, hf_model

    @torch.inference_mode()
    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        out = self.hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                     min_new_tokens=max_new_tokens, pad_token_id=0, eos_token_id=None)
        return out[0, len(prompt):].tolist()


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


def dequantized(values: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The test's own reading of block scales (not the loader's)."""
    rows, cols = block
    full = scales.repeat_interleave(rows, 0)[:values.shape[0]].repeat_interleave(cols, 1)[:, :values.shape[1]]
    return values.float() * full


def compressed_tensors(strategy: str, input_activations: dict | None) -> dict:
    """A compressed-tensors quantization_config with FP8 weights scaled per `strategy`."""
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "kv_cache_scheme": None, "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": input_activations,
                "weights": {"type": "float", "num_bits": 8, "strategy": strategy, "symmetric": True,
                            "dynamic": False}}}}


FP8_FORMATS = {
    # name: (quantization_config, scale tensor name, block of the scales given the weight's shape, the scale
    # tensor's shape given the scales per block)
    "fp8-block": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [32, 32]}, "weight_scale_inv", lambda n, k: (32, 32), lambda s: s),
    "compressed-channel": (compressed_tensors("channel", {"type": "float", "num_bits": 8, "strategy": "token",
                                                         "symmetric": True, "dynamic": True}),
                           "weight_scale", lambda n, k: (1, k), lambda s: s.view(-1, 1)),
    # One scale per tensor (each part of a fused projection its own), static activation scales (not used).
    "compressed-tensor": (compressed_tensors("tensor", {"type": "float", "num_bits": 8, "strategy": "tensor",
                                                       "symmetric": True, "dynamic": False}),
                          "weight_scale", lambda n, k: (n, k), lambda s: s.view(1)),
}


@torch.no_grad()
def save_fp8_decoder(config: PretrainedConfig, path, fmt: str, block: tuple[int, int] | None = None,
                     unquantized: tuple[str, ...] = ()):
    """A seeded random model of `config` whose decoder-layer projections are saved as FP8 in format `fmt`
    (FP8_FORMATS; block overrides fp8-block's weight_block_size), with the config's quantization_config.
    Modules named in `unquantized` stay in float32 and are listed as not converted. Returns the transformers
    model holding the dequantized weights, the reference the FP8 checkpoint should decode like."""
    quantization, scale_name, block_of, scale_shape = FP8_FORMATS[fmt]
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
            values, scales = quantize_fp8(param, block_of(*param.shape))
            param.copy_(dequantized(values, scales, block_of(*param.shape)))
            tensors[f"{module}.{scale_name}"] = scale_shape(scales)
            if fmt == "compressed-tensor":
                tensors[f"{module}.input_scale"] = torch.ones(1)
            param = values
        tensors[name] = param.contiguous()
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    model.config.quantization_config = quantization
    model.config.save_pretrained(path)
    return model
