"""The front's settings: its command line over the environment, read once at start."""
import pytest

from front.server import parse_args
from front.settings import FrontSettings


def settings(argv: list[str], env: dict) -> FrontSettings:
    return FrontSettings.from_args(parse_args([*argv, "--", "python", "-m", "handler"]), env)


def test_the_command_line_wins_over_the_environment():
    env = {"HFENDPOINT_API_KEY": "from-env", "HFENDPOINT_OPEN_METRICS": "true"}
    assert settings([], env) == FrontSettings(api_key="from-env", open_metrics=True)
    assert settings(["--api-key", "from-args", "--chunk-timeout", "7", "--idle-timeout", "3"], {}) == FrontSettings(
        api_key="from-args", chunk_timeout=7.0, idle_timeout=3.0)
    assert settings([], {}) == FrontSettings()


def test_a_bad_flag_stops_the_start_naming_it():
    with pytest.raises(SystemExit, match="HFENDPOINT_OPEN_METRICS='maybe' is invalid"):
        settings([], {"HFENDPOINT_OPEN_METRICS": "maybe"})
