"""A streaming request's reply sink: its replies sent by code outside its task, as its task would yield them.

A handler that advances many streams from one event (an engine step gives every request in flight its next
tokens) would otherwise wake each request's task to yield one reply. reply_sink(), called from the handler's
async generator, gives that generator's request its sink: send() queues a reply at once. The sink is ready while
the request runs and the daemon reads; when it is not (the writer paused, the request cancelled or ended), the
handler yields instead, so that the request's task waits for the daemon as it does for its yielded replies.
"""
import asyncio
import contextvars

_current: contextvars.ContextVar["ReplySink | None"] = contextvars.ContextVar("reply_sink", default=None)


class ReplySink:
    __slots__ = ("_writer", "_prefix", "_task", "sent")

    def __init__(self, writer, prefix: bytes, task: asyncio.Task):
        """writer: the session's ReplyWriter; prefix: the request's data_prefix(); task: the request's."""
        self._writer, self._prefix, self._task = writer, prefix, task
        self.sent = False

    @property
    def ready(self) -> bool:
        return not self._writer.paused and not self._task.done() and not self._task.cancelling()

    def send(self, payload) -> None:
        """Queues one reply, as yielding it would (nothing once the request is cancelled or has ended)."""
        if self._task.done() or self._task.cancelling():
            return
        self._writer.send_data(self._prefix, payload)
        self.sent = True


def reply_sink() -> ReplySink | None:
    """The sink of the streaming request whose handler calls this (None outside one)."""
    return _current.get()


def attach(sink: ReplySink) -> None:
    """Makes `sink` the current task's (the session calls this in the request's task, before its handler runs)."""
    _current.set(sink)
