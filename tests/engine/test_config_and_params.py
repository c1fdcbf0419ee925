"""EngineConfig.from_env and SamplingParams validation: bad values are refused with a message naming them."""
import pytest

from engine import EngineConfig, SamplingParams


def test_from_env_reads_every_variable():
    env = {"HFENDPOINT_MAX_MODEL_LEN": "2048", "HFENDPOINT_GPU_MEMORY_UTILIZATION": "0.5",
           "HFENDPOINT_ENFORCE_EAGER": "true", "HFENDPOINT_MAX_BATCHED_TOKENS": "1024", "HFENDPOINT_MAX_SEQS": "8",
           "HFENDPOINT_TENSOR_PARALLEL_SIZE": "1", "HFENDPOINT_KV_BLOCK_SIZE": "32",
           "HFENDPOINT_CPU_KV_CACHE_GB": "0.25", "HFENDPOINT_NUM_KV_BLOCKS": "64", "HFENDPOINT_DTYPE": "bfloat16",
           "HFENDPOINT_DEVICE": "cpu", "HFENDPOINT_MAX_EMBEDDING_BATCH_TOKENS": "4096"}
    config = EngineConfig.from_env("/m", env)
    assert config == EngineConfig("/m", 2048, 0.5, True, 1024, 8, 1, 32, 0.25, 64, "bfloat16", "cpu", 4096)
    assert EngineConfig.from_env("/m", {}) == EngineConfig("/m")
    assert EngineConfig.from_env("/m", {"HFENDPOINT_DATA_PARALLEL_SIZE": "4"}).data_parallel_size == 4


@pytest.mark.parametrize("name, value", [
    ("HFENDPOINT_MAX_MODEL_LEN", "0"), ("HFENDPOINT_MAX_MODEL_LEN", "big"),
    ("HFENDPOINT_GPU_MEMORY_UTILIZATION", "1.5"), ("HFENDPOINT_GPU_MEMORY_UTILIZATION", "x"),
    ("HFENDPOINT_ENFORCE_EAGER", "maybe"), ("HFENDPOINT_MAX_SEQS", "-3"), ("HFENDPOINT_KV_BLOCK_SIZE", "24"),
    ("HFENDPOINT_CPU_KV_CACHE_GB", "0"), ("HFENDPOINT_NUM_KV_BLOCKS", "0"), ("HFENDPOINT_DTYPE", "int8"),
    ("HFENDPOINT_DEVICE", "tpu"), ("HFENDPOINT_MAX_BATCHED_TOKENS", "1.5"), ("HFENDPOINT_DATA_PARALLEL_SIZE", "0"),
])
def test_from_env_names_the_bad_variable(name, value):
    with pytest.raises(ValueError, match=name):
        EngineConfig.from_env("/m", {name: value})


def test_cache_dir_comes_from_the_environment_once(monkeypatch):
    """HFENDPOINT_CACHE_DIR (where GGUF metadata is converted) is read with the other settings; unset or blank,
    it is the user's cache folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert EngineConfig.from_env("/m", {"HFENDPOINT_CACHE_DIR": "/tmp/ours"}).cache_dir == "/tmp/ours"
    assert EngineConfig.from_env("/m", {"HFENDPOINT_CACHE_DIR": " "}).cache_dir == "/xdg/nanovllm-endpoint"
    assert EngineConfig("/m").cache_dir == "/xdg/nanovllm-endpoint"
    assert not EngineConfig("/m", cache_dir="~/c").cache_dir.startswith("~")


def test_device_and_dtype_resolution():
    config = EngineConfig("/m", device="cpu")
    assert str(config.torch_device) == "cpu" and str(config.torch_dtype) == "torch.float32"


@pytest.mark.parametrize("field, value", [
    ("temperature", -1), ("temperature", float("nan")), ("top_p", 0), ("top_p", 1.5), ("top_k", 2.5),
    ("min_p", 1.5), ("presence_penalty", 3), ("frequency_penalty", -2.5), ("repetition_penalty", 0),
    ("max_tokens", 0), ("max_tokens", "10"), ("seed", -1), ("ignore_eos", "yes"), ("stop_token_ids", [1, -2]),
    ("stop_token_ids", "abc"),
])
def test_sampling_params_refuse_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_defaults_and_flags():
    params = SamplingParams(temperature=0, stop_token_ids=[3, 4], max_tokens=None)
    assert params.greedy and not params.penalised and params.stop_token_ids == (3, 4)
    assert SamplingParams(repetition_penalty=1.2).penalised
