"""Helpers for the protocol tests: play the daemon against a handler process; start our front."""
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgpack

ROOT = Path(__file__).resolve().parents[2]
ECHO_WORKER = str(ROOT / "tests" / "workers" / "echo_worker.py")
REPLY_TIMEOUT_S = 10.0


def child_env(**extra) -> dict:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def stop_process(proc: subprocess.Popen, sig=signal.SIGTERM, timeout: float = 10.0) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class HandlerClient:
    """Plays the daemon against a handler process: send requests, read replies."""

    def __init__(self, sock: socket.socket, proc: subprocess.Popen, stderr_path: Path) -> None:
        self.sock, self.proc, self._stderr_path = sock, proc, stderr_path
        self.sock.settimeout(REPLY_TIMEOUT_S)
        self.unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)

    def send(self, *messages) -> None:
        self.sock.sendall(b"".join(msgpack.packb(m) for m in messages))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read(self, until) -> list:
        """Replies, in arrival order, until `until(replies)` is true."""
        replies = []
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while not until(replies):
            for reply in self.unpacker:
                replies.append(reply)
                if until(replies):
                    return replies
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out; got {replies[-20:]!r}")
            data = self.sock.recv(1 << 20)
            if not data:
                raise AssertionError(f"handler closed the socket; got {replies[-20:]!r}; stderr: {self.stderr()}")
            self.unpacker.feed(data)
        return replies

    def read_count(self, n: int) -> list:
        return self.read(lambda replies: len(replies) >= n)

    def read_rest(self) -> list:
        """Every reply until the handler closes the socket."""
        replies = []
        while data := self.sock.recv(1 << 20):
            self.unpacker.feed(data)
            replies.extend(self.unpacker)
        return replies

    def close_write(self) -> None:
        self.sock.shutdown(socket.SHUT_WR)

    def wait(self, timeout: float = REPLY_TIMEOUT_S) -> int:
        return self.proc.wait(timeout)

    def stderr(self) -> str:
        return self._stderr_path.read_text()


class FrontServer:
    def __init__(self, proc: subprocess.Popen, log_path: Path) -> None:
        self.proc, self.log_path = proc, log_path
        self.port = 0
        self.base_url = ""

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_for_log(self, pattern: str, timeout: float = REPLY_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout
        while not (match := re.search(pattern, self.log())):
            if time.monotonic() > deadline:
                raise AssertionError(f"{pattern!r} not in our front's log:\n{self.log()}")
            time.sleep(0.02)
        return match.group(0)

    def health(self) -> tuple[int, str]:
        """(status, body) of GET /health."""
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=REPLY_TIMEOUT_S) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    def wait_for_health(self, status: int, timeout: float = REPLY_TIMEOUT_S) -> float:
        """Seconds until /health answers `status`."""
        started = time.monotonic()
        while (answer := self.health())[0] != status:
            assert time.monotonic() - started < timeout, f"/health still answers {answer} after {timeout} s"
            time.sleep(0.05)
        return time.monotonic() - started

    def worker_pid(self) -> int:
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        assert len(children) == 1, children
        return int(children[0])


def start_front_server(tmp_path: Path, api_key: str | None = None, extra=(), env=None, ready=True) -> FrontServer:
    """Start our front on a free port in front of echo_worker.py (with `env` added to its environment);
    its stderr goes to a file. With `ready`, wait until /health says the worker serves."""
    log_path = tmp_path / f"front_{time.monotonic_ns()}.log"
    args = [sys.executable, "-m", "front", "--host", "127.0.0.1", "--port", "0", *extra]
    if api_key:
        args += ["--api-key", api_key]
    args += ["--", sys.executable, ECHO_WORKER]
    env = child_env(**(env or {}))
    env.pop("HFENDPOINT_API_KEY", None)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL, stderr=log, cwd=ROOT)
    daemon = FrontServer(proc, log_path)
    try:
        line = daemon.wait_for_log(r"listening on http://127\.0\.0\.1:(\d+)")
        daemon.port = int(line.rsplit(":", 1)[1])
        daemon.base_url = f"http://127.0.0.1:{daemon.port}"
        if ready:
            daemon.wait_for_health(200)
    except AssertionError:
        stop_process(proc, signal.SIGKILL)
        raise
    return daemon
