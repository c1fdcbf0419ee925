"""The handler's own settings (the engine's are in engine/config.py), read once from the environment at start."""

import os
from dataclasses import dataclass, field

from engine.config import parse_bool
from handler.limits import RequestLimits


@dataclass(frozen=True)
class HandlerSettings:
    trust_request_chat_template: bool = False  # HFENDPOINT_TRUST_REQUEST_CHAT_TEMPLATE: run templates sent by clients
    drain_timeout: float = 30.0                # HFENDPOINT_DRAIN_TIMEOUT: seconds in-flight requests get after EOF
    auto_truncate: bool = False                # HFENDPOINT_AUTO_TRUNCATE: embed long inputs' last tokens, not refuse
    limits: RequestLimits = field(default_factory=RequestLimits)  # HFENDPOINT_MAX_...: handler/limits.py

    @classmethod
    def from_env(cls, env=os.environ) -> "HandlerSettings":
        """A bad value raises ValueError naming the variable."""
        return cls(trust_request_chat_template=_boolean(env, "HFENDPOINT_TRUST_REQUEST_CHAT_TEMPLATE",
                                                        cls.trust_request_chat_template),
                   drain_timeout=_seconds(env, "HFENDPOINT_DRAIN_TIMEOUT", cls.drain_timeout),
                   auto_truncate=_boolean(env, "HFENDPOINT_AUTO_TRUNCATE", cls.auto_truncate),
                   limits=RequestLimits.from_env(env))


def _boolean(env, name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None:
        return default
    try:
        return parse_bool(raw)
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r} is invalid: {exc}") from None


def _seconds(env, name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise ValueError(f"{name}={raw!r} is invalid: expected a number of seconds >= 0")
    return value
