"""Only a RequestError is the client's fault: a ValueError raised inside the engine is our bug, answered with a 500
and its traceback in the log, and the handler goes on serving the next request. The engine's PromptRejected (a
prompt it cannot serve as sent) is the client's: a 400 naming the field."""
import asyncio
import logging
import time

import msgpack
import pytest

from daemon_protocol import Registry
from daemon_protocol.session import Session
from daemon_protocol.writer import ReplyWriter
from engine import PromptRejected
from fake_engine import FakeWorker
from handler.service import Service


class CollectingTransport(asyncio.WriteTransport):
    def __init__(self) -> None:
        super().__init__()
        self.data = bytearray()

    def write(self, data) -> None:
        self.data += data

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass


def replies_of(data: bytes) -> list:
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(data)
    return list(unpacker)


async def serve_in_turn(service: Service, requests: list[dict]) -> list:
    """Each request through the protocol's request loop after the previous one has ended; every reply."""
    loop = asyncio.get_running_loop()
    transport = CollectingTransport()
    registry = Registry()
    registry.add("chat_completions", service.chat_completions)
    session = Session(registry, ReplyWriter(loop), loop)
    session.connection_made(transport)
    for request in requests:
        session.data_received(msgpack.packb(request))
        deadline = time.monotonic() + 60
        while not any(reply["id"] == request["id"] and ("error" in reply or reply["data"].get("finish_reason"))
                      for reply in replies_of(bytes(transport.data))):
            assert time.monotonic() < deadline, f"request {request['id']} got no last reply"
            await asyncio.sleep(0.01)
    await session.shutdown()
    return replies_of(bytes(transport.data))


@pytest.fixture(scope="module")
def engine_and_service(smollm2_path, smollm2_tokenizer):
    engine = FakeWorker(smollm2_path)
    return engine, Service(engine, smollm2_tokenizer, "smollm2")


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@pytest.mark.slow  # the Service starts its grammar compiler processes
def test_a_value_error_inside_the_engine_is_a_500_and_the_next_request_is_served(engine_and_service, caplog):
    engine, service = engine_and_service
    engine.failure = ValueError("the engine has a bug")
    with caplog.at_level(logging.ERROR, logger="daemon_protocol"):
        replies = asyncio.run(serve_in_turn(service, [{"id": 1, "name": "chat_completions", "data": CHAT},
                                                      {"id": 2, "name": "chat_completions", "data": CHAT}]))
    assert replies[0] == {"id": 1, "error": "ValueError: the engine has a bug", "status": 500}
    assert [reply["data"]["finish_reason"] for reply in replies[1:]] == ["length"]
    assert all(reply["id"] == 2 for reply in replies[1:])
    assert "Traceback" in caplog.text and "ValueError: the engine has a bug" in caplog.text


@pytest.mark.slow
def test_a_prompt_the_engine_rejects_is_a_400_naming_the_field(engine_and_service, caplog):
    engine, service = engine_and_service
    engine.failure = PromptRejected("the prompt is empty: it needs at least one token")
    with caplog.at_level(logging.ERROR, logger="daemon_protocol"):
        [reply] = asyncio.run(serve_in_turn(service, [{"id": 3, "name": "chat_completions", "data": CHAT}]))
    assert reply == {"id": 3, "error": "the prompt is empty: it needs at least one token", "status": 400,
                     "param": "messages"}
    assert "Traceback" not in caplog.text
