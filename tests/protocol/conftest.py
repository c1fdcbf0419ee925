"""Fixtures for the protocol tests: a handler process on a socketpair, and our front."""
import signal
import socket
import subprocess
import sys

import pytest

from protocol_support import ECHO_WORKER, FrontServer, HandlerClient, child_env, start_front_server, stop_process


@pytest.fixture
def spawn_handler(tmp_path):
    """Start echo_worker.py the way the daemon does (socketpair, HFENDPOINT_FD); kill it afterwards."""
    started = []

    def spawn(**env) -> HandlerClient:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for sock in (parent, child):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        child.set_inheritable(True)
        stderr_path = tmp_path / f"handler{len(started)}.stderr"
        with open(stderr_path, "wb") as stderr:
            proc = subprocess.Popen([sys.executable, ECHO_WORKER],
                                    env=child_env(HFENDPOINT_FD=str(child.fileno()), **env),
                                    pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, stderr=stderr)
        child.close()
        client = HandlerClient(parent, proc, stderr_path)
        started.append(client)
        return client

    yield spawn
    for client in started:
        client.sock.close()
        stop_process(client.proc, signal.SIGKILL)


@pytest.fixture
def handler(spawn_handler) -> HandlerClient:
    return spawn_handler()


@pytest.fixture
def spawn_front_server(tmp_path):
    started = []

    def spawn(**kwargs) -> FrontServer:
        daemon = start_front_server(tmp_path, **kwargs)
        started.append(daemon)
        return daemon

    yield spawn
    for daemon in started:
        stop_process(daemon.proc)


@pytest.fixture(scope="module")
def front_server(tmp_path_factory):
    """One front (api key 'test-key') driving echo_worker.py, shared by a module's tests."""
    daemon = start_front_server(tmp_path_factory.mktemp("front_server"), api_key="test-key")
    yield daemon
    stop_process(daemon.proc)
