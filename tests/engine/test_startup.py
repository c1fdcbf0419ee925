"""What a start decides and says: the context length (HFENDPOINT_MAX_MODEL_LEN, by default the model's maximum,
capped by what the KV pool holds for one request) and the start-up lines that say where the seconds went."""
import logging

import pytest
from transformers import LlamaConfig

from engine import LLM, EngineConfig, SamplingParams
from random_decoders import TINY, save_random_decoder

MODEL_MAX = 5000  # longer than the 4,096 tokens that used to be every model's default
POOL_GB = 0.01  # the CPU KV pool: room for about 20,000 tokens of the tiny model


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("long")
    save_random_decoder(LlamaConfig(**{**TINY, "max_position_embeddings": MODEL_MAX}), path)
    return str(path)


@pytest.fixture
def startup_lines(caplog):
    caplog.set_level(logging.INFO, logger="engine.startup")
    return lambda: [record.getMessage() for record in caplog.records if record.name == "engine.startup"]


def test_context_defaults_to_the_models_maximum(long_model, startup_lines):
    llm = LLM(long_model, device="cpu", cpu_kv_cache_gb=POOL_GB)
    assert EngineConfig("/m").max_model_len is None
    assert llm.core.max_model_len == MODEL_MAX
    assert f"max_model_len {MODEL_MAX}, set by the model's maximum (max_position_embeddings)," in "\n".join(
        startup_lines())
    out = llm.generate([[1] * (MODEL_MAX - 1)], SamplingParams(max_tokens=1, temperature=0))
    assert len(out[0]["token_ids"]) == 1
    with pytest.raises(ValueError, match=f"max_model_len={MODEL_MAX}"):
        llm.generate([[1] * MODEL_MAX], SamplingParams(max_tokens=1))


def test_a_small_pool_caps_the_context(long_model, startup_lines):
    llm = LLM(long_model, device="cpu", num_kv_blocks=5, block_size=16)
    assert llm.core.max_model_len == 5 * 16 < MODEL_MAX
    assert "max_model_len 80, set by what the KV pool holds for one request," in "\n".join(startup_lines())


@pytest.mark.parametrize("asked, expected, bound", [
    (100, 100, "HFENDPOINT_MAX_MODEL_LEN"),
    (MODEL_MAX + 1, MODEL_MAX, "the model's maximum (max_position_embeddings)"),
])
def test_a_set_context_is_capped_by_the_model(long_model, startup_lines, asked, expected, bound):
    config = EngineConfig.from_env(long_model, {"HFENDPOINT_MAX_MODEL_LEN": str(asked)})
    llm = LLM(long_model, device="cpu", cpu_kv_cache_gb=POOL_GB, max_model_len=config.max_model_len)
    assert llm.core.max_model_len == expected
    assert f"max_model_len {expected}, set by {bound}," in "\n".join(startup_lines())


def test_startup_lines_say_where_the_seconds_went(tiny_llama, startup_lines):
    LLM(tiny_llama.path, device="cpu")
    lines = startup_lines()
    for phase in ("weights", "KV pool", "tokenizer"):
        assert any(line.startswith(phase) and " took " in line and ", at " in line for line in lines), (phase, lines)
    assert lines[0].startswith("engine starting at ") and lines[-1].startswith("engine ready at ")
