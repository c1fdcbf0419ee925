"""The daemon protocol: MessagePack requests in, reply chunks out (see docs/protocol.md).

    import daemon_protocol

    @daemon_protocol.handler("chat_completions")
    async def chat(data):
        yield {"content": "hi", "finish_reason": "stop"}

    asyncio.run(daemon_protocol.run())
"""
from .log import error
from .registry import Registry, handler
from .server import run, serve
from .transports import TransportError

__all__ = ["Registry", "TransportError", "error", "handler", "run", "serve"]
