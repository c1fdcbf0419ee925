"""The front's side of the protocol: spawn the handler exactly as the production daemon does,
number requests, route reply chunks to per-request queues, send `cancel`.

Like the production daemon, a request's queue is bounded (10 chunks for chat, 1 otherwise) and a
full queue stalls the reader for every request.
"""
import asyncio
import itertools
import logging
import os
import re
import signal
import socket
import subprocess

import msgpack

from daemon_protocol.errors import DEFAULT_STATUS
from daemon_protocol.log import RepeatedProblems, error

SOCKET_BUFFER_BYTES = 1024 * 1024
# the handler's log lines (handler/__main__.py's LOG_FORMAT): "date time LEVEL logger: message"
HANDLER_LOG_LINE = re.compile(r"\S+ \S+ (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")
relayed = logging.getLogger("front.handler")
CHAT_QUEUE_CHUNKS = 10
EXIT_TIMEOUT_S = 60.0  # after EOF: more than the handler's default drain timeout (HFENDPOINT_DRAIN_TIMEOUT, 30 s)


def relay_level(line: str) -> int:
    """The level to relay one of the handler's stderr lines at: a log line's own (the production daemon logs
    every line at ERROR, which made each start-up line look like a failure), ERROR for anything else (a
    traceback, a library's print)."""
    match = HANDLER_LOG_LINE.match(line)
    return getattr(logging, match.group(1)) if match else logging.ERROR


class HandlerGone(Exception):
    """The handler closed its socket or died."""


class UnencodableRequest(ValueError):
    """The request holds a value MessagePack cannot carry (an integer outside 64 bits, a string that is not
    Unicode); param names the request field that holds it."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def unencodable(data, exc: Exception) -> UnencodableRequest:
    """Why MessagePack could not carry the request, naming the top-level field at fault."""
    param = None
    if isinstance(data, dict):
        for key, value in data.items():
            try:
                msgpack.packb(value)
            except (OverflowError, TypeError, ValueError):
                param = key
                break
    where = f"'{param}'" if param else "the request"
    if isinstance(exc, UnicodeError):
        return UnencodableRequest(f"{where} holds a string that is not valid Unicode (a lone surrogate such as "
                                  "\\ud800 escaped in the JSON); send UTF-8 text", param)
    return UnencodableRequest(f"{where} holds a value the daemon protocol cannot carry ({exc}); integers must "
                              "fit in 64 bits", param)


class HandlerError(Exception):
    """The handler answered a request with an error reply; status, param and code come from its extra keys
    (docs/errors.md), status 500 when it has none."""

    def __init__(self, message: str, status: int = DEFAULT_STATUS, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    @classmethod
    def from_reply(cls, reply: dict) -> "HandlerError":
        status = reply.get("status")
        if type(status) is not int or not 400 <= status <= 599:
            status = DEFAULT_STATUS

        def text(key: str) -> str | None:
            value = reply.get(key)
            return value if isinstance(value, str) and value else None
        return cls(reply["error"], status, text("param"), text("code"))


_GONE = object()


class RequestStream:
    """The reply chunks of one request, in order. Iterating yields each `data` payload; an error
    reply raises HandlerError, losing the handler raises HandlerGone."""

    def __init__(self, connection: "HandlerConnection", request_id: int, queue_size: int) -> None:
        self.id = request_id
        self._connection = connection
        self.queue: asyncio.Queue = asyncio.Queue(queue_size)
        self.finished = False

    async def next(self, timeout: float):
        if self.queue.empty():
            try:
                async with asyncio.timeout(timeout):
                    reply = await self.queue.get()
            except TimeoutError:
                raise TimeoutError(f"the handler sent nothing for request {self.id} in {timeout:g} s") from None
        else:  # arrived already: no timer to set and cancel
            reply = self.queue.get_nowait()
        if reply is _GONE:
            raise HandlerGone("the handler exited")
        if isinstance(reply.get("error"), str):
            self.finished = True  # an error reply ends the request: nothing is left to cancel
            raise HandlerError.from_reply(reply)
        if "data" not in reply or reply["data"] is None:
            raise HandlerError(f"the handler's reply for request {self.id} has neither data nor error")
        return reply["data"]

    def close(self) -> None:
        """Stop tracking the request; if it had not finished, ask the handler to cancel it."""
        self._connection.forget(self.id)
        if not self.finished:
            self._connection.send({"id": self.id, "name": "cancel"})


class HandlerConnection:
    def __init__(self, command: list[str]) -> None:
        self.command = command
        self.process: asyncio.subprocess.Process | None = None
        self._streams: dict[int, RequestStream] = {}
        self._ids = itertools.count(1)
        self._writer: asyncio.StreamWriter | None = None
        self._tasks: list[asyncio.Task] = []
        self._eof_sent = False  # once stop() dropped our write half, nothing more can be sent
        self._stray_replies = RepeatedProblems()  # replies after a cancel are expected: counted, not each logged
        self.closed: asyncio.Future | None = None

    @property
    def gone(self) -> bool:
        return self.closed is None or self.closed.done()

    async def start(self) -> None:
        """Spawn the handler on the child end of a socketpair (docs/protocol.md section 1)."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for sock in (parent, child):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        child.set_inheritable(True)
        try:
            self.process = await asyncio.create_subprocess_exec(
                *self.command, stdin=subprocess.DEVNULL, stdout=None, stderr=subprocess.PIPE,
                env={**os.environ, "HFENDPOINT_FD": str(child.fileno())},
                pass_fds=(child.fileno(),), process_group=0, limit=SOCKET_BUFFER_BYTES)
        finally:
            child.close()
        reader, self._writer = await asyncio.open_unix_connection(sock=parent, limit=SOCKET_BUFFER_BYTES)
        self.closed = asyncio.get_running_loop().create_future()
        self._tasks = [asyncio.create_task(self._read_replies(reader)),
                       asyncio.create_task(self._relay_stderr(self.process.stderr))]

    def open(self, name: str, data, queue_size: int = 1) -> RequestStream:
        if self.gone or self._eof_sent:
            raise HandlerGone("the handler is not running" if self.gone
                              else "the handler is finishing its last requests")
        request_id = next(self._ids)
        try:
            packed = msgpack.packb({"id": request_id, "name": name, "data": data})
        except (OverflowError, TypeError, ValueError) as exc:
            raise unencodable(data, exc) from None
        stream = RequestStream(self, request_id, queue_size)
        self._streams[stream.id] = stream
        self._writer.write(packed)
        return stream

    async def call(self, name: str, data, timeout: float):
        """One request with exactly one reply (tokenize, embeddings)."""
        stream = self.open(name, data)
        try:
            await self.drain()
            payload = await stream.next(timeout)
            stream.finished = True
            return payload
        finally:
            stream.close()

    def send(self, message: dict) -> None:
        if not (self.gone or self._eof_sent):
            self._writer.write(msgpack.packb(message))

    async def drain(self) -> None:
        """Wait while the socket to the handler is full (bounded memory for big request bodies)."""
        if not self.gone:
            try:
                await self._writer.drain()
            except ConnectionError as exc:
                raise HandlerGone(f"lost the handler's socket: {exc}") from None

    def forget(self, request_id: int) -> None:
        self._streams.pop(request_id, None)

    async def _read_replies(self, reader: asyncio.StreamReader) -> None:
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=256 * 1024 * 1024)
        try:
            while data := await reader.read(SOCKET_BUFFER_BYTES):
                unpacker.feed(data)
                for reply in unpacker:
                    await self._route(reply)
        except (ValueError, msgpack.UnpackException) as exc:
            error(f"the handler sent bytes that are not MessagePack ({exc}); dropping the connection")
        except ConnectionError as exc:
            error(f"lost the handler's socket: {exc}")
        finally:
            self._mark_gone()

    async def _route(self, reply) -> None:
        request_id = reply.get("id") if isinstance(reply, dict) else None
        stream = self._streams.get(request_id)
        if stream is None:
            self._stray_replies.error("dropping replies for requests not in flight (cancelled ones, whose replies "
                                      "were on their way)", f"request {request_id!r:.40}")
            return
        if stream.queue.full():  # the production daemon's stall: every request waits for this one's reader
            await stream.queue.put(reply)
        else:
            stream.queue.put_nowait(reply)

    def _mark_gone(self) -> None:
        if self.closed.done():
            return
        self.closed.set_result(None)
        for stream in self._streams.values():
            if stream.queue.full():
                asyncio.get_running_loop().create_task(stream.queue.put(_GONE))
            else:
                stream.queue.put_nowait(_GONE)

    @staticmethod
    async def _relay_stderr(stderr: asyncio.StreamReader) -> None:
        while True:
            try:
                line = await stderr.readline()
            except ValueError:  # asyncio drops a line longer than the reader's limit
                error("handler stderr: (a line longer than 1 MiB was dropped)")
                continue
            if not line:
                return
            text = line.decode(errors="replace").rstrip()
            relayed.log(relay_level(text), f"handler stderr: {text}")

    async def stop(self) -> int:
        """Drop our write half (the handler sees EOF), wait for it to exit and return its exit code."""
        if self._writer is not None and not self._writer.is_closing():
            self._eof_sent = True
            try:
                self._writer.write_eof()
            except OSError:
                pass
        try:
            code = await asyncio.wait_for(self.process.wait(), EXIT_TIMEOUT_S)
        except asyncio.TimeoutError:
            error(f"the handler did not exit {EXIT_TIMEOUT_S:.0f} s after EOF; killing it")
            os.killpg(self.process.pid, signal.SIGKILL)
            code = await self.process.wait()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._writer is not None:
            self._writer.close()
        return code
