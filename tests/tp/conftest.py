"""Tiny random decoders for tensor-parallel tests: GQA with KV heads divisible by 2, biases everywhere the
family allows (so the row-parallel bias-once rule is exercised), tied and untied heads, and an odd
vocabulary (so the last rank's vocabulary range is padded)."""
import pytest
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from random_decoders import save_random_decoder

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
}


@pytest.fixture(scope="session")
def tp_model_path(tmp_path_factory):
    """tp_model_path(name): the saved model's directory (made once per session)."""
    paths = {}

    def get(name: str) -> str:
        if name not in paths:
            path = tmp_path_factory.mktemp(name)
            save_random_decoder(CONFIGS[name](), path)
            paths[name] = str(path)
        return paths[name]

    return get
