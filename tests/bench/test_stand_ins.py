"""The benchmarks' stand-ins for engine parts still fit the engine: they broke silently once when the runner's
sampler interface changed (bench/ runs only on the GPU, where CI does not go). Host overhead's fake model and
sampler run a few steps on each path; logits_check's teacher-forcing sampler reads the engine's logits, which
match transformers' on the same tiny model; handler_loop's fake engine streams every chat to its end."""
import asyncio
import sys
from pathlib import Path
from types import SimpleNamespace

import msgpack
import pytest
import torch
from model_packages import SMOLLM2_MISSING
from transformers import Qwen3Config

from engine import LLM
from handler.model_source import packaged_model_path
from handler.tokenizer import load_tokenizer
from random_decoders import TINY, save_random_decoder

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # bench/ is not a package
import handler_loop
import host_overhead

import logits_check


def test_host_overhead_steps_every_sequence_on_each_path():
    for eager, overlap in [(False, False), (False, True), (True, False)]:
        median_ms, mean_ms = host_overhead.timed_steps(3, 40, 4, eager=eager, overlap=overlap)  # asserts each step
        assert median_ms > 0 and mean_ms > 0


@torch.inference_mode()
def test_teacher_forced_engine_logits_are_transformers_logits(tmp_path):
    model = save_random_decoder(Qwen3Config(**TINY, head_dim=16), tmp_path, random_biases_and_norms=False)
    tokens = torch.randint(0, TINY["vocab_size"], (40,), generator=torch.Generator().manual_seed(0)).tolist()
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", max_num_batched_tokens=16)
    ours, _ = logits_check.engine_logits(llm, tokens, prompt_len=24)
    reference = model(torch.tensor([tokens])).logits[0, 23:-1]
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)


class RecordingTransport(handler_loop.CountingTransport):
    def __init__(self):
        super().__init__()
        self.data = bytearray()

    def write(self, data):
        super().write(data)
        self.data += data


def test_the_loop_benchmark_streams_every_chat_to_its_end_through_the_session():
    """bench/handler_loop.py's fake engine and transport: every stream's tokens reach the session's writer and the
    last one ends it with its usage, so the loop's CPU is measured over the whole decode."""
    if packaged_model_path() is None:
        pytest.skip(SMOLLM2_MISSING)
    transport = RecordingTransport()
    args = SimpleNamespace(streams=3, tokens=5, step_ms=1.0)
    seconds, steps, tokens = asyncio.run(handler_loop.measure(load_tokenizer(packaged_model_path()), args, transport))
    assert (steps, tokens) == (5, 15) and seconds > 0
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(bytes(transport.data))
    replies = list(unpacker)
    last = {reply["id"]: reply["data"] for reply in replies if reply["data"].get("finish_reason")}
    assert sorted(last) == [1, 2, 3]
    assert all(data["finish_reason"] == "length" and data["usage"]["completion_tokens"] == 5 for data in last.values())
