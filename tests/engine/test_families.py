"""Greedy decoding through engine.LLM equals transformers' token for token on tiny random models of the
families beyond Llama/Qwen: Phi-3 (partial rotary on heads padded to a power of two, LongRoPE with its short
and its long factors), Gemma 3 (local layers with a window shorter than the prompts around a global one; also
as the text decoder of a multimodal checkpoint) and FP8 checkpoints (block-wise and compressed-tensors per
channel, compared with transformers on the dequantized weights), each with whole prompts, chunked prefill and
a KV pool so small that requests are preempted."""
from dataclasses import dataclass, field

import pytest
from random_decoders import TINY, Reference, save_fp8_decoder, save_random_decoder
from transformers import Gemma3Config, Gemma3TextConfig, LlamaConfig, Phi3Config, Qwen3Config, SiglipVisionConfig

from engine import LLM, SamplingParams

NEW = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW)


def phi3(original_context: int):
    """Heads of 24 dimensions (padded to 32), half of them rotated, LongRoPE from original_context on."""
    return Phi3Config(**{**TINY, "hidden_size": 96}, partial_rotary_factor=0.5,
                      original_max_position_embeddings=original_context, tie_word_embeddings=False,
                      rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0],
                                    "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]})


def gemma3(**overrides):
    return Gemma3TextConfig(**{**TINY, "num_hidden_layers": 3}, head_dim=32, sliding_window=16,
                            sliding_window_pattern=2, query_pre_attn_scalar=24, rope_theta=1000.0,
                            rope_local_base_freq=50.0, **overrides)


def gemma3_multimodal():
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    return Gemma3Config(text_config=gemma3().to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                        bos_token_id=None, eos_token_id=None, pad_token_id=None)


@dataclass
class Family:
    save: callable  # (path) -> transformers reference model
    lengths: list[int]  # prompt lengths
    engine: dict = field(default_factory=dict)  # LLM settings every engine of the family gets


FAMILIES = {
    # Every prompt is longer than the original context: transformers uses the long factors throughout, as
    # the engine does when max_model_len exceeds the original context.
    "phi3-longrope-long": Family(lambda path: save_random_decoder(phi3(32), path), [33, 40, 57, 70]),
    # max_model_len within the original context: the short factors, as transformers uses for such lengths.
    "phi3-longrope-short": Family(lambda path: save_random_decoder(phi3(64), path), [3, 17, 30],
                                  {"max_model_len": 64}),
    "gemma3": Family(lambda path: save_random_decoder(gemma3(), path), [3, 17, 33, 50]),
    "gemma3-multimodal": Family(lambda path: save_random_decoder(gemma3_multimodal(), path), [3, 17, 33, 50]),
    "llama-fp8-block": Family(lambda path: save_fp8_decoder(
        LlamaConfig(**TINY, tie_word_embeddings=False), path, "fp8-block"), [3, 17, 33, 50]),
    "qwen3-fp8-compressed": Family(lambda path: save_fp8_decoder(
        Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True), path, "compressed-channel"), [3, 17, 33, 50]),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, prompts_of_lengths):
    """(path, engine settings, prompts, transformers' greedy outputs) of a saved model of the family."""
    spec = FAMILIES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    reference = Reference(str(path), spec.save(path).eval())
    prompts = prompts_of_lengths(spec.lengths)
    return reference.path, spec.engine, prompts, [reference.greedy(prompt, NEW) for prompt in prompts]


@pytest.mark.parametrize("engine", [
    {},
    {"max_num_batched_tokens": 8},  # prompts in chunks of up to 8 tokens, next to decodes
    {"num_kv_blocks": 7},  # 112 slots: one request fits, the batch does not
])
def test_greedy_matches_transformers(family, engine):
    path, settings, prompts, expected = family
    llm = LLM(path, dtype="float32", **settings, **engine)
    assert [out["token_ids"] for out in llm.generate(prompts, GREEDY)] == expected
    if "num_kv_blocks" in engine:
        assert llm.core.scheduler.num_preemptions > 0
    assert llm.core.block_manager.num_free_blocks == llm.core.runner.num_blocks
