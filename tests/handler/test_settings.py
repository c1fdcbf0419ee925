"""The handler's own settings: read once at start, a bad value a one-line error before any model loads."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from handler.limits import RequestLimits
from handler.settings import HandlerSettings

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_and_values():
    assert HandlerSettings.from_env({}) == HandlerSettings(trust_request_chat_template=False, drain_timeout=30.0)
    env = {"HFENDPOINT_TRUST_REQUEST_CHAT_TEMPLATE": " Yes", "HFENDPOINT_DRAIN_TIMEOUT": "2.5"}
    assert HandlerSettings.from_env(env) == HandlerSettings(trust_request_chat_template=True, drain_timeout=2.5)
    assert HandlerSettings.from_env({"HFENDPOINT_DRAIN_TIMEOUT": "0"}).drain_timeout == 0
    assert HandlerSettings.from_env({"HFENDPOINT_MODEL_NAME": "served"}).model_name == "served"
    assert HandlerSettings.from_env({"HFENDPOINT_MODEL_NAME": ""}).model_name is None


def test_image_limits():
    env = {"HFENDPOINT_IMAGE_MAX_BYTES": "1000", "HFENDPOINT_IMAGE_MAX_PIXELS": "64",
           "HFENDPOINT_IMAGE_FETCH_TIMEOUT": "2", "HFENDPOINT_MAX_IMAGES_PER_REQUEST": "0",
           "HFENDPOINT_IMAGE_URL_ALLOWED_NETWORKS": "10.0.0.0/8, ::1"}
    settings = HandlerSettings.from_env(env)
    assert (settings.image_max_bytes, settings.image_max_pixels, settings.image_fetch_timeout,
            settings.max_images_per_request) == (1000, 64, 2.0, 0)
    assert [str(network) for network in settings.image_url_allowed_networks] == ["10.0.0.0/8", "::1/128"]
    assert HandlerSettings.from_env({}).image_url_allowed_networks == ()


def test_request_limits_and_auto_truncate():
    env = {"HFENDPOINT_MAX_N": "4", "HFENDPOINT_GRAMMAR_COMPILE_TIMEOUT": "2.5", "HFENDPOINT_MAX_STOP_CHARS": "99",
           "HFENDPOINT_AUTO_TRUNCATE": "true"}
    settings = HandlerSettings.from_env(env)
    assert settings.auto_truncate and (settings.limits.max_n, settings.limits.max_stop_chars) == (4, 99)
    assert settings.limits.grammar_compile_timeout == 2.5
    assert HandlerSettings.from_env({}).limits == RequestLimits()


@pytest.mark.parametrize("name, value", [
    ("HFENDPOINT_TRUST_REQUEST_CHAT_TEMPLATE", "maybe"), ("HFENDPOINT_DRAIN_TIMEOUT", "soon"),
    ("HFENDPOINT_DRAIN_TIMEOUT", "-1"), ("HFENDPOINT_DRAIN_TIMEOUT", "inf"), ("HFENDPOINT_DRAIN_TIMEOUT", "nan"),
    ("HFENDPOINT_IMAGE_MAX_BYTES", "0"), ("HFENDPOINT_IMAGE_MAX_PIXELS", "many"),
    ("HFENDPOINT_MAX_IMAGES_PER_REQUEST", "-1"), ("HFENDPOINT_IMAGE_URL_ALLOWED_NETWORKS", "10.0.0.1/8"),
    ("HFENDPOINT_MAX_N", "0"), ("HFENDPOINT_MAX_TOOLS", "many"), ("HFENDPOINT_GRAMMAR_COMPILE_TIMEOUT", "nan"),
    ("HFENDPOINT_AUTO_TRUNCATE", "sometimes"),
])
def test_a_bad_value_names_the_variable(name, value):
    with pytest.raises(ValueError, match=f"^{name}='{value}' is invalid: expected"):
        HandlerSettings.from_env({name: value})


@pytest.mark.slow  # a handler process
def test_the_handler_refuses_a_bad_value_before_loading_a_model():
    proc = subprocess.run([sys.executable, "-m", "handler", "stdio"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, stdin=subprocess.DEVNULL,
                          env={"PATH": "/usr/bin:/bin", "HFENDPOINT_DRAIN_TIMEOUT": "soon", "MODEL_ID": "/nonexistent"})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    expected = r"[\d-]+ [\d:,]+ ERROR handler: HFENDPOINT_DRAIN_TIMEOUT='soon' is invalid: expected a number of seconds"
    assert len(lines) == 1 and re.fullmatch(expected + " >= 0", lines[0]), proc.stderr
