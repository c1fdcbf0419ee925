"""An FP8 KV cache under tensor parallelism on the CPU (gloo): each rank holds its own KV heads' scales, calibrated
per layer over every rank's heads (so two ranks store what one does) or split from the checkpoint's per-head
scales, and two ranks generate the tokens one does."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from tp_testing import prompts

pytestmark = pytest.mark.slow  # tensor-parallel ranks in processes of their own
GREEDY = SamplingParams(temperature=0, max_tokens=16)


def scales_of(llm):
    layers = llm.core.runner.model.model.layers
    return [(layer.self_attn.k_scale, layer.self_attn.v_scale) for layer in layers]


def with_per_head_scales(source, tmp_path) -> str:
    path = tmp_path / "checkpoint"
    shutil.copytree(source, path)
    weights = load_file(path / "model.safetensors")
    for layer in range(2):
        weights[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor([0.3, 0.45])
        weights[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(0.55)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


@pytest.mark.parametrize("checkpoint_scales", [False, True])
def test_two_ranks_generate_what_one_does(tp_model_path, tmp_path, checkpoint_scales):
    path = tp_model_path("llama")
    if checkpoint_scales:
        path = with_per_head_scales(path, tmp_path)
    batch = prompts([3, 17, 40], vocab=320)
    one = LLM(path, device="cpu", kv_cache_dtype="fp8", max_num_batched_tokens=48)
    expected = [out["token_ids"] for out in one.generate(batch, GREEDY)]
    two = LLM(path, device="cpu", kv_cache_dtype="fp8", tensor_parallel_size=2, max_num_batched_tokens=48)
    try:
        for (k_one, v_one), (k_two, v_two) in zip(scales_of(one), scales_of(two)):
            assert torch.equal(k_two, k_one[:1]) and torch.equal(v_two, v_one[:1])  # rank 0: the first KV head
        if checkpoint_scales:
            assert torch.equal(scales_of(two)[0][0], torch.tensor([0.3]))
        assert [out["token_ids"] for out in two.generate(batch, GREEDY)] == expected
    finally:
        two.shutdown()
