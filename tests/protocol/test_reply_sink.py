"""A streaming request's reply sink (daemon_protocol/reply_sink.py): replies sent from a callback outside the
request's task, in order with those it yields, none once it is cancelled, and not ready while the writer is
paused."""
import asyncio

import msgpack

import daemon_protocol
from daemon_protocol.registry import Registry
from daemon_protocol.session import Session
from daemon_protocol.writer import ReplyWriter


class Transport:
    def __init__(self):
        self.data = bytearray()

    def set_write_buffer_limits(self, high, low):
        pass

    def write(self, data):
        self.data += data


def replies(transport: Transport) -> list[dict]:
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(bytes(transport.data))
    return list(unpacker)


def serve(stream, *requests):
    """The replies a session sends for `requests` (ids 1, 2, ...), each served by the async generator function
    `stream`, called with the request's data and the session's writer."""
    async def main():
        loop = asyncio.get_running_loop()
        registry, writer, transport = Registry(), ReplyWriter(loop), Transport()

        async def handler(data):
            async for payload in stream(data, writer):
                yield payload

        registry.add("s", handler)
        session = Session(registry, writer, loop)
        session.connection_made(transport)
        session.data_received(b"".join(msgpack.packb({"id": i, "name": "s", "data": data})
                                       for i, data in enumerate(requests, start=1)))
        for _ in range(100):
            await asyncio.sleep(0)
            if not session._tasks:
                break
        writer.flush()
        return replies(transport)
    return asyncio.run(main())


async def pushed(data, writer):
    """Sends data["push"] from callbacks, yields data["yield"], then waits for the last callback."""
    sink = daemon_protocol.reply_sink()
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    for payload in data["push"]:
        loop.call_soon(sink.send, payload)
    loop.call_soon(done.set_result, None)
    for payload in data["yield"]:
        yield payload
    await done


def test_sent_replies_arrive_in_order_and_count_as_the_reply():
    got = serve(pushed, {"push": ["a", "b"], "yield": []}, {"push": ["c"], "yield": ["y"]})
    assert [r["data"] for r in got if r["id"] == 1] == ["a", "b"], "a stream that only sent is no error"
    assert [r["data"] for r in got if r["id"] == 2] == ["y", "c"]


def test_nothing_is_sent_once_the_request_is_cancelled():
    async def stalled(data, writer):
        sink = daemon_protocol.reply_sink()
        asyncio.get_running_loop().call_soon(sink.send, "after the request ended")
        asyncio.current_task().cancel()
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            sink.send("while cancelling")
            raise
        yield "never"

    got = serve(stalled, None)
    assert got == []


def test_the_sink_is_ready_only_while_the_writer_is_not_paused():
    seen = []

    async def watch(data, writer):
        sink = daemon_protocol.reply_sink()
        seen.append(sink.ready)
        writer.pause_writing()
        seen.append(sink.ready)
        writer.resume_writing()
        seen.append(sink.ready)
        sink.send("sent")
        yield "yielded"

    assert [r["data"] for r in serve(watch, None)] == ["sent", "yielded"]
    assert seen == [True, False, True]
