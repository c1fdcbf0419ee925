"""What the handler says and where: `--help` and argument errors before any model loads, timestamped lines,
the access line on stdout (on stderr in stdio mode, where stdout carries the protocol), the engine line
while the engine has work, and the line while weights load."""
import asyncio
import logging
import os
import re
import subprocess
import sys
import threading
import time

import msgpack
import pytest
from model_packages import minilm_dir_or_skip

import handler.__main__ as handler_main
from handler.library_warnings import LibraryWarnings
from handler.logs import report_engine

TIMESTAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"


def run_handler(*args, env=None, timeout=30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "handler", *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})


def test_help_answers_at_once_without_loading_anything():
    started = time.monotonic()
    result = run_handler("--help")
    assert result.returncode == 0 and result.stderr == ""
    assert "usage: python -m handler [-h] [TRANSPORT]" in result.stdout and "MODEL_ID" in result.stdout
    assert time.monotonic() - started < 10
    assert "torch" not in subprocess.run([sys.executable, "-X", "importtime", "-m", "handler", "--help"],
                                         capture_output=True, text=True, timeout=30).stderr


@pytest.mark.parametrize("args, env, problem", [
    (["tcp:80"], {}, "unknown transport 'tcp:80'"),
    (["stdio", "extra"], {}, "unrecognized arguments: extra"),
    ([], {"HFENDPOINT_FD": "three"}, "HFENDPOINT_FD must be a file descriptor number"),
])
def test_argument_errors_come_before_the_model(args, env, problem):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HFENDPOINT_")}
    result = subprocess.run([sys.executable, "-m", "handler", *args], capture_output=True, text=True, timeout=30,
                            stdin=subprocess.DEVNULL, env={**clean, "MODEL_ID": "/no/such/model", **env})
    assert result.returncode == 2
    assert problem in result.stderr and "/no/such/model" not in result.stderr


@pytest.mark.slow  # a handler process
def test_stdio_mode_keeps_stdout_for_the_protocol_and_logs_on_stderr(tmp_path):
    path = minilm_dir_or_skip()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HFENDPOINT_")}
    env.update(MODEL_ID=path, HFENDPOINT_DEVICE="cpu", HF_HUB_OFFLINE="1")
    stderr_path = tmp_path / "stderr"
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "handler", "stdio"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=stderr, env=env)
    try:
        proc.stdin.write(msgpack.packb({"id": 1, "name": "tokenize", "data": {"input": ["hello world"]}}))
        proc.stdin.flush()
        unpacker = msgpack.Unpacker(raw=False)
        replies = []
        while not replies:
            data = os.read(proc.stdout.fileno(), 1 << 16)
            assert data, f"the handler closed stdout: {stderr_path.read_text()}"
            unpacker.feed(data)  # raises on anything that is not MessagePack: no log line on stdout
            replies.extend(unpacker)
        assert replies == [{"id": 1, "data": {"tokens": [[101, 7592, 2088, 102]]}}]
        proc.stdin.close()
        assert proc.wait(60) == 0
        assert proc.stdout.read() == b""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = stderr_path.read_text()
    assert re.search(rf"^{TIMESTAMP} INFO handler: loading ", log, re.MULTILINE), log
    assert re.search(rf"^{TIMESTAMP} INFO handler\.access: tokenize-\d+ tokenize status=200 prompt_tokens=4 "
                     rf"completion_tokens=0 ttft=- total=\d+\.\d+s$", log, re.MULTILINE), log


def test_the_engine_line_comes_while_there_is_work_and_not_when_idle(caplog):
    engine = {"running": 3, "waiting": 1, "num_free_blocks": 60, "num_total_blocks": 80, "prefix_cache_hit_rate": 0.5,
              "num_preemptions": 2, "handler_rss_bytes": 300 << 20}
    tokens = [0]

    async def serve_for_a_while():
        report = asyncio.ensure_future(report_engine(lambda: dict(engine), lambda: tokens[0], interval=0.1))
        await asyncio.sleep(0)  # it has read the token count
        tokens[0] = 50
        await asyncio.sleep(0.15)  # one interval with work
        engine.update(running=0, waiting=0)
        await asyncio.sleep(0.3)  # idle intervals
        report.cancel()

    with caplog.at_level(logging.INFO, logger="handler.engine"):
        asyncio.run(serve_for_a_while())
    lines = [record.message for record in caplog.records if record.name == "handler.engine"]
    assert len(lines) == 1, lines
    assert re.fullmatch(r"running 3, waiting 1, KV cache 20/80 blocks \(25%\), prefix-cache hit rate 50%, "
                        r"preemptions 2, \d+\.\d output tokens/s, handler RSS 300 MiB", lines[0]), lines[0]
    rate = float(lines[0].split(", ")[-2].split()[0])
    assert 50 / 5 < rate <= 50 / 0.1, "50 tokens in one interval of at least 0.1 s"


def test_a_line_every_interval_while_the_weights_load(monkeypatch, caplog):
    monkeypatch.setattr(handler_main, "LOADING_LOG_INTERVAL_S", 0.05)
    done = threading.Event()
    with caplog.at_level(logging.INFO, logger="handler"):
        thread = threading.Thread(target=handler_main.log_loading, args=("tiny", time.perf_counter(), done))
        thread.start()
        time.sleep(0.3)
        done.set()
        thread.join(5)
        count = len(caplog.records)
        time.sleep(0.15)
    assert count >= 2 and all("still loading tiny" in record.message for record in caplog.records)
    assert len(caplog.records) == count, "no line once loaded"


def test_library_warnings_are_logged_once_per_kind_with_a_count():
    """A client can make a library warn at will: the first of each kind passes, then each power of ten, counted."""
    warnings = LibraryWarnings()
    once = warnings.logging_filter(("handler",))
    records = [logging.LogRecord("transformers.tokenization", logging.WARNING, "x", 1, "Token indices %d too long",
                                 (n,), None) for n in range(25)]
    passed = [record.getMessage() for record in records if once.filter(record)]
    assert passed == ["Token indices 0 too long", "Token indices 9 too long (seen 10 times)"]
    ours = logging.LogRecord("handler.access", logging.WARNING, "x", 1, "ours", (), None)
    assert all(once.filter(ours) for _ in range(5)), "our own lines are never held back"
    assert warnings.counts() == {"transformers: Token indices _ too long": 25}
