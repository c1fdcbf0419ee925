"""The daemon protocol: MessagePack requests in, reply chunks out (see docs/protocol.md).

    import daemon_protocol

    @daemon_protocol.handler("chat_completions")
    async def chat(data):
        yield {"content": "hi", "finish_reason": "stop"}

    asyncio.run(daemon_protocol.run())

A handler refuses a request by raising RequestError: its error reply has status 400, or the status it carries
(docs/errors.md). Any other exception is a 500, its traceback logged.
"""
from .errors import ReplyError, RequestError
from .log import error
from .registry import Registry, handler
from .reply_sink import ReplySink, reply_sink
from .server import run, serve
from .transports import TransportError

__all__ = ["Registry", "ReplyError", "ReplySink", "RequestError", "TransportError", "error", "handler", "reply_sink",
           "run", "serve"]
