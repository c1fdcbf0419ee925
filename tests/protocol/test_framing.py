"""Framing: a stream of MessagePack objects back to back, split anywhere, large or many per read."""
import asyncio
import time

import msgpack
import pytest

from daemon_protocol import Registry
from daemon_protocol.session import Session
from daemon_protocol.writer import ReplyWriter, data_prefix


class FakeTransport(asyncio.WriteTransport):
    """Collects what the writer sends and counts the writes."""

    def __init__(self) -> None:
        super().__init__()
        self.data = bytearray()
        self.writes = 0

    def write(self, data) -> None:
        self.data += data
        self.writes += 1

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass


def make_registry() -> Registry:
    registry = Registry()

    async def echo(data):
        return data

    async def stream(data):
        for i in range(data):
            yield {"content": f"t{i}", "finish_reason": None}
            await asyncio.sleep(0)

    registry.add("echo", echo)
    registry.add("stream", stream)
    return registry


def decode_all(data: bytes) -> list:
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=len(data) + 1)
    unpacker.feed(data)
    return list(unpacker)


async def serve_chunks(chunks: list[bytes], settle) -> tuple[list, FakeTransport]:
    """Feed `chunks` to a session one data_received call each; return the decoded replies."""
    loop = asyncio.get_running_loop()
    transport = FakeTransport()
    writer = ReplyWriter(loop)
    session = Session(make_registry(), writer, loop)
    session.connection_made(transport)
    for chunk in chunks:
        session.data_received(chunk)
    deadline = time.monotonic() + 10
    while True:
        await asyncio.sleep(0)
        replies = decode_all(bytes(transport.data))
        if settle(replies) or time.monotonic() > deadline:
            break
    await session.shutdown()
    return replies, transport


def run(chunks, settle):
    return asyncio.run(serve_chunks(chunks, settle))


def test_reply_prefix_matches_a_packed_map():
    for request_id in (0, 1, 127, 128, 65535, 1 << 32, (1 << 64) - 1):
        payload = {"content": "x", "finish_reason": None}
        assert data_prefix(request_id) + msgpack.packb(payload) == msgpack.packb({"id": request_id, "data": payload})


def test_requests_split_byte_by_byte():
    stream = b"".join(msgpack.packb({"id": i, "name": "echo", "data": {"n": i, "s": "é" * i}}) for i in range(1, 6))
    replies, _ = run([stream[i:i + 1] for i in range(len(stream))], lambda r: len(r) == 5)
    assert sorted(replies, key=lambda r: r["id"]) == [{"id": i, "data": {"n": i, "s": "é" * i}} for i in range(1, 6)]


def test_hundreds_of_requests_in_one_read_coalesce_into_few_writes():
    stream = b"".join(msgpack.packb({"id": i, "name": "stream", "data": 3}) for i in range(1, 501))
    replies, transport = run([stream], lambda r: len(r) == 1500)
    assert len(replies) == 1500
    by_id = {}
    for reply in replies:
        by_id.setdefault(reply["id"], []).append(reply["data"]["content"])
    assert by_id == {i: ["t0", "t1", "t2"] for i in range(1, 501)}
    assert transport.writes <= 10, f"1500 replies took {transport.writes} writes"


def test_exact_reply_bytes():
    request = msgpack.packb({"id": 7, "name": "echo", "data": [1, "a", None, True]})
    _, transport = run([request], lambda r: len(r) == 1)
    assert bytes(transport.data) == msgpack.packb({"id": 7, "data": [1, "a", None, True]})


def test_eight_mib_message_in_uneven_pieces():
    payload = list(range(1_000_000))  # ~4.9 MB of msgpack ints
    blob = b"\x5a" * (4 * 1024 * 1024)
    request = msgpack.packb({"id": 1, "name": "echo", "data": {"ints": payload, "blob": blob}})
    assert len(request) > 8 * 1024 * 1024
    pieces = [request[i:i + 65521] for i in range(0, len(request), 65521)]
    replies, _ = run(pieces, lambda r: len(r) == 1)
    assert replies == [{"id": 1, "data": {"ints": payload, "blob": blob}}]


@pytest.mark.parametrize("request_id", [(1 << 64) - 1, (1 << 64) - 2, (1 << 63), (1 << 32) + 1])
def test_u64_ids_near_the_top_are_preserved(request_id):
    request = msgpack.packb({"id": request_id, "name": "stream", "data": 2})
    replies, transport = run([request], lambda r: len(r) == 2)
    assert [r["id"] for r in replies] == [request_id, request_id]
    first = msgpack.packb({"id": request_id, "data": {"content": "t0", "finish_reason": None}})
    assert bytes(transport.data).startswith(first)


def test_split_reads_over_the_real_socket(handler):
    """Byte by byte through the socket, with pauses so the handler really sees one byte per read."""
    request = msgpack.packb({"id": 42, "name": "echo", "data": "split"})
    for i in range(len(request)):
        handler.send_raw(request[i:i + 1])
        time.sleep(0.002)
    handler.send({"id": 43, "name": "echo", "data": "next"})
    assert handler.read_count(2) == [{"id": 42, "data": "split"}, {"id": 43, "data": "next"}]


def test_eight_mib_reply_over_the_real_socket(handler):
    handler.send({"id": (1 << 64) - 1, "name": "big", "data": 8 * 1024 * 1024}, {"id": 2, "name": "echo", "data": 1})
    replies = handler.read_count(2)
    assert {"id": (1 << 64) - 1, "data": b"\xab" * (8 * 1024 * 1024)} in replies
    assert {"id": 2, "data": 1} in replies


def test_streams_wait_while_the_transport_is_backed_up():
    """Back-pressure: while the transport is paused a stream sends one chunk and waits; a coroutine
    handler still answers; on resume the stream goes on."""
    async def scenario():
        loop = asyncio.get_running_loop()
        transport = FakeTransport()
        writer = ReplyWriter(loop)
        produced = []
        registry = Registry()

        async def endless(data):
            while True:
                produced.append(len(produced))
                yield len(produced)
                await asyncio.sleep(0)

        async def echo(data):
            return data

        registry.add("endless", endless)
        registry.add("echo", echo)
        session = Session(registry, writer, loop)
        session.connection_made(transport)
        session.pause_writing()
        session.data_received(msgpack.packb({"id": 1, "name": "endless"})
                              + msgpack.packb({"id": 2, "name": "echo", "data": 5}))
        for _ in range(20):
            await asyncio.sleep(0)
        assert produced == [0]
        assert decode_all(bytes(transport.data)) == [{"id": 1, "data": 1}, {"id": 2, "data": 5}]
        session.resume_writing()
        for _ in range(200):
            await asyncio.sleep(0)
        session.pause_writing()
        assert len(produced) > 50
        count = len(produced)
        for _ in range(20):
            await asyncio.sleep(0)
        assert len(produced) <= count + 1
        session.data_received(msgpack.packb({"id": 1, "name": "cancel"}))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert session._tasks == {}

    asyncio.run(scenario())


def test_cancel_before_the_handler_starts_forgets_the_request():
    async def scenario():
        loop = asyncio.get_running_loop()
        transport = FakeTransport()
        session = Session(make_registry(), ReplyWriter(loop), loop)
        session.connection_made(transport)
        session.data_received(msgpack.packb({"id": 3, "name": "stream", "data": 5})
                              + msgpack.packb({"id": 3, "name": "cancel"}))
        for _ in range(5):
            await asyncio.sleep(0)
        assert session._tasks == {}
        assert transport.data == b""

    asyncio.run(scenario())
