"""FP8 KV-cache scales as checkpoints ship them: for each layer, one float32 scale for its keys and one for its
values (a scalar, or one per KV head), an e4m3 code times its scale being the value it stands for.

The names are those FP8 checkpoints use (and vLLM reads): `model.layers.N.self_attn.k_scale` / `v_scale`
(compressed-tensors, llm-compressor), `...self_attn.k_proj.k_scale` / `v_proj.v_scale` (NVIDIA ModelOpt),
`...self_attn.k_proj.output_scale` / `v_proj.output_scale` (older compressed-tensors) and
`...self_attn.kv_scale` (one scale for both, deprecated). The weight loader skips every attention scale (those
of queries and probabilities too, which only FP8 attention arithmetic uses); the KV cache reads the keys' and
values' here (engine/kv_cache.py), when it is FP8.
"""
import re

import torch
from safetensors import safe_open
from torch import Tensor

ATTENTION_SCALE = re.compile(r"layers\.(\d+)\.self_attn\.(?:([qkv])_proj\.)?(q|k|v|kv|prob|output)_scale$")


def is_attention_scale(name: str) -> bool:
    return ATTENTION_SCALE.search(name) is not None


def kv_scale_role(name: str) -> tuple[int, str] | None:
    """(layer, "k", "v" or "kv") for a checkpoint tensor that scales a layer's cached keys and/or values."""
    match = ATTENTION_SCALE.search(name)
    if match is None:
        return None
    layer, projection, kind = int(match.group(1)), match.group(2), match.group(3)
    if kind == "output":
        kind = projection
    return (layer, kind) if kind in ("k", "v", "kv") else None


def read_kv_scales(paths: list[str], num_layers: int) -> tuple[list[Tensor], list[Tensor]] | None:
    """Each layer's key and value scales as the checkpoint's safetensors files have them (float32, flattened: one
    element or one per KV head), or None when they have none."""
    scales = {"k": [None] * num_layers, "v": [None] * num_layers}
    for path in paths:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open's handle is not iterable
                role = kv_scale_role(name)
                if role is None or role[0] >= num_layers:
                    continue
                layer, kind = role
                tensor = f.get_tensor(name).float().flatten()
                if not (tensor.numel() and torch.isfinite(tensor).all() and (tensor > 0).all()):
                    raise ValueError(f"{path}: {name} must hold positive finite scales, got {tensor.tolist()}")
                for part in ("k", "v") if kind == "kv" else (kind,):
                    scales[part][layer] = tensor
    found = [(part, layer) for part in "kv" for layer in range(num_layers) if scales[part][layer] is not None]
    if not found:
        return None
    if len(found) < 2 * num_layers:
        part, layer = next((p, i) for p in "kv" for i in range(num_layers) if scales[p][i] is None)
        raise ValueError(f"the checkpoint has FP8 KV-cache scales for some layers but none for layer {layer}'s "
                         f"{'keys' if part == 'k' else 'values'} ({paths[0]}...)")
    return scales["k"], scales["v"]


def heads_of_rank(scale: Tensor, num_kv_heads: int, rank: int, size: int, what: str) -> Tensor:
    """The scales [num_kv_heads / size] of one tensor-parallel rank's KV heads from a checkpoint scale: a scalar
    serves every head, one per head is split as the heads are."""
    local = num_kv_heads // size
    if scale.numel() == 1:
        return scale.expand(local).clone()
    if scale.numel() == num_kv_heads:
        return scale[rank * local:(rank + 1) * local].clone()
    raise ValueError(f"{what} has {scale.numel()} scales; expected 1 or one per KV head ({num_kv_heads})")
