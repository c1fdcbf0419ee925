"""`run()`: serve the registered handlers over one transport until the daemon goes away."""
import asyncio

from .log import error
from .registry import Registry, default_registry
from .session import DRAIN_TIMEOUT_S, Session
from .transports import TransportError, open_transport, parse_transport, transport_from_env
from .writer import ReplyWriter


async def run(transport: str | None = None, registry: Registry = default_registry,
              drain_timeout: float = DRAIN_TIMEOUT_S) -> None:
    """Serve requests until EOF from the daemon, let those in flight finish (for at most `drain_timeout`
    seconds; the rest get an error reply and are cancelled), and return.

    `transport` is 'fd:N', 'stdio', 'unix-listen:PATH' or 'unix-connect:PATH'; by default it comes
    from the environment (HFENDPOINT_FD, HFENDPOINT_UNIX_LISTEN, HFENDPOINT_UNIX_CONNECT,
    HFENDPOINT_STDIO=1). Raises TransportError when it cannot reach the daemon, and SystemExit(1)
    when the daemon sent bytes that are not MessagePack.
    """
    spec = parse_transport(transport) if transport else transport_from_env()
    loop = asyncio.get_running_loop()
    writer = ReplyWriter(loop)
    session = Session(registry, writer, loop)
    close_transport = await open_transport(spec, session, writer)
    try:
        exit_code = await session.finished
        if exit_code == 0:
            await session.drain(drain_timeout)
    finally:
        await session.shutdown()
        await writer.close()
        await close_transport()
    if exit_code:
        raise SystemExit(exit_code)


def serve(transport: str | None = None, registry: Registry = default_registry,
          drain_timeout: float = DRAIN_TIMEOUT_S) -> None:
    """Blocking form of run(), on uvloop when it is installed."""
    try:
        import uvloop
        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        try:
            runner.run(run(transport, registry, drain_timeout))
        except TransportError as exc:
            error(str(exc))
            raise SystemExit(2) from None
