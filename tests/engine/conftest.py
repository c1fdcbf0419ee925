"""Tiny random decoders saved as transformers checkpoints, and transformers' own greedy output as reference."""
import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from random_decoders import MISTRAL_WINDOW, TINY, Reference, save_random_decoder

CONFIGS = {
    "llama": lambda: LlamaConfig(**TINY, tie_word_embeddings=False),
    "qwen2": lambda: Qwen2Config(**TINY, tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False),
    "mistral": lambda: MistralConfig(**TINY, sliding_window=MISTRAL_WINDOW, tie_word_embeddings=False),
}


@pytest.fixture(scope="session", params=sorted(CONFIGS))
def tiny_model(request, tmp_path_factory) -> Reference:
    return _make(request.param, tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Reference:
    return _make("llama", tmp_path_factory)


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def tiny_llama_or_qwen3(request, tmp_path_factory) -> Reference:
    return _make(request.param, tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory) -> Reference:
    return _make("mistral", tmp_path_factory)


_CACHE = {}


def _make(name, tmp_path_factory) -> Reference:
    if name not in _CACHE:
        path = tmp_path_factory.mktemp(name)
        model = save_random_decoder(CONFIGS[name](), path, random_biases_and_norms=False)
        _CACHE[name] = Reference(str(path), model)
    return _CACHE[name]


def _prompts_of_lengths(lengths, seed=1, vocab=TINY["vocab_size"]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="session")
def prompts_of_lengths():
    """prompts_of_lengths(lengths, seed=1): random token-id prompts of the given lengths."""
    return _prompts_of_lengths
