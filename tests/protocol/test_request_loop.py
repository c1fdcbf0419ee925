"""The request loop against a real handler process (tests/workers/echo_worker.py) over a socketpair."""
import os
import socket
import stat
import struct
import subprocess
import sys
import time
from collections import defaultdict

import msgpack
import pytest

from protocol_support import ECHO_WORKER, HandlerClient, child_env, stop_process

pytestmark = pytest.mark.slow  # handler processes over real sockets

CORRUPT = "the daemon sent bytes that are not MessagePack; the handler is exiting"
DUPLICATE = ("request id 1 was sent again while a request with that id was in flight; both are failed "
             "(request ids must be unique)")
CLAIM = 300 * 1024 * 1024  # more than the 256 MiB a message may hold


def chunks_by_id(replies) -> dict:
    by_id = defaultdict(list)
    for reply in replies:
        by_id[reply["id"]].append(reply.get("data", reply.get("error")))
    return by_id


def wait_for_cleanup(handler: HandlerClient, tag: str, first_id: int) -> list:
    """Ask the `cleanups` handler until `tag` shows up; returns every reply read on the way."""
    seen = []
    for query_id in range(first_id, first_id + 200):
        handler.send({"id": query_id, "name": "cleanups"})
        replies = handler.read(lambda r: any(x["id"] == query_id for x in r))
        seen += replies
        if tag in replies[-1]["data"]:
            return seen
        time.sleep(0.01)
    raise AssertionError(f"cleanup {tag!r} never ran; stderr: {handler.stderr()}")


def test_a_thousand_pipelined_streams_interleave_and_complete_in_order(handler):
    handler.send(*({"id": i, "name": "count", "data": {"n": 10}} for i in range(1, 1001)))
    replies = handler.read_count(10_000)
    by_id = chunks_by_id(replies)
    assert set(by_id) == set(range(1, 1001))
    assert all(chunks == list(range(10)) for chunks in by_id.values())
    first_ids = {r["id"] for r in replies[:1000]}
    assert len(first_ids) > 200, "streams did not interleave"  # one after the other: exactly 100


def test_unknown_handler_gets_the_exact_error_bytes(handler):
    expected = msgpack.packb({"id": 5, "error": "no handler for 'nope'"})
    handler.send({"id": 5, "name": "nope", "data": None})
    received = b""
    while len(received) < len(expected):
        received += handler.sock.recv(len(expected) - len(received))
    assert received == expected
    handler.send({"id": 6, "name": "echo", "data": "still here"})
    assert handler.read_count(1) == [{"id": 6, "data": "still here"}]


def test_an_unknown_handler_name_is_quoted_cut_short(handler):
    handler.send({"id": 5, "name": "n" * 100_000, "data": None})
    [reply] = handler.read_count(1)
    assert reply["error"] == f"no handler for '{'n' * 64}...' (a name of 100000 characters, cut short)"


def test_non_maps_and_unusable_ids_are_counted_and_skipped(handler):
    handler.send([1, 2], "text", 5, None, {"name": "echo", "data": 1}, {"id": -1, "name": "echo"},
                 {"id": "7", "name": "echo"}, {"id": True, "name": "echo"}, {"id": 1.5, "name": "echo"},
                 {"id": 9, "name": "echo", "data": "ok"})
    assert handler.read_count(1) == [{"id": 9, "data": "ok"}]
    handler.send({"id": 10, "name": "echo", "data": "after"})
    assert handler.read_count(1) == [{"id": 10, "data": "after"}]
    handler.send(*range(6))  # the 10th junk object: logged again, with the count
    handler.send({"id": 11, "name": "echo", "data": "last"})
    assert handler.read_count(1) == [{"id": 11, "data": "last"}]
    log = handler.stderr()
    assert log.count("skipping a message that is not a request map") == 2, "the 1st and the 10th"
    assert "(10 so far; logged again at each power of ten)" in log
    assert log.count("skipping a request without a usable id") == 1


def test_missing_name_and_invalid_data_get_error_replies_others_unaffected(handler):
    handler.send({"id": 1, "name": "count", "data": {"n": 50}},
                 {"id": 2, "data": {}},
                 {"id": 3, "name": 17},
                 {"id": 4, "name": "chat_completions", "data": {"messages": "not a list"}},
                 {"id": 5, "name": "chat_completions", "data": None},
                 {"id": 6, "name": "fail", "data": "boom"})
    by_id = chunks_by_id(handler.read(lambda r: len(r) == 55))
    assert by_id[1] == list(range(50))
    assert by_id[2] == ["request has no handler name: 'name' must be a string, got None"]
    assert by_id[3] == ["request has no handler name: 'name' must be a string, got 17"]
    assert by_id[4] == ["messages must be a non-empty list of messages, got 'not a list'"]
    assert by_id[5] == ["request data must be a map, got nil"]
    assert by_id[6] == ["RuntimeError: failing as asked: boom"]
    assert "RuntimeError: failing as asked: boom" in handler.stderr()  # unexpected errors log a traceback
    assert "Traceback" in handler.stderr()


def test_handler_kinds_and_unencodable_chunks(handler):
    handler.send({"id": 1, "name": "echo_sync", "data": {"a": [1, 2]}},
                 {"id": 2, "name": "echo_lambda", "data": "via coroutine"},
                 {"id": 3, "name": "unencodable"},
                 {"id": 4, "name": "silent_stream"})
    by_id = chunks_by_id(handler.read_count(5))
    assert by_id[4] == ["handler 'silent_stream' finished without sending a reply"]
    assert by_id[1] == [{"a": [1, 2]}]
    assert by_id[2] == ["via coroutine"]
    assert by_id[3][0] == 1
    assert by_id[3][1].startswith("TypeError: cannot encode object in a reply")


def test_duplicate_id_in_flight_fails_both_with_one_error_reply(handler):
    """The daemon cannot tell two live requests of one id apart, and an error reply ends that id for it: the id
    gets one error reply, after which nothing more comes for it (the live request is cancelled)."""
    handler.send({"id": 1, "name": "slow", "data": "dup"})
    handler.read_count(1)
    handler.send({"id": 1, "name": "echo", "data": "dup"}, {"id": 2, "name": "echo", "data": "x"})
    replies = handler.read(lambda r: {"id": 2, "data": "x"} in r)
    replies += wait_for_cleanup(handler, "dup cancelled", first_id=100)
    ones = [r for r in replies if r["id"] == 1]
    assert ones[-1] == {"id": 1, "error": DUPLICATE, "status": 400, "code": "duplicate_request_id"}
    assert all(isinstance(r.get("data"), int) for r in ones[:-1])
    handler.send({"id": 1, "name": "echo", "data": "reused once finished"})
    assert handler.read_count(1) == [{"id": 1, "data": "reused once finished"}]
    assert "request 1: a request with that id is already in flight" in handler.stderr()


def test_cancel_stops_the_stream_and_runs_its_cleanup(handler):
    handler.send({"id": 1, "name": "slow", "data": "stream-one"}, {"id": 2, "name": "slow", "data": "stream-two"})
    handler.read(lambda r: {1, 2} <= {x["id"] for x in r})
    handler.send({"id": 1, "name": "cancel"}, {"id": 12345, "name": "cancel"})  # the unknown id is ignored
    wait_for_cleanup(handler, "stream-one cancelled", first_id=100)
    after = handler.read(lambda r: sum(x["id"] == 2 for x in r) >= 5)
    assert [x["id"] for x in after] == [2] * 5, "chunks for a cancelled request after its cleanup"
    assert "stream-two" not in handler.stderr()
    handler.send({"id": 2, "name": "cancel"})
    wait_for_cleanup(handler, "stream-two cancelled", first_id=400)


def test_garbage_fails_requests_in_flight_and_exits_non_zero(handler):
    handler.send({"id": 1, "name": "slow", "data": "g1"}, {"id": 2, "name": "slow", "data": "g2"})
    handler.read(lambda r: {1, 2} <= {x["id"] for x in r})
    handler.send_raw(b"\xc1\xc1garbage")
    errors = [r for r in handler.read_rest() if "error" in r]
    assert sorted(errors, key=lambda r: r["id"]) == [{"id": 1, "error": CORRUPT}, {"id": 2, "error": CORRUPT}]
    assert handler.wait() == 1
    log = handler.stderr()
    assert "not MessagePack" in log and "cleanup: g1 cancelled" in log and "cleanup: g2 cancelled" in log
    assert "Traceback" not in log


@pytest.mark.parametrize("header", [
    b"\xdb" + struct.pack(">I", CLAIM),                      # str 32
    b"\xc6" + struct.pack(">I", CLAIM),                      # bin 32
    b"\xc9" + struct.pack(">I", CLAIM) + b"\x01",           # ext 32
    b"\xdd" + struct.pack(">I", CLAIM),                      # array 32 (msgpack counted these already)
    b"\x83" + b"".join(map(msgpack.packb, ["id", 9, "name", "echo", "data"])) + b"\x91\xdb" + struct.pack(
        ">I", CLAIM),                                         # in a list inside a request map
], ids=["str32", "bin32", "ext32", "array32", "nested"])
def test_a_length_over_the_limit_fails_requests_in_flight_and_exits_non_zero(handler, header):
    """A header claiming more than a message may hold is a corrupt stream as soon as its bytes are in, even when
    they come one at a time: nothing after it would ever be read."""
    handler.send({"id": 1, "name": "slow", "data": "claimed"})
    handler.read_count(1)
    for i in range(len(header)):
        handler.send_raw(header[i:i + 1])
    errors = [r for r in handler.read_rest() if "error" in r]
    assert errors == [{"id": 1, "error": CORRUPT}]
    assert handler.wait() == 1
    assert "more than the 268435456 bytes a message may hold" in handler.stderr() or header[0] == 0xdd
    assert "cleanup: claimed cancelled" in handler.stderr()


def test_a_large_message_under_the_limit_still_arrives_in_pieces(handler):
    text = "x" * (3 << 20)
    data = [{"text": text, "blob": b"\x01" * 70000}, list(range(5000))]
    packed = msgpack.packb({"id": 1, "name": "echo", "data": data})
    for start in range(0, len(packed), 65521):
        handler.send_raw(packed[start:start + 65521])
    assert handler.read_count(1) == [{"id": 1, "data": data}]


def test_eof_drains_the_requests_in_flight_then_exits_zero(handler):
    """The daemon drops its write half (what it does on SIGTERM): the requests in flight run to their end and
    their replies still reach it; then the handler exits 0."""
    handler.send(*({"id": i, "name": "paced", "data": {"tag": f"drain-{i}", "n": 25}} for i in (1, 2, 3)))
    first = handler.read_count(1)
    handler.close_write()
    by_id = chunks_by_id(first + handler.read_rest())
    assert by_id == {i: list(range(25)) for i in (1, 2, 3)}
    assert handler.wait() == 0
    log = handler.stderr()
    assert "finishing 3 request(s) in flight" in log
    assert all(f"cleanup: drain-{i} done" in log for i in (1, 2, 3))
    assert "Traceback" not in log


def test_drain_timeout_aborts_what_is_left_with_an_error_reply(spawn_handler):
    handler = spawn_handler(HFENDPOINT_DRAIN_TIMEOUT="0.5")
    handler.send({"id": 1, "name": "slow", "data": "too-slow"},
                 {"id": 2, "name": "paced", "data": {"tag": "quick", "n": 3}})
    first = handler.read_count(1)
    handler.close_write()
    by_id = chunks_by_id(first + handler.read_rest())
    assert by_id[2] == [0, 1, 2]
    assert by_id[1][-1] == ("the handler is shutting down and this request did not finish within its drain "
                            "timeout (0.5 s)")
    assert all(isinstance(chunk, int) for chunk in by_id[1][:-1]) and len(by_id[1]) < 100
    assert handler.wait() == 0
    assert "cleanup: too-slow cancelled" in handler.stderr() and "cleanup: quick done" in handler.stderr()


def test_a_daemon_gone_for_good_cancels_at_once(handler):
    """No one is left to read replies when the whole socket is gone: nothing is drained."""
    handler.send({"id": 1, "name": "slow", "data": "orphan"})
    handler.read_count(1)
    handler.sock.close()
    assert handler.wait() == 0  # well before the slow stream's 10 s
    assert "cleanup: orphan cancelled" in handler.stderr()


def test_stdio_transport():
    proc = subprocess.Popen([sys.executable, ECHO_WORKER], env=child_env(HFENDPOINT_STDIO="1"),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        proc.stdin.write(msgpack.packb({"id": 1, "name": "count", "data": {"n": 3}})
                         + msgpack.packb({"id": 2, "name": "echo", "data": "stdio"}))
        proc.stdin.flush()
        unpacker = msgpack.Unpacker(raw=False)
        replies = []
        while len(replies) < 4:
            data = os.read(proc.stdout.fileno(), 65536)
            assert data, proc.stderr.read()
            unpacker.feed(data)
            replies += list(unpacker)
        assert chunks_by_id(replies) == {1: [0, 1, 2], 2: ["stdio"]}
        _, err = proc.communicate(timeout=20)  # closes stdin: EOF
        assert proc.returncode == 0, err
        assert b"Traceback" not in err
    finally:
        stop_process(proc, subprocess.signal.SIGKILL)


def test_stdio_eof_drains_while_stdout_stays_open():
    """stdin's EOF is the daemon dropping its write half: the replies keep coming on stdout."""
    proc = subprocess.Popen([sys.executable, ECHO_WORKER], env=child_env(HFENDPOINT_STDIO="1"),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(msgpack.packb({"id": 1, "name": "paced", "data": {"tag": "piped", "n": 20}}),
                                    timeout=30)
        unpacker = msgpack.Unpacker(raw=False)
        unpacker.feed(out)
        assert chunks_by_id(unpacker) == {1: list(range(20))}
        assert proc.returncode == 0 and b"cleanup: piped done" in err
    finally:
        stop_process(proc, subprocess.signal.SIGKILL)


def test_stdio_refuses_a_stdin_it_cannot_watch():
    """stdin at /dev/null (or a file) cannot be watched by the event loop: a clear error and exit 2, not a
    handler waiting forever."""
    proc = subprocess.run([sys.executable, ECHO_WORKER], env=child_env(HFENDPOINT_STDIO="1"),
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
    assert proc.returncode == 2
    assert b"stdin, which must be a pipe, a socket or a terminal" in proc.stderr


def serve_one_request(sock: socket.socket) -> list:
    sock.sendall(msgpack.packb({"id": 7, "name": "echo", "data": "over unix"}))
    sock.settimeout(10)
    unpacker = msgpack.Unpacker(raw=False)
    while not (replies := list(unpacker)):
        unpacker.feed(sock.recv(65536))
    sock.shutdown(socket.SHUT_WR)
    return replies


def test_unix_listen_transport_by_argument(tmp_path):
    path = str(tmp_path / "handler.sock")
    proc = subprocess.Popen([sys.executable, ECHO_WORKER, f"unix-listen:{path}"], env=child_env(),
                            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while not os.path.exists(path):
            assert time.monotonic() < deadline and proc.poll() is None, "the handler never listened"
            time.sleep(0.02)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(path)
            assert serve_one_request(sock) == [{"id": 7, "data": "over unix"}]
            assert proc.wait(10) == 0
        assert not os.path.exists(path), "the socket file was left behind"
    finally:
        stop_process(proc, subprocess.signal.SIGKILL)


def test_unix_listen_socket_is_owner_only_whatever_the_umask(tmp_path):
    path = str(tmp_path / "private.sock")
    proc = subprocess.Popen([sys.executable, ECHO_WORKER, f"unix-listen:{path}"], env=child_env(),
                            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=lambda: os.umask(0))
    try:
        deadline = time.monotonic() + 20
        while not os.path.exists(path):
            assert time.monotonic() < deadline and proc.poll() is None, "the handler never listened"
            time.sleep(0.02)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(path)
            assert serve_one_request(sock) == [{"id": 7, "data": "over unix"}]
        assert proc.wait(10) == 0
    finally:
        stop_process(proc, subprocess.signal.SIGKILL)


def test_unix_connect_transport_by_environment(tmp_path):
    path = str(tmp_path / "daemon.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(path)
        server.listen(1)
        server.settimeout(20)
        proc = subprocess.Popen([sys.executable, ECHO_WORKER], env=child_env(HFENDPOINT_UNIX_CONNECT=path),
                                stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            conn, _ = server.accept()
            with conn:
                assert serve_one_request(conn) == [{"id": 7, "data": "over unix"}]
                assert proc.wait(10) == 0
        finally:
            stop_process(proc, subprocess.signal.SIGKILL)


def test_the_package_never_imports_torch():
    code = ("import sys, daemon_protocol, schema, front.server, front.handler_connection; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], env=child_env(), check=True, timeout=60)


def test_no_transport_is_a_clear_error():
    env = child_env()
    for name in ("HFENDPOINT_FD", "HFENDPOINT_STDIO", "HFENDPOINT_UNIX_LISTEN", "HFENDPOINT_UNIX_CONNECT"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, ECHO_WORKER], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "no transport to the daemon: set HFENDPOINT_FD" in proc.stderr
    assert "Traceback" not in proc.stderr
