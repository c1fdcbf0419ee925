"""Decoder weights from a GGUF file (llama.cpp's format), dequantised tensor by tensor to transformers names.

The config comes from transformers' GGUF reader; the tensors from gguf's GGUFReader (memory-mapped) and
gguf.quants.dequantize, so one tensor at a time is materialised in float32.
"""

import os
import re
from collections.abc import Iterator

import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from torch import Tensor
from transformers import AutoConfig

# GGUF general.architecture -> the transformers architecture we build for it.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# llama.cpp's converter reorders Q and K rows for these architectures only (see unpermute_rotary_rows).
PERMUTED_QK_ARCHITECTURES = ("llama",)

GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Precomputed rope factors; we derive the same from the config.
IGNORED = ("rope_freqs",)
LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def gguf_architecture(reader: GGUFReader) -> str:
    field = reader.fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def read_gguf_config(path: str):
    """The transformers config embedded in the file, with `architectures` filled in (GGUF configs lack it)."""
    directory, name = os.path.split(os.path.abspath(path))
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    if not getattr(config, "architectures", None):
        config.architectures = [ARCHITECTURES.get(config.model_type, f"{config.model_type} (GGUF)")]
    return config


def transformers_name(gguf_name: str) -> str | None:
    """The transformers checkpoint name for a GGUF tensor name; None for tensors we do not load."""
    stem, _, leaf = gguf_name.rpartition(".")
    if stem in IGNORED:
        return None
    if stem in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[stem]}.{leaf}"
    match = LAYER_PATTERN.match(gguf_name)
    if match is None or match.group(2) not in LAYER_NAMES:
        return gguf_name  # the weight loader reports it as unexpected
    layer, module, leaf = match.groups()
    return f"model.layers.{layer}.{LAYER_NAMES[module]}.{leaf}"


def unpermute_rotary_rows(weight: Tensor, num_heads: int) -> Tensor:
    """Undo llama.cpp's Q/K row order for Llama.

    llama.cpp rotates adjacent pairs (GPT-J style), so its converter interleaves each head's rows: row i of the
    first half and row i of the second half become rows 2i and 2i + 1. We rotate halves (NeoX style), so the
    rows go back: per head, view the rows as [D/2, 2] and transpose to [2, D/2].
    """
    return weight.reshape(num_heads, -1, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def iterate_gguf(path: str, hf_config) -> Iterator[tuple[str, Tensor]]:
    """(transformers name, float32 tensor) for each tensor in the file, dequantised one at a time."""
    reader = GGUFReader(path)
    permuted = gguf_architecture(reader) in PERMUTED_QK_ARCHITECTURES
    heads = {"q_proj": hf_config.num_attention_heads, "k_proj": hf_config.num_key_value_heads}
    for tensor in reader.tensors:
        name = transformers_name(tensor.name)
        if name is None:
            continue
        weight = torch.tensor(dequantize(tensor.data, tensor.tensor_type))  # a copy: the file is mapped read-only
        module = name.rsplit(".", 2)[-2]
        if permuted and module in heads:
            weight = unpermute_rotary_rows(weight, heads[module])
        yield name, weight
