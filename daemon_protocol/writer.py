"""The single reply writer: encodes replies and coalesces them into few large writes.

Hundreds of concurrent streams each send a small chunk per token. Every reply is appended to one
bytearray; the buffer goes to the transport once per event-loop iteration (or at once past
FLUSH_BYTES), so a step that produces 256 chunks costs one write, not 256.
"""
import asyncio

import msgpack

FLUSH_BYTES = 256 * 1024        # write at once when the buffer grows past this
HIGH_WATER = 1024 * 1024        # transport buffer above this pauses streaming handlers ...
LOW_WATER = 256 * 1024          # ... until it drains below this
CLOSE_TIMEOUT_S = 5.0           # how long closing waits for the daemon to read what is left


def _encode_unknown(obj):
    """Let array-likes (numpy, torch on CPU) through as lists; anything else is a handler bug."""
    tolist = getattr(obj, "tolist", None)
    if tolist is None:
        raise TypeError(f"cannot encode {type(obj).__name__} in a reply: use dict, list, str, bytes, int, float, bool "
                        "or None")
    return tolist()


def data_prefix(request_id: int) -> bytes:
    """The bytes of `{"id": request_id, "data": ` (a 2-entry map), computed once per request."""
    return b"\x82\xa2id" + msgpack.packb(request_id) + b"\xa4data"


class ReplyWriter:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        # Floats go out as f32: the daemon decodes embeddings as f32, and it halves their size.
        self._pack = msgpack.Packer(use_single_float=True, default=_encode_unknown).pack
        self._buffer = bytearray()
        self._flush_scheduled = False
        self._transport: asyncio.WriteTransport | None = None
        self._writable = asyncio.Event()
        self._writable.set()
        self._lost = loop.create_future()
        self.paused = False
        self.closed = False

    def attach(self, transport: asyncio.WriteTransport) -> None:
        transport.set_write_buffer_limits(high=HIGH_WATER, low=LOW_WATER)
        self._transport = transport
        self._schedule_flush()

    @property
    def attached(self) -> bool:
        return self._transport is not None

    def send_data(self, prefix: bytes, payload) -> None:
        """Queue one `{"id", "data"}` reply; `prefix` comes from data_prefix(). Raises TypeError
        (and queues nothing) when the payload cannot be encoded."""
        packed = self._pack(payload)
        buffer = self._buffer
        buffer += prefix
        buffer += packed
        if len(buffer) >= FLUSH_BYTES:
            self.flush()
        elif not self._flush_scheduled:
            self._schedule_flush()

    def send_error(self, request_id: int, message: str, extra: dict | None = None) -> None:
        """Queue `{"id", "error"}`, plus `extra` keys (the status extension, daemon_protocol/errors.py)."""
        self._buffer += msgpack.packb({"id": request_id, "error": message, **(extra or {})})
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        self._flush_scheduled = True
        self._loop.call_soon(self.flush)

    def flush(self) -> None:
        self._flush_scheduled = False
        if not self._buffer or self._transport is None:
            return
        if self.closed:
            self._buffer.clear()
            return
        data, self._buffer = self._buffer, bytearray()
        self._transport.write(data)

    async def wait_writable(self) -> None:
        """Wait until the transport has drained below LOW_WATER (streams call this when paused)."""
        await self._writable.wait()

    # Flow control and end of connection, forwarded by the transport's protocol.
    def pause_writing(self) -> None:
        self.paused = True
        self._writable.clear()

    def resume_writing(self) -> None:
        self.paused = False
        self._writable.set()

    def connection_lost(self) -> None:
        """The transport is gone: drop what is queued and let paused streams finish."""
        self.closed = True
        self._buffer.clear()
        self.resume_writing()
        if not self._lost.done():
            self._lost.set_result(None)

    async def wait_lost(self) -> None:
        """Wait until the transport is gone (nothing sent from then on reaches the daemon)."""
        await asyncio.shield(self._lost)

    async def close(self) -> None:
        """Write what is queued, close the transport and wait (bounded) until the daemon got it."""
        self.flush()
        if self._transport is None or self.closed:
            return
        self._transport.close()
        try:
            await asyncio.wait_for(asyncio.shield(self._lost), CLOSE_TIMEOUT_S)
        except asyncio.TimeoutError:
            self._transport.abort()
