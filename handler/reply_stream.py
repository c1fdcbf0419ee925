"""A chat request's way from the engine's outputs to its reply chunks.

The engine hands the outputs of every request of a step to the event loop in one callback (engine/worker.py),
which calls put_nowait once per output. While the request's reply sink (daemon_protocol/reply_sink.py) is ready,
put_nowait turns the output into chunks there and then and sends them: a step costs each request no wake-up of its
task. Otherwise (no sink, the daemon not reading, outputs already waiting or the task still yielding the chunks of
those it took) the outputs wait here and the request's task takes them, a step's worth at a time, to yield their
chunks. Either way the chunks keep the outputs' order.
An exception raised while advancing in the callback is raised in the task, by take().
"""
import asyncio
from collections.abc import Callable


class ReplyStream:
    __slots__ = ("_advance", "_sink", "_outputs", "_waiter", "_error", "_yielding")

    def __init__(self, advance: Callable[[list], list[dict]], sink=None):
        """advance(outputs): the reply chunks these outputs make (the request's last chunk has finish_reason).
        sink: the request's daemon_protocol ReplySink, or None."""
        self._advance, self._sink = advance, sink
        self._outputs: list = []
        self._waiter: asyncio.Future | None = None
        self._error: Exception | None = None
        self._yielding = False  # the task took outputs and may not have yielded all their chunks yet

    def put_nowait(self, output) -> None:
        """On the event loop's thread, as asyncio.Queue's."""
        sink = self._sink
        if self._outputs or self._yielding or sink is None or self._error is not None or not sink.ready:
            self._outputs.append(output)
            self._wake()
            return
        try:
            chunks = self._advance([output])
            for chunk in chunks:
                sink.send(chunk)
        except Exception as exc:  # noqa: BLE001 - the request's task raises it
            self._error = exc
            self._wake()
            return
        if chunks and "finish_reason" in chunks[-1]:  # the request's last: its task may end
            self._wake()

    async def take(self) -> list:
        """The outputs that arrived since the last take (none once the callback has sent the last chunk), waiting
        for the callback to have something for the task. The task calls it again once it has yielded the chunks of
        what it took."""
        self._yielding = False
        if not self._outputs and self._error is None:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        if self._error is not None:
            raise self._error
        outputs, self._outputs = self._outputs, []
        self._yielding = bool(outputs)
        return outputs

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # a cancelled reader has gone
                waiter.set_result(None)
