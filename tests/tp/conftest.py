"""Tiny random decoders for tensor-parallel tests: GQA with KV heads divisible by 2, biases everywhere the
family allows (so the row-parallel bias-once rule is exercised), tied and untied heads, an odd vocabulary
(so the last rank's vocabulary range is padded), and an FP8 Phi-3 (each rank reads its rows of each part of
the fused projections, with their scales, and its K groups of the row-parallel ones' scales)."""
import pytest
from random_decoders import save_fp8_decoder, save_random_decoder
from transformers import LlamaConfig, Phi3Config, Qwen2Config, Qwen3Config

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, rms_norm_eps=1e-5,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON, vocab_size=331, attention_bias=True, mlp_bias=True,
                                 tie_word_embeddings=False, architectures=["LlamaForCausalLM"]),
    "qwen3": lambda: Qwen3Config(**COMMON, vocab_size=320, head_dim=32, tie_word_embeddings=True,
                                 architectures=["Qwen3ForCausalLM"]),
    "qwen2-one-kv-head": lambda: Qwen2Config(**{**COMMON, "num_key_value_heads": 1}, vocab_size=320,
                                             architectures=["Qwen2ForCausalLM"]),
    "phi3-fp8": lambda: Phi3Config(**{**COMMON, "hidden_size": 96}, vocab_size=320, partial_rotary_factor=0.5,
                                   architectures=["Phi3ForCausalLM"]),
}
FP8_BLOCKS = {"phi3-fp8": (16, 16)}  # saved as block-wise FP8; a rank's 48 inputs of o_proj and down_proj: 3 blocks


@pytest.fixture(scope="session")
def tp_model_path(tmp_path_factory):
    """tp_model_path(name): the saved model's directory (made once per session)."""
    paths = {}

    def get(name: str) -> str:
        if name not in paths:
            path = tmp_path_factory.mktemp(name)
            if name in FP8_BLOCKS:
                save_fp8_decoder(CONFIGS[name](), path, "fp8-block", FP8_BLOCKS[name])
            else:
                save_random_decoder(CONFIGS[name](), path)
            paths[name] = str(path)
        return paths[name]

    return get
