"""Our front driven by the openai client and curl, with tests/workers/echo_worker.py behind it."""
import http.client
import json
import logging
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from front.handler_connection import relay_level
from handler.__main__ import LOG_FORMAT as HANDLER_LOG_FORMAT

from protocol_support import ROOT, child_env

pytestmark = pytest.mark.slow  # our front and its workers as processes

KEY = "test-key"


@pytest.fixture(scope="module")
def client(front_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{front_server.base_url}/v1", api_key=KEY, max_retries=0, timeout=20)


def curl(*args: str) -> tuple[int, str]:
    """(HTTP status, body) of one curl call."""
    out = subprocess.run(["curl", "-sS", "-N", "-w", "\n%{http_code}", *args], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    body, _, status = out.rpartition("\n")
    return int(status), body


def post(daemon, path: str, body: str, key: str | None = KEY) -> tuple[int, str]:
    auth = ["-H", f"Authorization: Bearer {key}"] if key else []
    return curl(*auth, "-H", "Content-Type: application/json", "--data-binary", body, f"{daemon.base_url}{path}")


def cleanups(client: openai.OpenAI) -> str:
    reply = client.chat.completions.create(model="cleanups", messages=[{"role": "user", "content": "?"}])
    return reply.choices[0].message.content


def wait_for_cleanup(client: openai.OpenAI, tag: str) -> None:
    deadline = time.monotonic() + 10
    while tag not in cleanups(client):
        assert time.monotonic() < deadline, f"the worker never cleaned up {tag!r}"
        time.sleep(0.02)


def test_health_needs_no_key(front_server):
    assert curl(f"{front_server.base_url}/")[0] == 200
    assert curl(f"{front_server.base_url}/health")[0] == 200


def test_the_model_name_is_the_workers_whatever_the_request_says(client):
    assert [m.id for m in client.models.list().data] == ["echo-model"]
    messages = [{"role": "user", "content": "hi"}]
    assert client.chat.completions.create(model="echo", messages=messages).model == "echo-model"
    assert {c.model for c in client.chat.completions.create(model="echo", messages=messages, stream=True)} == {
        "echo-model"}
    assert client.embeddings.create(model="whatever", input="x").model == "echo-model"
    assert client.responses.create(model="echo", input="x").model == "echo-model"


def test_chat_non_streaming(client):
    result = client.chat.completions.create(model="echo", messages=[{"role": "system", "content": "be brief"},
                                                                    {"role": "user", "content": "hello  there world"}])
    choice = result.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == "hello  there world"
    assert choice.finish_reason == "stop"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (26, 3)


def test_chat_streaming_with_usage(client):
    chunks = list(client.chat.completions.create(
        model="echo", stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": [{"type": "text", "text": "one two three"}]}]))
    content_chunks = [c for c in chunks if c.choices]
    assert content_chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in content_chunks[1:])
    assert "".join(c.choices[0].delta.content for c in content_chunks) == "one two three"
    assert [c.choices[0].finish_reason for c in content_chunks] == [None, None, None, "stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 13 + 3


def test_curl_streams_sse(front_server):
    status, body = post(front_server, "/v1/chat/completions",
                        json.dumps({"model": "echo", "stream": True, "messages": [{"role": "user", "content": "a b"}]}))
    assert status == 200
    events = [e for e in body.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert [c["choices"][0]["delta"].get("content") for c in chunks] == ["a ", "b", ""]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def expected_embedding(tokens: list[int]) -> list[float]:
    vector = [float(len(tokens)), float(sum(tokens) % 1000), float(tokens[0]), 0.5]
    return list(struct.unpack("<4f", struct.pack("<4f", *vector)))


def test_embeddings_strings_go_through_tokenize(client):
    result = client.embeddings.create(model="echo", input=["hello", "hi"])  # the client asks for base64
    assert [d.embedding for d in result.data] == [expected_embedding([ord(c) for c in "hello"]),
                                                 expected_embedding([ord(c) for c in "hi"])]
    assert [d.index for d in result.data] == [0, 1]
    assert result.usage.prompt_tokens == result.usage.total_tokens == 7


def test_embeddings_token_lists_and_float_format(front_server, client):
    result = client.embeddings.create(model="echo", input=[[5, 6, 7], [9]], encoding_format="float")
    assert [d.embedding for d in result.data] == [expected_embedding([5, 6, 7]), expected_embedding([9])]
    assert result.usage.prompt_tokens == 4
    status, body = post(front_server, "/v1/embeddings", json.dumps({"input": [1, 2]}))
    assert status == 200 and json.loads(body)["data"][0]["embedding"] == expected_embedding([1, 2])


def test_responses(client):
    result = client.responses.create(model="echo", input="hello responses")
    assert result.output_text == "hello responses"
    assert result.usage.output_tokens == 2


def test_client_disconnect_mid_stream_cancels_the_worker_request(front_server, client):
    stream = client.chat.completions.create(model="slow", stream=True,
                                            messages=[{"role": "user", "content": "disconnect-1"}])
    received = [next(stream) for _ in range(3)]
    assert [c.choices[0].delta.content for c in received] == ["0 ", "1 ", "2 "]
    stream.close()
    wait_for_cleanup(client, "disconnect-1 cancelled")
    front_server.wait_for_log(r"handler stderr: cleanup: disconnect-1 cancelled")


@pytest.mark.parametrize("body, param", [
    ("{not json", None),
    ("[1, 2]", None),
    ('{"messages": "hi"}', "messages"),
    ('{"messages": [1]}', "messages"),
    ('{"messages": [], "stream": "yes"}', "stream"),
    ('{"messages": [], "stream": true, "stream_options": {"include_usage": "yes"}}', "stream_options"),
    ('{"messages": [], "max_tokens": 1180591620717411303424}', "max_tokens"),  # 2**70: no MessagePack integer
    ('{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),  # a lone surrogate: not Unicode
])
def test_bad_chat_bodies_get_400(front_server, body, param):
    status, text = post(front_server, "/v1/chat/completions", body)
    assert status == 400
    error = json.loads(text)["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


@pytest.mark.parametrize("body", ['{"input": []}', '{"input": ""}', '{"input": ["a", 1]}', '{"input": [[-1]]}',
                                  '{"input": "a", "encoding_format": "int8"}', '{}'])
def test_bad_embeddings_bodies_get_400(front_server, body):
    status, text = post(front_server, "/v1/embeddings", body)
    assert status == 400
    assert json.loads(text)["error"]["param"] in ("input", "encoding_format")


def test_missing_or_wrong_api_key_gets_401(front_server):
    body = json.dumps({"messages": [{"role": "user", "content": "x"}]})
    for key in (None, "wrong"):
        status, text = post(front_server, "/v1/chat/completions", body, key=key)
        assert status == 401
        assert json.loads(text)["error"]["code"] == "invalid_api_key"


def test_a_lone_surrogate_is_named_as_such(front_server):
    status, text = post(front_server, "/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udc00"}]}')
    assert status == 400 and "lone surrogate" in json.loads(text)["error"]["message"]


def test_every_route_but_health_needs_the_key(front_server):
    for path in ("/metrics", "/v1/models", "/v1/no-such-route"):
        assert curl(f"{front_server.base_url}{path}")[0] == 401, path
        assert curl("-H", f"Authorization: Bearer {KEY}", f"{front_server.base_url}/metrics")[0] == 200
    for path in ("/", "/health"):
        assert curl(f"{front_server.base_url}{path}")[0] == 200, path


def test_the_operator_can_open_metrics(spawn_front_server):
    daemon = spawn_front_server(api_key=KEY, extra=["--open-metrics"])
    assert curl(f"{daemon.base_url}/metrics")[0] == 200
    assert curl(f"{daemon.base_url}/v1/models")[0] == 401


def test_an_authorization_header_that_is_not_utf8_gets_401(front_server):
    connection = http.client.HTTPConnection("127.0.0.1", front_server.port, timeout=10)
    connection.putrequest("GET", "/v1/models")
    connection.putheader("Authorization", b"Bearer \xff\xfe" + KEY.encode())
    connection.endheaders()
    response = connection.getresponse()
    assert response.status == 401
    assert json.loads(response.read())["error"]["code"] == "invalid_api_key"


def test_responses_name_max_output_tokens(front_server):
    status, text = post(front_server, "/v1/responses", '{"input": "hi", "max_output_tokens": 0}')
    error = json.loads(text)["error"]
    assert (status, error["param"]) == (400, "max_output_tokens")
    assert "max_output_tokens" in error["message"] and "max_tokens" not in error["message"].replace("max_output", "")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("model, error_class, status, kind, code", [
    ("fail", openai.BadRequestError, 400, "invalid_request_error", None),
    ("error", openai.InternalServerError, 500, "api_error", None),
    ("unavailable", openai.InternalServerError, 503, "api_error", "echo_unavailable"),
])
def test_a_worker_error_reply_gets_its_status(client, stream, model, error_class, status, kind, code):
    """Streaming or not: the worker refuses before the first chunk, so the answer is a plain HTTP error."""
    with pytest.raises(error_class) as raised:
        result = client.chat.completions.create(model=model, stream=stream, messages=[{"role": "user", "content": "x"}])
        list(result) if stream else None
    assert raised.value.status_code == status
    assert (raised.value.type, raised.value.code) == (kind, code)


def test_an_unexpected_error_logs_its_traceback_and_a_refusal_does_not(front_server, client):
    for model in ("fail", "error"):
        with pytest.raises(openai.APIStatusError):
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}])
    front_server.wait_for_log("RuntimeError: echo worker broke")
    assert "ValueError" not in front_server.log()


def test_health_answers_503_until_the_worker_has_loaded(spawn_front_server):
    daemon = spawn_front_server(env={"ECHO_WORKER_START_DELAY_S": "1.5"}, ready=False)
    status, text = daemon.health()
    assert status == 503 and "starting" in text
    assert curl(f"{daemon.base_url}/")[0] == 503
    assert daemon.wait_for_health(200) > 0.5
    assert curl(f"{daemon.base_url}/")[0] == 200


def test_health_answers_503_while_the_worker_is_stopped_and_200_once_it_goes_on(spawn_front_server):
    daemon = spawn_front_server(extra=["--health-timeout", "1"])
    worker = daemon.worker_pid()
    try:
        subprocess.run(["kill", "-STOP", str(worker)], check=True)
        daemon.wait_for_health(503, timeout=5)
        assert "has not answered a health probe" in daemon.health()[1]
    finally:
        subprocess.run(["kill", "-CONT", str(worker)], check=True)
    daemon.wait_for_health(200, timeout=5)


def metric_samples(daemon) -> dict:
    """{(sample name, frozenset of labels): value} of GET /metrics, read by prometheus-client's parser."""
    with urllib.request.urlopen(f"{daemon.base_url}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_metrics_count_requests_and_time_tokens_and_carry_the_engine_stats(spawn_front_server):
    daemon = spawn_front_server()
    client = openai.OpenAI(base_url=f"{daemon.base_url}/v1", api_key="none", max_retries=0, timeout=20)
    for _ in range(3):
        client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "one two three four"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="fail", messages=[{"role": "user", "content": "x"}])
    time.sleep(1.5)  # a stats probe has been answered
    samples = metric_samples(daemon)
    chat = "/v1/chat/completions"
    assert samples[("nanovllm_http_requests_total", frozenset({("route", chat), ("status", "200")}))] == 3
    assert samples[("nanovllm_http_requests_total", frozenset({("route", chat), ("status", "400")}))] == 1
    assert samples[("nanovllm_time_to_first_token_seconds_count", frozenset())] == 3
    assert samples[("nanovllm_time_per_output_token_seconds_count", frozenset())] == 3  # 4 words: 4 tokens
    assert 0 < samples[("nanovllm_time_to_first_token_seconds_sum", frozenset())] < 5
    assert samples[("nanovllm_request_duration_seconds_count", frozenset({("route", chat)}))] == 4
    engine = {name: samples[(f"nanovllm_{name}", frozenset())] for name in (
        "num_requests_running", "num_requests_waiting", "kv_cache_blocks_used", "kv_cache_blocks_total",
        "prefix_cache_hit_rate", "preemptions_total", "worker_ready", "handler_resident_memory_bytes")}
    assert engine == {"num_requests_running": 2, "num_requests_waiting": 1, "kv_cache_blocks_used": 30,
                      "kv_cache_blocks_total": 100, "prefix_cache_hit_rate": 0.25, "preemptions_total": 3,
                      "worker_ready": 1, "handler_resident_memory_bytes": 123 << 20}


def test_a_busy_port_is_a_one_line_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "front", "--port", str(port), "--",
                               sys.executable, "-c", "import time; time.sleep(60)"],
                              capture_output=True, text=True, timeout=30, cwd=ROOT, env=child_env())
    assert proc.returncode == 1 and time.monotonic() - started < 10, "it does not wait for the worker"
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0] and "--port" in lines[0], proc.stderr


def test_body_over_the_limit_gets_413(front_server):
    body = json.dumps({"messages": [{"role": "user", "content": "x" * (33 * 1024 * 1024)}]})
    proc = subprocess.run(["curl", "-sS", "-w", "\n%{http_code}", "-H", f"Authorization: Bearer {KEY}",
                           "--data-binary", "@-", f"{front_server.base_url}/v1/chat/completions"],
                          input=body, capture_output=True, text=True, timeout=30)
    text, _, status = proc.stdout.rpartition("\n")
    assert status == "413"
    assert json.loads(text)["error"]["code"] == "request_too_large"


def test_silent_worker_times_out_and_is_cancelled(spawn_front_server):
    daemon = spawn_front_server(extra=["--chunk-timeout", "0.5"])
    status, text = post(daemon, "/v1/chat/completions", json.dumps({"model": "stall", "messages": [
        {"role": "user", "content": "stalled-1"}]}), key=None)
    assert status == 500 and "sent nothing" in json.loads(text)["error"]["message"]
    daemon.wait_for_log(r"handler stderr: cleanup: stalled-1 cancelled")


def test_handler_death_gets_503_and_stops_the_front(spawn_front_server):
    daemon = spawn_front_server()
    status, text = post(daemon, "/v1/chat/completions", json.dumps({"model": "crash", "messages": [
        {"role": "user", "content": "x"}]}), key=None)
    assert status == 503 and json.loads(text)["error"]["code"] == "handler_unavailable"
    assert daemon.proc.wait(20) == 1
    assert "the handler exited with code 3" in daemon.log()


def test_sigterm_shuts_down_front_and_handler(spawn_front_server):
    daemon = spawn_front_server()
    assert post(daemon, "/v1/embeddings", '{"input": "ok"}', key=None)[0] == 200
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(20) == 0
    assert "shutting down (signal)" in daemon.log()
    assert "Traceback" not in daemon.log()


def test_a_handler_that_cannot_start(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "front", "--port", "0", "--",
                           str(tmp_path / "no-such-worker")], capture_output=True, text=True, timeout=30,
                          cwd=ROOT, env=child_env())
    assert proc.returncode == 1
    assert "cannot start the handler" in proc.stderr


def post_bytes(daemon, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(f"{daemon.base_url}/v1/chat/completions", data=body, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {KEY}", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("body", [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    b'{"messages": "\xff\xfe"}',
    '{"messages": []}'.encode("utf-16")[:-1],
], ids=["nested arrays", "nested objects", "not utf-8", "cut utf-16"])
def test_bodies_json_cannot_parse_get_an_openai_shaped_400(front_server, body):
    status, reply = post_bytes(front_server, body)
    assert status == 400
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    assert reply["error"]["type"] == "invalid_request_error" and reply["error"]["message"].startswith("request body")


@pytest.mark.parametrize("authorization, allowed", [
    (f"Bearer {KEY}", True), (f"bearer {KEY}", True), (f"BEARER  {KEY}", True),
    ("bearer wrong", False), (f"Basic {KEY}", False), (f"Bearer{KEY}", False), (KEY, False),
])
def test_the_bearer_scheme_is_case_insensitive_the_key_is_not(front_server, authorization, allowed):
    status, _ = curl("-H", f"Authorization: {authorization}", f"{front_server.base_url}/v1/models")
    assert status == (200 if allowed else 401)
    assert curl("-H", f"Authorization: bearer {KEY.upper()}", f"{front_server.base_url}/v1/models")[0] == 401


def test_idle_and_half_open_connections_are_closed(spawn_front_server):
    """--idle-timeout: a connection that sends nothing, stops inside a request's head, or sits idle between
    requests is closed; a request body that stops arriving is answered 408."""
    daemon = spawn_front_server(extra=["--idle-timeout", "1"])
    heads = {
        "silent": b"",
        "half a head": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n",
        "idle after a request": b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
        "half a body": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 100\r\n\r\n{\"messages\": ",
    }
    for name, head in heads.items():
        with socket.create_connection(("127.0.0.1", daemon.port), timeout=15) as sock:
            sock.sendall(head)
            received = b""
            while chunk := sock.recv(65536):  # the server closes the connection: recv returns b""
                received += chunk
        if name == "idle after a request":
            assert received.startswith(b"HTTP/1.1 200"), name
        elif name == "half a body":
            assert received.startswith(b"HTTP/1.1 408") and b'"code": "timeout"' in received, received
        else:
            assert received == b"", name


def read_sse_event(response) -> bytes:
    lines = []
    while (line := response.readline()) not in (b"\n", b""):
        lines.append(line)
    return b"".join(lines)


def test_sigterm_lets_the_streams_in_flight_finish(spawn_front_server):
    """SIGTERM: no new connections; the four streams in flight run to their finish_reason and [DONE]; the worker
    (sent EOF) drains and exits 0, then the daemon exits 0."""
    daemon = spawn_front_server()
    streams = []
    for i in range(4):
        connection = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=20)
        connection.request("POST", "/v1/chat/completions", json.dumps({
            "model": "slow", "stream": True, "max_tokens": 40, "messages": [{"role": "user", "content": f"s{i}"}]}),
            headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200
        streams.append((connection, response, [read_sse_event(response)]))
    daemon.proc.send_signal(signal.SIGTERM)
    daemon.wait_for_log("shutting down \\(signal\\)")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", daemon.port), timeout=5)
    for connection, response, events in streams:
        while event := read_sse_event(response):
            events.append(event)
        chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
        assert events[-1] == b"data: [DONE]\n"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == "".join(f"{i} " for i in range(40))
        connection.close()
    assert daemon.proc.wait(20) == 0
    log = daemon.log()
    assert "finishing 4 request(s) in flight" in log and "the worker exited with code" not in log
    assert "Traceback" not in log


@pytest.mark.parametrize("level", [logging.INFO, logging.WARNING, logging.ERROR])
def test_the_handlers_log_lines_are_relayed_at_their_own_level(level):
    """A start-up line is INFO in our front's log, not an error; a line that is not the handler's log format (a
    traceback, a print) stays ERROR."""
    record = logging.LogRecord("engine.startup", level, __file__, 1, "serving at 5.11s", None, None)
    assert relay_level(logging.Formatter(HANDLER_LOG_FORMAT).format(record)) == level
    assert relay_level("Traceback (most recent call last):") == logging.ERROR
