"""The three ways to reach the daemon, all with the same framing.

- `fd:N`: the inherited socket (the production path; the daemon sets HFENDPOINT_FD=N);
- `stdio`: requests on stdin, replies on stdout (fd 1 is then pointed at stderr so stray prints
  cannot corrupt the stream);
- `unix-listen:PATH` / `unix-connect:PATH`: a Unix socket, for local testing. A listening handler
  serves the first connection only and removes the socket file when done; only its own user may connect.

On each, the daemon may drop its write half (EOF) and still read the replies: a socket stays open for
writing (Session.eof_received keeps it), and stdout is a pipe of its own.
"""
import asyncio
import os
import selectors
import socket
import stat
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from .log import error
from .session import Session
from .writer import ReplyWriter

KINDS = ("fd", "stdio", "unix-listen", "unix-connect")
HOW_TO_CHOOSE = ("set HFENDPOINT_FD (the daemon does), HFENDPOINT_STDIO=1, HFENDPOINT_UNIX_LISTEN=PATH or "
                 "HFENDPOINT_UNIX_CONNECT=PATH, or pass run(transport='fd:N' | 'stdio' | 'unix-listen:PATH' | "
                 "'unix-connect:PATH')")


class TransportError(Exception):
    """The transport is misconfigured or cannot be opened; the message says what to do."""


@dataclass(frozen=True)
class TransportSpec:
    kind: str
    address: str | int | None = None


def parse_transport(text: str) -> TransportSpec:
    kind, _, address = text.partition(":")
    if kind == "stdio" and not address:
        return TransportSpec("stdio")
    if kind == "fd" and address.isdigit():
        return TransportSpec("fd", int(address))
    if kind in ("unix-listen", "unix-connect") and address:
        return TransportSpec(kind, address)
    raise TransportError(f"unknown transport {text!r}: expected 'fd:N', 'stdio', 'unix-listen:PATH' or "
                         "'unix-connect:PATH'")


def transport_from_env(env=os.environ) -> TransportSpec:
    if env.get("HFENDPOINT_FD"):
        fd = env["HFENDPOINT_FD"]
        if not fd.isdigit():
            raise TransportError(f"HFENDPOINT_FD must be a file descriptor number, got {fd!r}")
        return TransportSpec("fd", int(fd))
    if env.get("HFENDPOINT_UNIX_LISTEN"):
        return TransportSpec("unix-listen", env["HFENDPOINT_UNIX_LISTEN"])
    if env.get("HFENDPOINT_UNIX_CONNECT"):
        return TransportSpec("unix-connect", env["HFENDPOINT_UNIX_CONNECT"])
    if env.get("HFENDPOINT_STDIO", "").lower() in ("1", "true", "yes"):
        return TransportSpec("stdio")
    raise TransportError(f"no transport to the daemon: {HOW_TO_CHOOSE}")


Closer = Callable[[], Awaitable[None]]


async def open_transport(spec: TransportSpec, session: Session, writer: ReplyWriter) -> Closer:
    """Connect `session` (reading) and `writer` (writing) to the daemon; returns the cleanup to await
    once the session is over."""
    try:
        return await _open(spec, session, writer)
    except (OSError, ValueError) as exc:
        where = "" if spec.address is None else f" {spec.address}"
        raise TransportError(f"cannot open the {spec.kind} transport{where}: {exc}") from exc


async def _open(spec: TransportSpec, session: Session, writer: ReplyWriter) -> Closer:
    loop = asyncio.get_running_loop()
    if spec.kind == "fd":
        await loop.connect_accepted_socket(lambda: session, _socket_from_fd(spec.address))
        return _nothing
    if spec.kind == "stdio":
        return await _open_stdio(loop, session, writer)
    if spec.kind == "unix-connect":
        await loop.create_unix_connection(lambda: session, spec.address)
        return _nothing
    if spec.kind == "unix-listen":
        return await _listen_once(loop, session, spec.address)
    raise TransportError(f"unknown transport kind {spec.kind!r}; expected one of {KINDS}")


async def _nothing() -> None:
    pass


def _socket_from_fd(fd: int) -> socket.socket:
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise TransportError(f"HFENDPOINT_FD={fd} is not an open socket ({exc}); "
                         "the daemon passes the child's end of its socketpair there") from exc
    if sock.type != socket.SOCK_STREAM:
        raise TransportError(f"HFENDPOINT_FD={fd} is not a stream socket")
    return sock


class _WritePipeSide(asyncio.BaseProtocol):
    """Forwards the stdout pipe's flow control to the writer."""

    def __init__(self, writer: ReplyWriter) -> None:
        self._writer = writer

    def pause_writing(self) -> None:
        self._writer.pause_writing()

    def resume_writing(self) -> None:
        self._writer.resume_writing()

    def connection_lost(self, exc) -> None:
        self._writer.connection_lost()


async def _open_stdio(loop, session: Session, writer: ReplyWriter) -> Closer:
    reply_fd = os.dup(sys.stdout.fileno())
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    write_transport, _ = await loop.connect_write_pipe(lambda: _WritePipeSide(writer),
                                                       os.fdopen(reply_fd, "wb", buffering=0))
    writer.attach(write_transport)
    _require_watchable(sys.stdin.fileno())
    stdin = os.fdopen(os.dup(sys.stdin.fileno()), "rb", buffering=0)
    read_transport, _ = await loop.connect_read_pipe(lambda: session, stdin)

    async def close() -> None:
        read_transport.close()
    return close


def _require_watchable(fd: int) -> None:
    """asyncio watches stdin in the background: an fd the selector refuses (a regular file, /dev/null) would fail
    there, unseen, and the handler would wait forever. Refuse it here instead."""
    with selectors.DefaultSelector() as selector:
        try:
            selector.register(fd, selectors.EVENT_READ)
        except (OSError, ValueError) as exc:
            raise TransportError("the stdio transport reads requests from stdin, which must be a pipe, a socket "
                                 f"or a terminal, not a file or /dev/null ({exc})") from exc


class _Refuse(asyncio.Protocol):
    def connection_made(self, transport) -> None:
        error("refusing a second connection: this handler serves one daemon connection")
        transport.close()


def _owner_only_listener(path: str) -> socket.socket:
    """A Unix socket listening at `path` that only this user can connect to, whatever the umask: Linux creates
    the socket file with the mode given to the socket before bind, so it is never open to others; the chmod
    after bind covers systems that ignore it. A stale socket file at `path` is replaced."""
    try:
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.fchmod(sock.fileno(), 0o600)
        sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(1)
    except OSError:
        sock.close()
        raise
    return sock


async def _listen_once(loop, session: Session, path: str) -> Closer:
    accepted = loop.create_future()

    def accept():
        if accepted.done():
            return _Refuse()
        accepted.set_result(None)
        return session

    server = await loop.create_unix_server(accept, sock=_owner_only_listener(path))
    error(f"listening on unix socket {path}")
    await accepted
    server.close()

    async def close() -> None:
        await server.wait_closed()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return close
