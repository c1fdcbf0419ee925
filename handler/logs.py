"""What the handler says while it serves: one access line per request when it ends, and an engine line
every few seconds while the engine has work.

Both go to the loggers "handler.access" and "handler.engine", which handler/__main__.py sends to stdout:
the daemon logs every stderr line at ERROR (protocol.md section 1), so stderr is kept for real problems.
"""
import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from daemon_protocol.errors import error_status

ENGINE_LOG_INTERVAL_S = 10.0
CLIENT_GONE_STATUS = 499  # nginx's status for a request whose client went away first

access_log = logging.getLogger("handler.access")
engine_log = logging.getLogger("handler.engine")


class RequestLog:
    """One request's access line, filled in as it runs."""

    def __init__(self, request_id: str, route: str):
        self.request_id, self.route = request_id, route
        self.started = time.perf_counter()
        self.first_token_s: float | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def first_token(self) -> None:
        if self.first_token_s is None:
            self.first_token_s = time.perf_counter() - self.started

    def write(self, status: int) -> None:
        ttft = "-" if self.first_token_s is None else f"{self.first_token_s:.3f}s"
        access_log.info("%s %s status=%d prompt_tokens=%d completion_tokens=%d ttft=%s total=%.3fs",
                        self.request_id, self.route, status, self.prompt_tokens, self.completion_tokens, ttft,
                        time.perf_counter() - self.started)


@contextlib.contextmanager
def logged_request(request_id: str, route: str):
    """Yields the request's RequestLog; its line is written when the block ends, with status 200, the
    status of the error that ended it (as its error reply carries), or 499 when it was cancelled."""
    record = RequestLog(request_id, route)
    status = 200
    try:
        yield record
    except (asyncio.CancelledError, GeneratorExit):
        status = CLIENT_GONE_STATUS
        raise
    except Exception as exc:
        status = error_status(exc) or 500
        raise
    finally:
        record.write(status)


def speculation_summary(engine: dict) -> str:
    """The draft tokens verified and accepted since start, where the engine speculates."""
    drafted = engine.get("spec_drafted_tokens", 0)
    if not drafted:
        return ""
    accepted = engine["spec_accepted_tokens"]
    return f", draft tokens accepted {accepted}/{drafted} ({100 * accepted / drafted:.0f}%)"


async def report_engine(stats: Callable[[], dict], generated_tokens: Callable[[], int],
                        interval: float = ENGINE_LOG_INTERVAL_S) -> None:
    """Every `interval` seconds in which the engine had work: requests running and waiting, KV cache blocks
    in use, the prefix-cache hit rate since start, preemptions, output tokens per second, and the handler's
    resident memory (stats' handler_rss_bytes)."""
    last_tokens, last_time = generated_tokens(), time.perf_counter()
    while True:
        await asyncio.sleep(interval)
        tokens, now = generated_tokens(), time.perf_counter()
        engine = stats()
        if engine["running"] or engine["waiting"] or tokens != last_tokens:
            total = engine["num_total_blocks"]
            used = total - engine["num_free_blocks"]
            rss = engine.get("handler_rss_bytes")
            engine_log.info("running %d, waiting %d, KV cache %d/%d blocks (%.0f%%), prefix-cache hit rate %.0f%%, "
                            "preemptions %d, %.1f output tokens/s, handler RSS %s%s", engine["running"],
                            engine["waiting"], used, total, 100 * used / total if total else 0,
                            100 * engine["prefix_cache_hit_rate"], engine["num_preemptions"],
                            (tokens - last_tokens) / (now - last_time), "-" if rss is None else f"{rss >> 20} MiB",
                            speculation_summary(engine))
        last_tokens, last_time = tokens, now
