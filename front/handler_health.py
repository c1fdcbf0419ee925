"""Is the handler behind our front ready, and still alive? The answer behind /health.

The handler is ready once it has answered its first `models` call (it reads the protocol only after its
model has loaded). From then on a `stats` probe goes out every PROBE_INTERVAL_S, one at a time; a probe left
unanswered longer than the health timeout (a stopped or wedged handler) makes it unhealthy until it answers,
and so does its exit. The last `stats` answer feeds /metrics. Any reply counts as alive, an error reply
too (a handler without a `models` or `stats` handler still answers).
"""
import asyncio
import time

from .handler_connection import HandlerConnection, HandlerError, HandlerGone

PROBE_INTERVAL_S = 1.0
HEALTH_TIMEOUT_S = 5.0


class HandlerHealth:
    def __init__(self, connection: HandlerConnection, timeout: float = HEALTH_TIMEOUT_S) -> None:
        self._connection = connection
        self._timeout = timeout
        self.ready = False
        self.model_name: str | None = None  # the handler's answer to `models`
        self.capabilities: list[str] | None = None  # what it says its model does (chat, completions, ...)
        self.stats: dict = {}               # its last answer to `stats`
        self._probe_sent_at: float | None = None

    async def watch(self) -> None:
        """Probe until the handler is gone (run as a task; cancel it to stop)."""
        try:
            info = await self._probe("models")
            if isinstance(info, dict) and isinstance(info.get("id"), str) and info["id"]:
                self.model_name = info["id"]
            if isinstance(info, dict) and isinstance(info.get("capabilities"), list):
                self.capabilities = [name for name in info["capabilities"] if isinstance(name, str)]
            self.ready = True
            while True:
                await asyncio.sleep(PROBE_INTERVAL_S)
                stats = await self._probe("stats")
                if isinstance(stats, dict):
                    self.stats = stats
        except HandlerGone:
            pass

    async def _probe(self, name: str):
        """The handler's answer (None for an error reply), however long it takes: the age of the probe in
        flight is what problem() judges."""
        self._probe_sent_at = time.monotonic()
        try:
            return await self._connection.call(name, None, timeout=None)
        except HandlerError:
            return None
        finally:
            self._probe_sent_at = None

    def problem(self) -> str | None:
        """Why the handler cannot serve now, or None when it can."""
        if self._connection.gone:
            return "the handler has exited"
        if not self.ready:
            return "the handler is starting (loading its model)"
        if self._probe_sent_at is not None and time.monotonic() - self._probe_sent_at > self._timeout:
            return f"the handler has not answered a health probe for {time.monotonic() - self._probe_sent_at:.0f} s"
        return None
