"""Loading a checkpoint with several threads (HFENDPOINT_LOAD_THREADS) fills every parameter exactly as loading one
tensor at a time does, and still names a tensor that does not fit: the loaders on a pool's threads (on the CPU,
where a model loads with one thread, called directly), and on a GPU through the threads' pinned uploads and
through the host when the device lacks the room."""
import json

import pytest
import torch
from decoder_testing import save_tiny_model
from transformers import AutoConfig, Qwen3Config

from models.loader import load_safetensors
from models.registry import build_decoder, load_model
from random_decoders import save_fp8_decoder

CPU = torch.device("cpu")
THREADS = 4
SHARD = "20KB"  # several shards, so the threads read from more than one file


def loaded_state(path, dtype: torch.dtype, device: torch.device, threads: int) -> dict[str, torch.Tensor]:
    if device.type == "cpu":  # load_model loads with one thread on the CPU
        model = build_decoder(AutoConfig.from_pretrained(path), dtype, device)
        load_safetensors(model, str(path), threads)
    else:
        model = load_model(str(path), dtype, device, load_threads=threads).model
    return {name: tensor.cpu() for name, tensor in model.state_dict().items()}


def assert_same_state(one: dict, other: dict) -> None:
    assert one.keys() == other.keys()
    differing = [name for name in one if not torch.equal(one[name], other[name])]
    assert not differing, f"tensors loaded differently: {differing[:5]}"


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    save_tiny_model("qwen3", path, max_shard_size=SHARD)
    assert len(list(path.glob("*.safetensors"))) > 1
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threads_load_what_one_thread_loads(qwen3_dir, dtype):
    assert_same_state(loaded_state(qwen3_dir, dtype, CPU, 1), loaded_state(qwen3_dir, dtype, CPU, THREADS))


def test_threads_load_an_fp8_checkpoint_as_one_thread_does(tmp_path):
    config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    save_fp8_decoder(config, tmp_path, "fp8-block")
    assert_same_state(loaded_state(tmp_path, torch.float32, CPU, 1),
                      loaded_state(tmp_path, torch.float32, CPU, THREADS))


def test_a_tensor_that_does_not_fit_is_named_with_threads(qwen3_dir, tmp_path):
    for file in qwen3_dir.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] += 8
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight' has shape \(\d+, \d+\), the model expects"):
        loaded_state(tmp_path, torch.float32, CPU, THREADS)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_threads_upload_what_one_thread_loads_on_a_gpu(qwen3_dir, monkeypatch):
    cuda = torch.device("cuda")
    one = loaded_state(qwen3_dir, torch.bfloat16, cuda, 1)
    assert_same_state(one, loaded_state(qwen3_dir, torch.bfloat16, cuda, THREADS))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 1 << 40))  # no room: host copies
    assert_same_state(one, loaded_state(qwen3_dir, torch.bfloat16, cuda, THREADS))
