"""The handler's own settings (the engine's are in engine/config.py), read once from the environment at start and
passed down: nothing in the handler reads the environment while serving."""

import ipaddress
import os
from dataclasses import dataclass, field

from engine.config import parse_bool
from handler.limits import RequestLimits


@dataclass(frozen=True)
class HandlerSettings:
    model_name: str | None = None              # HFENDPOINT_MODEL_NAME: the served name (else MODEL_ID's, the model's)
    trust_request_chat_template: bool = False  # HFENDPOINT_TRUST_REQUEST_CHAT_TEMPLATE: run templates sent by clients
    drain_timeout: float = 30.0                # HFENDPOINT_DRAIN_TIMEOUT: seconds in-flight requests get after EOF
    # Images in chat (handler/images.py)
    image_max_bytes: int = 20 * 1024 * 1024     # HFENDPOINT_IMAGE_MAX_BYTES: encoded bytes per image
    image_max_pixels: int = 50_000_000         # HFENDPOINT_IMAGE_MAX_PIXELS: width x height per decoded image
    image_fetch_timeout: float = 10.0          # HFENDPOINT_IMAGE_FETCH_TIMEOUT: seconds per fetched image URL
    max_images_per_request: int = 8            # HFENDPOINT_MAX_IMAGES_PER_REQUEST
    # HFENDPOINT_IMAGE_URL_ALLOWED_NETWORKS: networks beside the public internet that image URLs may reach
    image_url_allowed_networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    auto_truncate: bool = False                # HFENDPOINT_AUTO_TRUNCATE: embed long inputs' last tokens, not refuse
    limits: RequestLimits = field(default_factory=RequestLimits)  # HFENDPOINT_MAX_...: handler/limits.py

    @classmethod
    def from_env(cls, env=os.environ) -> "HandlerSettings":
        """A bad value raises ValueError naming the variable."""
        return cls(model_name=env.get("HFENDPOINT_MODEL_NAME") or None,
                   trust_request_chat_template=_boolean(env, "HFENDPOINT_TRUST_REQUEST_CHAT_TEMPLATE",
                                                        cls.trust_request_chat_template),
                   drain_timeout=_seconds(env, "HFENDPOINT_DRAIN_TIMEOUT", cls.drain_timeout),
                   image_max_bytes=_count(env, "HFENDPOINT_IMAGE_MAX_BYTES", cls.image_max_bytes),
                   image_max_pixels=_count(env, "HFENDPOINT_IMAGE_MAX_PIXELS", cls.image_max_pixels),
                   image_fetch_timeout=_seconds(env, "HFENDPOINT_IMAGE_FETCH_TIMEOUT", cls.image_fetch_timeout),
                   max_images_per_request=_count(env, "HFENDPOINT_MAX_IMAGES_PER_REQUEST", cls.max_images_per_request,
                                                 minimum=0),
                   image_url_allowed_networks=_networks(env, "HFENDPOINT_IMAGE_URL_ALLOWED_NETWORKS"),
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
    return _number(env, name, default, float, lambda value: 0 <= value < float("inf"), "a number of seconds >= 0")


def _count(env, name: str, default: int, minimum: int = 1) -> int:
    return _number(env, name, default, int, lambda value: value >= minimum, f"an integer >= {minimum}")


def _number(env, name: str, default, parse, valid, expected: str):
    raw = env.get(name)
    if raw is None:
        return default
    try:
        value = parse(raw)
    except ValueError:
        value = None
    if value is None or not valid(value):
        raise ValueError(f"{name}={raw!r} is invalid: expected {expected}")
    return value


def _networks(env, name: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """Comma-separated addresses or networks (CIDR, such as 10.0.0.0/8 or ::1/128)."""
    raw = env.get(name, "")
    try:
        return tuple(ipaddress.ip_network(item.strip()) for item in raw.split(",") if item.strip())
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r} is invalid: expected comma-separated networks such as 10.0.0.0/8 "
                         f"({exc})") from None
