"""The request loop: decode requests from the daemon, run one task per request, send replies.

Failure rules (docs/protocol.md section 7, docs/drain.md): unknown names and handler exceptions get error
replies; objects that are not request maps are skipped and counted (logged at the first of each kind, then
at each power of ten); a request reusing the id of one in
flight fails both (one error reply for the id); bytes that are not MessagePack, or a length header
claiming more than a message may hold, fail every request in flight and end the session with exit code 1.
EOF (the daemon dropped its write half) drains: the requests in flight run to their end, bounded by the
drain timeout, and the session ends with exit code 0.
"""
import asyncio
import traceback

import msgpack

from .errors import error_fields, error_message, error_status
from .length_guard import LengthGuard, unpacker_limits
from .log import RepeatedProblems, error
from .registry import COROUTINE, STREAM, Registry
from .reply_sink import ReplySink, attach
from .writer import ReplyWriter, data_prefix

MAX_MESSAGE_BYTES = 256 * 1024 * 1024   # the unpacker refuses (as corrupt) a single object above this
MAX_U64 = (1 << 64) - 1
MAX_NAME_ECHO = 64                      # characters of an unknown handler name quoted back
SHUTDOWN_TIMEOUT_S = 10.0               # how long cancelled handlers get to run their cleanup
DRAIN_TIMEOUT_S = 30.0                  # after EOF, how long the requests in flight get to finish
CORRUPT_STREAM_ERROR = "the daemon sent bytes that are not MessagePack; the handler is exiting"


def _preview(obj, limit: int = 120) -> str:
    text = repr(obj)
    return text if len(text) <= limit else text[:limit] + "..."


class Session(asyncio.Protocol):
    """One connection to the daemon. `finished` resolves to the process exit code."""

    def __init__(self, registry: Registry, writer: ReplyWriter, loop: asyncio.AbstractEventLoop) -> None:
        self._registry = registry
        self._writer = writer
        self._loop = loop
        self._unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, unicode_errors="replace",
                                          **unpacker_limits(MAX_MESSAGE_BYTES))
        self._length_guard = LengthGuard(MAX_MESSAGE_BYTES)
        self._tasks: dict[int, asyncio.Task] = {}
        self._owns_writer = False  # stdio: the writer has its own transport (stdout)
        self._stopped = False
        self._junk = RepeatedProblems()
        self.finished: asyncio.Future[int] = loop.create_future()

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        if not self._writer.attached:
            self._owns_writer = True
            self._writer.attach(transport)

    def data_received(self, data: bytes) -> None:
        if self._stopped:
            return
        unpacker = self._unpacker
        try:
            unpacker.feed(data)
            for obj in unpacker:
                self._dispatch(obj)
            self._length_guard.feed(data)
        except Exception as exc:  # the unpacker's and the guard's errors: the stream cannot be resynchronised
            self._fail_stream(exc)

    def eof_received(self) -> bool:
        self._stop(0)
        return True  # keep our write half open: the requests in flight drain (run() awaits drain())

    def connection_lost(self, exc) -> None:
        if self._owns_writer:
            self._writer.connection_lost()
        self._stop(0)

    def pause_writing(self) -> None:
        self._writer.pause_writing()

    def resume_writing(self) -> None:
        self._writer.resume_writing()

    # Requests
    def _dispatch(self, obj) -> None:
        if type(obj) is not dict:
            self._junk.error("skipping a message that is not a request map", _preview(obj))
            return
        request_id = obj.get("id")
        if type(request_id) is not int or not 0 <= request_id <= MAX_U64:
            self._junk.error("skipping a request without a usable id (an unsigned 64-bit int)", _preview(obj))
            return
        name = obj.get("name")
        if name == "cancel":
            self._cancel(request_id)
            return
        if request_id in self._tasks:
            self._fail_duplicate(request_id)
            return
        if type(name) is not str:
            self._writer.send_error(request_id,
                                    f"request has no handler name: 'name' must be a string, got {_preview(name)}")
            return
        entry = self._registry.get(name)
        if entry is None:
            shown = f"'{name}'" if len(name) <= MAX_NAME_ECHO else \
                f"'{name[:MAX_NAME_ECHO]}...' (a name of {len(name)} characters, cut short)"
            self._writer.send_error(request_id, f"no handler for {shown}")
            return
        kind, fn = entry
        data = obj.get("data")
        if kind == STREAM:
            self._start(request_id, self._serve_stream(request_id, name, fn, data))
        elif kind == COROUTINE:
            self._start(request_id, self._serve_call(request_id, name, fn, data))
        else:
            self._serve_function(request_id, name, fn, data)

    def _start(self, request_id: int, coro) -> None:
        task = self._loop.create_task(coro)
        self._tasks[request_id] = task
        task.add_done_callback(lambda done: self._forget(request_id, done))

    def _serve_function(self, request_id: int, name: str, fn, data) -> None:
        """Plain functions run inline; one returning an awaitable or an async iterator is served like
        a coroutine or an async generator."""
        try:
            result = fn(data)
        except Exception as exc:
            self._fail_request(request_id, name, exc)
            return
        if hasattr(result, "__anext__"):
            self._start(request_id, self._serve_stream(request_id, name, lambda _: result, None))
        elif hasattr(result, "__await__"):
            self._start(request_id, self._serve_call(request_id, name, lambda _: result, None))
        else:
            self._send_data(request_id, name, data_prefix(request_id), result)

    async def _serve_stream(self, request_id: int, name: str, fn, data) -> None:
        task = asyncio.current_task()
        writer = self._writer
        prefix = data_prefix(request_id)
        sink = ReplySink(writer, prefix, task)
        attach(sink)  # in this task's own context: its handler's reply_sink()
        try:
            stream = fn(data)
        except Exception as exc:
            self._fail_request(request_id, name, exc)
            return
        sent = False
        try:
            async for payload in stream:
                if task.cancelling():  # the handler swallowed its cancellation: send nothing more
                    break
                writer.send_data(prefix, payload)
                sent = True
                if writer.paused:
                    await writer.wait_writable()
            if not sent and not sink.sent and not task.cancelling():
                writer.send_error(request_id, f"handler '{name}' finished without sending a reply")
        except asyncio.CancelledError:
            pass
        except Exception as exc:
            if not task.cancelling():
                self._fail_request(request_id, name, exc)
        finally:
            try:
                aclose = getattr(stream, "aclose", None)  # runs the generator's cleanup if it was stopped early
                if aclose is not None:
                    await aclose()
            except Exception as exc:
                error(f"request {request_id} ({name}): cleanup failed: {exc!r}")

    async def _serve_call(self, request_id: int, name: str, fn, data) -> None:
        task = asyncio.current_task()
        try:
            result = await fn(data)
            if not task.cancelling():
                self._send_data(request_id, name, data_prefix(request_id), result)
        except asyncio.CancelledError:
            pass
        except Exception as exc:
            if not task.cancelling():
                self._fail_request(request_id, name, exc)

    def _send_data(self, request_id: int, name: str, prefix: bytes, payload) -> None:
        try:
            self._writer.send_data(prefix, payload)
        except Exception as exc:
            self._fail_request(request_id, name, exc)

    def _fail_request(self, request_id: int, name: str, exc: Exception) -> None:
        """The error reply, with the HTTP status the failure declares (docs/errors.md); an unexpected one
        (status 500) is logged with its traceback."""
        if error_status(exc) is None:
            error(f"request {request_id} ({name}) failed:\n" + "".join(traceback.format_exception(exc)).rstrip())
        self._writer.send_error(request_id, error_message(exc), error_fields(exc))

    def _forget(self, request_id: int, task: asyncio.Task) -> None:
        if self._tasks.get(request_id) is task:
            del self._tasks[request_id]

    def _cancel(self, request_id: int) -> None:
        """The `cancel` extension: the handler's task gets CancelledError; its cleanup runs."""
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()

    def _fail_duplicate(self, request_id: int) -> None:
        """A second request with the id of one in flight. The daemon could not tell their replies apart, and an
        error reply ends that id for it: the live request is cancelled and the id gets one error reply."""
        error(f"request {request_id}: a request with that id is already in flight; failing both")
        self._tasks[request_id].cancel()
        self._writer.send_error(request_id, f"request id {request_id} was sent again while a request with that id "
                                            "was in flight; both are failed (request ids must be unique)",
                                {"status": 400, "code": "duplicate_request_id"})

    # End of the session
    def _fail_stream(self, exc: Exception) -> None:
        error(f"{CORRUPT_STREAM_ERROR} ({type(exc).__name__}: {exc}); failing {len(self._tasks)} request(s) in flight")
        for request_id, task in self._tasks.items():
            task.cancel()
            self._writer.send_error(request_id, CORRUPT_STREAM_ERROR)
        self._stop(1)

    def _stop(self, exit_code: int) -> None:
        self._stopped = True
        if not self.finished.done():
            self.finished.set_result(exit_code)

    async def drain(self, timeout: float) -> None:
        """After EOF: the requests in flight run to their end while the daemon can still read their replies, for
        at most `timeout` seconds; those still running then get an error reply and are cancelled."""
        tasks = list(self._tasks.values())
        if not tasks or self._writer.closed:
            return
        error(f"the daemon closed its side: finishing {len(tasks)} request(s) in flight (up to {timeout:g} s)")
        all_done = self._loop.create_task(asyncio.wait(tasks, timeout=timeout))
        lost = self._loop.create_task(self._writer.wait_lost())
        await asyncio.wait((all_done, lost), return_when=asyncio.FIRST_COMPLETED)
        all_done.cancel()
        lost.cancel()
        late = {request_id: task for request_id, task in self._tasks.items() if not task.done()}
        if late and not self._writer.closed:
            error(f"{len(late)} request(s) did not finish within the drain timeout ({timeout:g} s); aborting them")
        for request_id, task in late.items():
            task.cancel()
            self._writer.send_error(request_id, f"the handler is shutting down and this request did not finish "
                                                f"within its drain timeout ({timeout:g} s)",
                                    {"status": 503, "code": "shutting_down"})

    async def shutdown(self) -> None:
        """Cancel every request in flight and give their cleanup a bounded time to run."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=SHUTDOWN_TIMEOUT_S)
            if pending:
                error(f"{len(pending)} handler(s) did not finish within {SHUTDOWN_TIMEOUT_S:.0f} s of cancellation")
