"""The front's settings: its command line over the environment, read once at start and passed down."""
import argparse
import os
from dataclasses import dataclass

from .handler_health import HEALTH_TIMEOUT_S

CHUNK_TIMEOUT_S = 300.0  # the production daemon's limit between two chunks of one request
IDLE_TIMEOUT_S = 75.0    # a connection with no request, or a request body, silent this long is closed
TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class FrontSettings:
    api_key: str | None = None               # --api-key, else HFENDPOINT_API_KEY: all routes but / and /health
    open_metrics: bool = False               # --open-metrics, else HFENDPOINT_OPEN_METRICS: /metrics without the key
    chunk_timeout: float = CHUNK_TIMEOUT_S   # --chunk-timeout
    health_timeout: float = HEALTH_TIMEOUT_S  # --health-timeout
    idle_timeout: float = IDLE_TIMEOUT_S     # --idle-timeout

    @classmethod
    def from_args(cls, args: argparse.Namespace, env=os.environ) -> "FrontSettings":
        """A bad HFENDPOINT_OPEN_METRICS stops the start, naming it."""
        return cls(api_key=args.api_key or env.get("HFENDPOINT_API_KEY") or None,
                   open_metrics=args.open_metrics or env_flag(env, "HFENDPOINT_OPEN_METRICS"),
                   chunk_timeout=args.chunk_timeout, health_timeout=args.health_timeout,
                   idle_timeout=args.idle_timeout)


def env_flag(env, name: str) -> bool:
    """A true/false environment variable (unset: false); another value is refused at start, naming it."""
    raw = env.get(name, "false").strip().lower()
    if raw not in TRUE_WORDS + FALSE_WORDS:
        raise SystemExit(f"{name}={raw!r} is invalid: expected true or false")
    return raw in TRUE_WORDS
