"""Chat templating and tokenizing run on the Service's encoding thread, with its own tokenizer copy: the
event loop that streams other requests keeps running while a slow encode is in progress."""
import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

import handler.service
from handler.chat import RequestError
from handler.service import Service

SLOW_S = 0.3


@pytest.fixture
def service(smollm2_path, smollm2_tokenizer):
    worker = SimpleNamespace(kind="decoder", eos_token_ids=(), max_model_len=2048, max_embedding_tokens=2048,
                             model_dir=smollm2_path, vocab_size=len(smollm2_tokenizer))
    return Service(worker, smollm2_tokenizer, "smollm2")


def slowed(function, threads: list):
    def slow(*args):
        threads.append(threading.current_thread())
        time.sleep(SLOW_S)
        return function(*args)
    return slow


async def ticks_during(coroutine) -> tuple[object, int]:
    """The coroutine's result and how many 10 ms ticks the loop ran beside it."""
    task = asyncio.ensure_future(coroutine)
    ticks = 0
    while not task.done():
        await asyncio.sleep(0.01)
        ticks += 1
    return task.result(), ticks


def test_tokenize_runs_off_the_loop_and_gives_the_same_ids(service, smollm2_tokenizer, monkeypatch):
    threads = []
    monkeypatch.setattr(handler.service, "embedding_token_ids", slowed(handler.service.embedding_token_ids, threads))
    result, ticks = asyncio.run(ticks_during(service.tokenize({"input": ["What is the capital of France?"]})))
    assert result == {"tokens": [smollm2_tokenizer("What is the capital of France?")["input_ids"]]}
    assert ticks >= SLOW_S / 0.01 / 2
    assert [thread.name.startswith("encoder") for thread in threads] == [True]
    assert service.chat_model.tokenizer is not smollm2_tokenizer  # the encoding thread's own copy


def test_chat_templating_runs_off_the_loop(service, monkeypatch):
    threads = []
    monkeypatch.setattr(handler.service, "parse_chat_request", slowed(handler.service.parse_chat_request, threads))

    async def first_chunk():
        return await anext(service.chat_completions({"messages": "not a list"}))

    with pytest.raises(RequestError, match="messages"):
        asyncio.run(ticks_during(first_chunk()))
    assert [thread.name.startswith("encoder") for thread in threads] == [True]
