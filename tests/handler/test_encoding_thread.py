"""Chat templating and tokenizing run on the Service's pool of encoding threads, each with its own tokenizer
copy: the event loop that streams other requests keeps running while a slow encode is in progress, a slow
encode holds no other request's, and a request cancelled while encoding never reaches the engine."""
import asyncio
import threading
import time

import pytest

import handler.service
from fake_engine import FakeWorker
from handler.chat import RequestError
from handler.service import ENCODER_THREADS, Service
from handler.settings import HandlerSettings

SLOW_S = 0.3


@pytest.fixture
def service(smollm2_path, smollm2_tokenizer):
    return Service(FakeWorker(smollm2_path), smollm2_tokenizer, "smollm2")


def chat(text: str, **fields) -> dict:
    return {"messages": [{"role": "user", "content": text}], **fields}


async def completion(service: Service, data: dict) -> dict:
    """The last chunk of a chat request."""
    chunks = [chunk async for chunk in service.chat_completions(data)]
    return chunks[-1]


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


def test_every_encoding_thread_copies_its_tokenizer_before_the_first_request(service, monkeypatch):
    """A copy holds the GIL for a long while: made in the first burst of requests, it stalls the engine."""
    encoders = [thread for thread in threading.enumerate() if thread.name.startswith("encoder")]
    assert len(encoders) >= ENCODER_THREADS
    copies = []
    monkeypatch.setattr(handler.service.copy, "deepcopy", lambda value: copies.append(value) or value)

    async def burst():
        return await asyncio.gather(*(completion(service, chat(f"request {i}", max_tokens=1)) for i in range(16)))
    assert [last["finish_reason"] for last in asyncio.run(burst())] == ["length"] * 16
    assert copies == []


def test_tokenize_runs_off_the_loop_and_gives_the_same_ids(service, smollm2_tokenizer, monkeypatch):
    threads = []
    monkeypatch.setattr(handler.service, "embedding_token_ids", slowed(handler.service.embedding_token_ids, threads))
    result, ticks = asyncio.run(ticks_during(service.tokenize({"input": ["What is the capital of France?"]})))
    assert result == {"tokens": [smollm2_tokenizer("What is the capital of France?")["input_ids"]]}
    assert ticks >= SLOW_S / 0.01 / 2
    assert [thread.name.startswith("encoder") for thread in threads] == [True]


def test_chat_templating_runs_off_the_loop(service, monkeypatch):
    threads = []
    monkeypatch.setattr(handler.service, "parse_chat_request", slowed(handler.service.parse_chat_request, threads))

    async def first_chunk():
        return await anext(service.chat_completions({"messages": "not a list"}))

    with pytest.raises(RequestError, match="messages"):
        asyncio.run(ticks_during(first_chunk()))
    assert [thread.name.startswith("encoder") for thread in threads] == [True]


def blocking_on(monkeypatch, release: threading.Event, started: list) -> None:
    """parse_chat_request, made to wait for `release` on requests whose last message is "block"."""
    parse = handler.service.parse_chat_request

    def parse_or_block(data, chat_model, image_sources=()):
        started.append(data["messages"][-1]["content"])
        if data["messages"][-1]["content"] == "block":
            assert release.wait(60), "never released"
        return parse(data, chat_model, image_sources)
    monkeypatch.setattr(handler.service, "parse_chat_request", parse_or_block)


def test_a_stuck_encode_holds_no_other_request(service, monkeypatch):
    """ENCODER_THREADS - 1 encodes stuck (a template looping for minutes): another request still completes."""
    release, started = threading.Event(), []
    blocking_on(monkeypatch, release, started)

    async def scenario():
        stuck = [asyncio.ensure_future(completion(service, chat("block"))) for _ in range(ENCODER_THREADS - 1)]
        normal = await asyncio.wait_for(completion(service, chat("hello")), 30)
        assert not any(task.done() for task in stuck)
        release.set()
        return normal, await asyncio.gather(*stuck)

    normal, stuck = asyncio.run(scenario())
    assert normal["finish_reason"] == "length" and all(s["finish_reason"] == "length" for s in stuck)
    assert len(service.worker.submitted) == ENCODER_THREADS


def test_a_looping_template_from_a_trusted_client_holds_no_other_request(smollm2_path, smollm2_tokenizer):
    """The operator trusts request templates: a costly one renders on one thread while a normal request, sent
    after it, is answered first."""
    service = Service(FakeWorker(smollm2_path), smollm2_tokenizer, "smollm2",
                      HandlerSettings(trust_request_chat_template=True))
    looping = "{% for i in range(4000) %}{% for j in range(4000) %}{% endfor %}{% endfor %}{{ messages[0].content }}"
    finished = []

    async def run(name, data):
        await completion(service, data)
        finished.append(name)

    async def scenario():
        await asyncio.gather(run("looping", chat("x", chat_template=looping)), run("normal", chat("hello")))

    asyncio.run(scenario())
    assert finished == ["normal", "looping"]


def test_cancelled_while_waiting_for_a_thread_is_never_encoded(service, monkeypatch):
    release, started = threading.Event(), []
    blocking_on(monkeypatch, release, started)

    async def scenario():
        stuck = [asyncio.ensure_future(completion(service, chat("block"))) for _ in range(ENCODER_THREADS)]
        queued = asyncio.ensure_future(completion(service, chat("queued")))
        while len(started) < ENCODER_THREADS:
            await asyncio.sleep(0.01)
        queued.cancel()
        await asyncio.sleep(0.05)
        release.set()
        await asyncio.gather(*stuck)
        await completion(service, chat("after"))  # waits on the same threads: the queued one had its turn before

    asyncio.run(scenario())
    assert "queued" not in started and started.count("block") == ENCODER_THREADS
    assert len(service.worker.submitted) == ENCODER_THREADS + 1


def test_cancelled_while_encoding_never_reaches_the_engine(service, monkeypatch):
    """A render cannot be interrupted: it runs to its end, and its result is dropped."""
    release, started = threading.Event(), []
    blocking_on(monkeypatch, release, started)
    encoded = threading.Event()
    parse = handler.service.parse_chat_request
    monkeypatch.setattr(handler.service, "parse_chat_request",
                        lambda data, chat_model, images=(): (parse(data, chat_model, images), encoded.set())[0])

    async def scenario():
        task = asyncio.ensure_future(completion(service, chat("block")))
        while not started:
            await asyncio.sleep(0.01)
        task.cancel()
        release.set()
        assert await asyncio.to_thread(encoded.wait, 30)
        await asyncio.sleep(0.05)
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert service.worker.submitted == []


def test_each_encoding_thread_has_its_own_tokenizer(service):
    barrier = threading.Barrier(ENCODER_THREADS)

    def tokenizer_of(chat_model):
        barrier.wait(30)  # every thread busy at once: each job runs on its own thread
        return chat_model.tokenizer

    async def scenario():
        return await asyncio.gather(*(service.encode(tokenizer_of) for _ in range(ENCODER_THREADS)))

    tokenizers = asyncio.run(scenario())
    assert len({id(t) for t in tokenizers} | {id(service.tokenizer), id(service.chat_model.tokenizer)}) == (
        ENCODER_THREADS + 2)
