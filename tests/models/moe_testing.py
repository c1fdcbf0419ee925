"""Tiny random mixture-of-experts configs, an MXFP4 quantizer and MXFP4 gpt-oss checkpoints for the MoE tests."""
import json
import os

import torch
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig, Qwen3MoeConfig

from random_decoders import save_random_decoder

TINY = dict(vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.2)


def qwen3_moe_config(**overrides) -> Qwen3MoeConfig:
    """Eight experts of 32 features, two per token, renormalised; layer 1 dense (mlp_only_layers)."""
    settings = dict(TINY, intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                    norm_topk_prob=True, num_hidden_layers=2, mlp_only_layers=[1],
                    architectures=["Qwen3MoeForCausalLM"])
    return Qwen3MoeConfig(**{**settings, **overrides})


def gpt_oss_config(**overrides) -> GptOssConfig:
    """Six experts of 32 features, two per token, a SwiGLU limit the random activations cross, alternating
    sliding (window 8) and full layers."""
    settings = dict(TINY, intermediate_size=32, num_local_experts=6, num_experts_per_tok=2, swiglu_limit=0.8,
                    num_hidden_layers=2, sliding_window=8, architectures=["GptOssForCausalLM"])
    return GptOssConfig(**{**settings, **overrides})


MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., K] -> (blocks [..., K/32, 16] uint8, scales [..., K/32] uint8, the values they encode): per group
    of 32 the smallest power-of-two scale that brings the group within +-6, each value rounded to the nearest
    E2M1 magnitude with its sign in bit 3, two codes a byte, the low nibble first."""
    groups = x.reshape(*x.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.full_like(amax, -127)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)
    index = (scaled.abs().unsqueeze(-1) - MAGNITUDES).abs().argmin(-1)
    negative = scaled < 0
    codes = (index | (negative.long() << 3)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    values = torch.where(negative, -MAGNITUDES[index], MAGNITUDES[index]) * torch.exp2(exponent)
    return blocks, (exponent.squeeze(-1) + 127).to(torch.uint8), values.reshape(x.shape)


def mxfp4_experts(model, weights: dict) -> dict:
    """A checkpoint's tensors (`weights`, transformers names) with each gpt-oss layer's experts in MXFP4 as the
    published checkpoints store them (rows [E, 2I] interleaved and [E, H], 32-value groups along H and I), and
    `model`'s experts set to the values they encode (the reference on the dequantized weights)."""
    weights = dict(weights)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            prefix = f"model.layers.{i}.mlp.experts."
            for projection in ("gate_up_proj", "down_proj"):
                if prefix + projection not in weights:
                    continue
                weight = getattr(layer.mlp.experts, projection)
                blocks, scales, values = quantize_mxfp4(weight.transpose(1, 2))  # [E, out, in]
                weight.copy_(values.transpose(1, 2))
                del weights[prefix + projection]
                weights[prefix + projection + "_blocks"], weights[prefix + projection + "_scales"] = blocks, scales
    return weights


def save_mxfp4_decoder(config, path):
    """A seeded random gpt-oss saved under `path` with its experts in MXFP4 (quant_method "mxfp4"); returns the
    transformers model holding the values they encode."""
    model = save_random_decoder(config, path)
    checkpoint = os.path.join(path, "model.safetensors")
    save_file(mxfp4_experts(model, load_file(checkpoint)), checkpoint)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        saved = json.load(f)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump({**saved, "quantization_config": {"quant_method": "mxfp4"}}, f)
    return model
