"""EngineConfig.from_env and SamplingParams validation: bad values are refused with a message naming them."""
import pytest
import torch
from gpu_capability import pretend_capability

from engine import EngineConfig, SamplingParams
from engine.config import auto_dtype
from kernels import gpu_features


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


@pytest.mark.parametrize("capability,features,expected", [
    ((7, 5), "auto", torch.float16), ((8, 0), "auto", torch.bfloat16), ((9, 0), "no-bfloat16", torch.float16),
    ((9, 0), "portable", torch.bfloat16),
])
def test_auto_dtype_is_float16_where_bfloat16_is_missing(monkeypatch, capability, features, expected):
    pretend_capability(monkeypatch, capability)
    cuda = torch.device("cuda")
    assert auto_dtype(cuda, gpu_features.parse(features)) == expected
    assert EngineConfig(model="m", device="cuda", gpu_features=features).torch_dtype == expected
    assert auto_dtype(torch.device("cpu")) == torch.float32


@pytest.mark.parametrize("capability,settings,message", [
    ((8, 6), {"kv_cache_dtype": "fp8"}, "HFENDPOINT_KV_CACHE_DTYPE=fp8 needs e4m3 .*8.9.* this GPU has 8.6"),
    ((9, 0), {"kv_cache_dtype": "fp8", "gpu_features": "no-e4m3"}, "HFENDPOINT_GPU_FEATURES=no-e4m3"),
    ((7, 5), {"dtype": "bfloat16"}, "HFENDPOINT_DTYPE=bfloat16 needs bfloat16 .*8.0.* this GPU has 7.5"),
])
def test_what_the_gpu_cannot_run_is_refused_naming_the_variable(monkeypatch, capability, settings, message):
    pretend_capability(monkeypatch, capability)
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", device="cuda", **settings).check_device()


def test_what_the_gpu_runs_is_accepted(monkeypatch):
    pretend_capability(monkeypatch, (8, 9))
    EngineConfig(model="m", device="cuda", kv_cache_dtype="fp8").check_device()
    EngineConfig(model="m", kv_cache_dtype="fp8", device="cpu").check_device()  # the CPU's reference cache


def test_gpu_features_variable_is_read_and_checked():
    assert EngineConfig.from_env("m", {"HFENDPOINT_GPU_FEATURES": "portable"}).disabled_gpu_features == frozenset(
        gpu_features.PORTABLE)
    with pytest.raises(ValueError, match="HFENDPOINT_GPU_FEATURES='no-tma' is invalid"):
        EngineConfig.from_env("m", {"HFENDPOINT_GPU_FEATURES": "no-tma"})
