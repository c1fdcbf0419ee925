"""A bounded hardening campaign against `python -m handler` serving SmolLM2 on CPU, with a small KV pool.

    python bench/campaign.py [--kv-blocks 48] [--streams 90] [--soak 600]
                             [--phases http,attack,soak,frames,storm,hostage,faults]

Phases:
- http: bad HTTP inputs through our front (wrong types, NaN, huge numbers, deep nesting, bad encodings,
  bad roles, missing fields, bad keys, stalled and idle connections), then a normal request;
- frames: bad MessagePack frames straight to a handler on a socketpair (non-requests, bad ids and names, bad
  data, a duplicate id), each followed by a probe; then corrupt streams (garbage, lengths over the limit),
  each on a fresh handler with a stream in flight: its error reply and exit code 1 are expected;
- storm: --streams concurrent streams with a third of the clients disconnecting mid-stream, and greedy probes
  whose text must equal their answers when alone;
- hostage: a looping template and a 21 MB prompt beside a normal request (refused, and with templates trusted,
  the normal request still answered);
- attack: issue 41's hostile inputs on every field and route (huge stop strings, schemas nothing satisfies or
  that compile for minutes, deep tool-call arguments, logit_bias junk, huge n/top_logprobs/tools, a 5 MB
  embeddings text, auth on /metrics), each a 4xx naming its field, with the handler's RSS before and after;
  then four slow compiles and a long embeddings call beside a chat, whose time to first token must stay short;
- soak: --soak streams over several minutes, at most 24 at once, a third disconnecting mid-stream, mixed with
  structured outputs and n > 1, ending with every KV block free and the RSS growth stated;
- faults: SIGSTOP/SIGCONT of the handler mid-stream, SIGTERM to our front mid-stream (every stream ends
  with its finish_reason and [DONE], both processes exit 0), SIGKILL of the handler mid-stream.

A failure is a 5xx for a client's mistake that is not a request error reply (issue 21 turns those into 400s:
they are counted apart), a hang, a crash, or a stream that does not end as it should. After the http, storm and
faults phases the handler's `stats` must show every KV block free again. Prints a table at the end.
"""

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import aiohttp
import msgpack
from aiohttp import web

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from front.handler_connection import HandlerConnection  # noqa: E402
from front.server import make_app  # noqa: E402
from front.settings import FrontSettings  # noqa: E402
from handler.model_source import packaged_model_path  # noqa: E402

KEY = "campaign-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
HANG_S = 120.0  # a request not answered in this long counts as a hang
HANDLER = [sys.executable, "-m", "handler"]
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
INTERNAL = re.compile(r"^[A-Z]\w*(Error|Exception)\b")  # a handler bug's reply names the exception type
CLAIM = 300 * 1024 * 1024


@dataclass
class Tally:
    phase: str
    cases: int = 0
    failures: list[str] = field(default_factory=list)
    issue21: list[str] = field(default_factory=list)  # 500s carrying a request error: issue 21 answers 400
    accepted: list[str] = field(default_factory=list)  # bad inputs answered 200
    notes: list[str] = field(default_factory=list)
    leaked: int | None = None
    rss_growth: int = 0  # the largest growth of the handler's RSS over one case, bytes

    def fail(self, case: str, why: str) -> None:
        self.failures.append(f"{case}: {why}")


def handler_env(kv_blocks: int, **extra) -> dict:
    return {**os.environ, "MODEL_ID": packaged_model_path(), "HFENDPOINT_DEVICE": "cpu",
            "HFENDPOINT_NUM_KV_BLOCKS": str(kv_blocks), "HFENDPOINT_REPOSITORY_DIR": "/nonexistent",
            "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT, "HFENDPOINT_MAX_EMBEDDING_BATCH_TOKENS": "512", **extra}


class Service:
    """Our front's app and worker connection in this process (so `stats` can be asked over the same
    connection), with `python -m handler` as its worker."""

    async def start(self, env: dict, idle_timeout: float = 3.0) -> "Service":
        saved = dict(os.environ)
        os.environ.update(env)  # the worker inherits os.environ
        try:
            self.connection = HandlerConnection(HANDLER)
            await self.connection.start()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        app = make_app(self.connection, FrontSettings(api_key=KEY, chunk_timeout=120.0, idle_timeout=idle_timeout))
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None, keepalive_timeout=idle_timeout)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{self.port}"
        await self.call("models", timeout=600)  # answered once the model is loaded
        self.total_blocks = (await self.stats())["num_total_blocks"]
        return self

    async def call(self, name: str, data=None, timeout: float = 60):
        return await self.connection.call(name, data, timeout)

    async def stats(self) -> dict:
        return await self.call("stats")

    async def rss(self) -> int:
        return (await self.stats()).get("handler_rss_bytes") or 0

    async def leaked_blocks(self, wait_s: float = 60) -> int:
        """Blocks still held once nothing runs (waits up to wait_s for aborts to land)."""
        deadline = time.monotonic() + wait_s
        while True:
            stats = await self.stats()
            if stats["num_free_blocks"] == stats["num_total_blocks"] and not stats["running"] + stats["waiting"]:
                return 0
            if time.monotonic() > deadline:
                return stats["num_total_blocks"] - stats["num_free_blocks"]
            await asyncio.sleep(0.1)

    async def stop(self) -> int:
        code = await self.connection.stop()
        await self.runner.cleanup()
        return code


async def post(session: aiohttp.ClientSession, url: str, body, headers=None, method="POST") -> tuple[int, str]:
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    async with asyncio.timeout(HANG_S):
        async with session.request(method, url, data=data, headers={"Content-Type": "application/json",
                                                                     **AUTH, **(headers or {})}) as response:
            return response.status, await response.text()


def classify(tally: Tally, case: str, expect_ok: bool, status: int, text: str) -> None:
    tally.cases += 1
    if expect_ok:
        if status != 200:
            tally.fail(case, f"expected 200, got {status}: {text[:120]}")
        return
    if status == 200:
        tally.accepted.append(case)
        return
    try:
        error = json.loads(text)["error"]
        shaped = {"message", "type", "param", "code"} <= set(error)
    except (ValueError, KeyError, TypeError):
        if status >= 500:
            tally.fail(case, f"{status} that is not OpenAI-shaped JSON: {text[:120]!r}")
        else:
            tally.notes.append(f"{case}: a plain {status} from aiohttp's HTTP parser: {text[:60]!r}")
        return
    if not shaped:
        tally.fail(case, f"{status} error without message/type/param/code: {text[:120]}")
    elif status >= 500 and INTERNAL.match(error["message"]):
        tally.fail(case, f"{status} from a handler bug: {error['message'][:160]}")
    elif status >= 500:
        tally.issue21.append(f"{case}: {error['message'][:90]}")


def chat(**fields) -> dict:
    return {"model": "smollm2", "messages": CAPITAL, "max_tokens": 4, "temperature": 0, **fields}


def bad_http_inputs() -> list[tuple[str, str, object, dict]]:
    """(case, path, body, extra headers) of requests a server must refuse (4xx)."""
    chats = {
        "not json": b"{not json", "empty body": b"", "null": b"null", "a list": b"[1, 2]", "a number": b"1",
        "a string": b'"hi"', "nested arrays 100k": b"[" * 100_000 + b"]" * 100_000,
        "nested objects 100k": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
        "nested 600 in content": b'{"messages": [{"content": ' + b"[" * 600 + b"]" * 600 + b"}]}",
        "invalid utf-8": b'{"messages": [{"content": "\xff\xfe"}]}',
        "cut utf-16": '{"messages": []}'.encode("utf-16")[:-1],
        "lone surrogate": b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        "NaN temperature": b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        "Infinity top_p": b'{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}',
        "1e999 max_tokens": b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e999}',
        "messages missing": {"model": "smollm2"}, "messages null": {"messages": None},
        "messages a string": {"messages": "hi"}, "messages a number": {"messages": 5},
        "messages an object": {"messages": {"role": "user"}}, "messages empty": {"messages": []},
        "message a number": {"messages": [1]}, "message null": {"messages": [None]},
        "content a number": {"messages": [{"role": "user", "content": 5}]},
        "content an object": {"messages": [{"role": "user", "content": {"text": "hi"}}]},
        "content image part": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "content part text a number": {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        "role a number": {"messages": [{"role": 5, "content": "hi"}]},
        "role wizard": {"messages": [{"role": "wizard", "content": "hi"}]},
        "role empty list": {"messages": [{"role": [], "content": "hi"}]},
    }
    sampling = {
        "temperature": ["hot", -1, -0.5, [1]], "top_p": [0, 1.5, -1, "x"],
        "top_k": [1.5, "5", 10**30], "min_p": [-0.1, 2, "x"], "presence_penalty": [3, -3, "a"],
        "frequency_penalty": [2.5, {}], "repetition_penalty": [0, 3, -1], "seed": [-1, 2**64, "s", 1.5],
        "max_tokens": [0, -1, 10**9, "10", 10**30, True, 1.5], "max_completion_tokens": [0, "x"],
        "n": [0, 2, "1"], "stop": [1, [1], [""], ["x"] * 17, {"a": 1}], "stream": ["yes", 1],
        "stream_options": ["x"], "ignore_eos": ["yes", 1], "chat_template_kwargs": ["x", {"tokenize": True},
                                                                                     {"chat_template": "{{ 1 }}"}],
        "chat_template": ["{{ 1 }}", 5], "add_generation_prompt": ["x"],
    }
    short = {"max_tokens": 4, "temperature": 0}  # a body the server wrongly accepts still answers quickly
    cases = [(f"chat: {name}", "/v1/chat/completions", body if isinstance(body, bytes) else {**short, **body}, {})
             for name, body in chats.items()]
    cases += [(f"chat: {key}={value!r:.30}", "/v1/chat/completions", chat(**{key: value}), {})
              for key, values in sampling.items() for value in values]
    cases += [(f"embeddings: {name}", "/v1/embeddings", body, {}) for name, body in {
        "input missing": {}, "input empty list": {"input": []}, "input empty string": {"input": ""},
        "input mixed": {"input": [1, "a"]}, "negative id": {"input": [[-1]]}, "id over 32 bits": {"input": [[2**40]]},
        "id out of vocabulary": {"input": [[10**9]]}, "float ids": {"input": [[1.5]]},
        "over the context": {"input": [[1] * 5000]}, "encoding int8": {"input": "a", "encoding_format": "int8"},
        "input an object": {"input": {"a": 1}}, "empty inner list": {"input": [[]]},
    }.items()]
    cases += [(f"responses: {name}", "/v1/responses", body, {}) for name, body in {
        "input missing": {}, "input a number": {"input": 5}, "input empty": {"input": ""},
        "stream": {"input": "hi", "stream": True}, "instructions a number": {"input": "hi", "instructions": 5},
        "max_output_tokens 0": {"input": "hi", "max_output_tokens": 0},
        "temperature a string": {"input": "hi", "temperature": "x"},
    }.items()]
    cases += [(f"auth: {name}", "/v1/models", None, {"Authorization": value}) for name, value in {
        "none": "", "wrong key": "Bearer wrong", "basic": f"Basic {KEY}", "empty bearer": "Bearer ",
        "key in lower case": f"Bearer {KEY.upper()}", "no scheme": KEY, "10 KB header": "Bearer " + "k" * 10_000,
        "non-ascii key": "Bearer clé",
    }.items()]
    return cases


async def raw_exchange(port: int, data: bytes) -> bytes:
    """What the server sends on a connection that sends `data` and then nothing, until it closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    received = b""
    async with asyncio.timeout(HANG_S):
        while chunk := await reader.read(65536):
            received += chunk
    writer.close()
    return received


async def phase_http(service: Service) -> Tally:
    tally = Tally("http")
    async with aiohttp.ClientSession() as session:
        for case, path, body, headers in bad_http_inputs():
            method = "GET" if path == "/v1/models" else "POST"
            try:
                status, text = await post(session, service.url + path, body, headers, method)
            except TimeoutError:
                tally.cases += 1
                tally.fail(case, f"hang (engine then: {await service.stats()})")
                continue
            classify(tally, case, False, status, text)
            if status == 400 and isinstance(body, dict) and json.loads(text)["error"].get("param") is None:
                tally.notes.append(f"{case}: a 400 without param: {json.loads(text)['error']['message'][:80]}")
        for case, path, method in (("GET on a POST route", "/v1/chat/completions", "GET"),
                                   ("unknown route", "/v1/nope", "POST"), ("PUT /", "/", "PUT")):
            status, text = await post(session, service.url + path, b"{}", None, method)
            tally.cases += 1
            if status >= 500 or status == 200:
                tally.fail(case, f"got {status}")
        for temperature in (1e-40, 1e-7):  # valid, and must be greedy
            for extra in ({}, {"top_k": 5}, {"top_p": 0.9, "min_p": 0.1}):
                _, greedy = await post(session, service.url + "/v1/chat/completions", chat(max_tokens=12))
                status, text = await post(session, service.url + "/v1/chat/completions",
                                          chat(max_tokens=12, temperature=temperature, **extra))
                tally.cases += 1
                same = status == 200 and json.loads(text)["choices"][0]["message"] == json.loads(greedy)[
                    "choices"][0]["message"]
                if not same:
                    tally.fail(f"temperature {temperature} {extra}", f"not the greedy text: {text[:120]}")
        slow_cases = {
            "silent connection": b"", "half a head": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n",
            "stalled body": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                            + b"\r\nContent-Length: 100\r\n\r\n{",
        }
        for case, data in slow_cases.items():
            tally.cases += 1
            try:
                received = await raw_exchange(service.port, data)
            except TimeoutError:
                tally.fail(case, "the connection was never closed")
                continue
            if case == "stalled body" and not received.startswith(b"HTTP/1.1 408"):
                tally.fail(case, f"expected 408, got {received[:60]!r}")
        status, _ = await post(session, service.url + "/v1/chat/completions", chat())
        if status != 200:
            tally.fail("a normal request after the phase", f"got {status}")
    tally.leaked = await service.leaked_blocks()
    return tally


class DirectHandler:
    """A handler process on a socketpair, played by this script as the daemon."""

    def __init__(self, env: dict) -> None:
        self.sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        child.set_inheritable(True)
        self.proc = subprocess.Popen(HANDLER, env={**env, "HFENDPOINT_FD": str(child.fileno())}, cwd=ROOT,
                                     pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        child.close()
        self.unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
        self.replies: list = []

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read_until(self, done, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not done(self.replies):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(1 << 20)
            except TimeoutError:
                return False
            if not data:
                return done(self.replies)
            self.unpacker.feed(data)
            self.replies.extend(self.unpacker)
        return True

    def answered(self, request_id: int, timeout: float = HANG_S) -> dict | None:
        ok = self.read_until(lambda replies: any(r.get("id") == request_id for r in replies), timeout)
        return next((r for r in self.replies if r.get("id") == request_id), None) if ok else None

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def bad_frames() -> list[tuple[str, bytes, bool]]:
    """(case, bytes, whether the request gets a reply: a usable id) of frames a handler must survive."""
    def request(request_id, name, data=None, **extra):
        return msgpack.packb({"id": request_id, "name": name, "data": data, **extra})

    hi = {"messages": CAPITAL, "max_tokens": 2}
    frames = [("a list", msgpack.packb([1, 2]), False), ("a string", msgpack.packb("text"), False),
              ("a number", msgpack.packb(5), False), ("nil", msgpack.packb(None), False),
              ("bytes", msgpack.packb(b"\x00\x01"), False), ("an ext", msgpack.packb(msgpack.ExtType(5, b"x")), False),
              ("no id", msgpack.packb({"name": "stats"}), False), ("negative id", request(-1, "stats"), False),
              ("string id", request("7", "stats"), False), ("float id", request(1.5, "stats"), False),
              ("bool id", request(True, "stats"), False), ("int keys", msgpack.packb({1: 2, 3: 4}), False)]
    replied = [("name a number", request(101, 5)), ("name nil", request(102, None)),
               ("unknown name", request(103, "nope")), ("largest id", request(2**64 - 1, "stats")),
               ("data nil", request(104, "chat_completions")), ("data a number", request(105, "chat_completions", 5)),
               ("data a list", request(106, "chat_completions", [])),
               ("messages bytes", request(107, "chat_completions", {"messages": [{"content": b"\xff"}]})),
               ("max_tokens 2**64-1", request(108, "chat_completions", {**hi, "max_tokens": 2**64 - 1})),
               ("NaN temperature", request(109, "chat_completions", {**hi, "temperature": float("nan")})),
               ("tokenize bytes", request(110, "tokenize", {"input": [b"x"]})),
               ("tokenize nil", request(111, "tokenize")),
               ("embeddings on a decoder", request(112, "embeddings", {"input": [[1, 2]]})),
               ("data 400 deep", request(113, "chat_completions", {"messages": [{"content": [[[[[]]]]]}]})),
               ("20 MB prompt", request(114, "chat_completions", {"messages": [{"content": "x" * 20_000_000}]})),
               ("map keys not strings", request(115, "chat_completions", {1: 2})),
               ("cancel of an unknown id", request(116, "cancel"))]
    return frames + [(case, data, case != "cancel of an unknown id") for case, data in replied]


def phase_frames(kv_blocks: int) -> Tally:
    tally = Tally("frames")
    handler = DirectHandler(handler_env(kv_blocks))
    probe_ids = iter(range(1000, 2000))
    try:
        handler.send(msgpack.packb({"id": 999, "name": "models"}))
        if handler.answered(999, 600) is None:
            tally.fail("start", "the handler never answered")
            return tally
        for case, data, expects_reply in bad_frames():
            tally.cases += 1
            started = time.monotonic()
            handler.send(data)
            request_id = msgpack.unpackb(data, strict_map_key=False).get("id") if expects_reply else None
            if expects_reply and handler.answered(request_id) is None:
                tally.fail(case, "no reply (hang)")
            probe = next(probe_ids)
            handler.send(msgpack.packb({"id": probe, "name": "tokenize", "data": {"input": ["still here?"]}}))
            if handler.answered(probe) is None:
                tally.fail(case, "the handler stopped answering")
                return tally
            if case == "20 MB prompt":
                tally.notes.append(f"20 MB prompt over the protocol refused in {time.monotonic() - started:.1f} s")
        tally.cases += 1  # a duplicate id: an error reply for it, and nothing after it
        handler.send(msgpack.packb({"id": 500, "name": "chat_completions",
                                    "data": {"messages": CAPITAL, "max_tokens": 200, "ignore_eos": True}}))
        handler.answered(500)
        handler.send(msgpack.packb({"id": 500, "name": "stats"}))
        if not handler.read_until(lambda replies: any(r.get("id") == 500 and "error" in r for r in replies), 30):
            tally.fail("duplicate id", "no error reply")
        time.sleep(1)  # the cancelled request's abort reaches the engine
        probe = next(probe_ids)
        handler.send(msgpack.packb({"id": probe, "name": "stats"}))
        stats = (handler.answered(probe) or {}).get("data", {})
        if "error" not in [r for r in handler.replies if r.get("id") == 500][-1] or stats.get("running"):
            tally.fail("duplicate id", f"chunks after the error reply, or still running: {stats}")
    finally:
        handler.close()
    if handler.proc.returncode != 0:
        tally.fail("EOF", f"the handler exited {handler.proc.returncode}")
    for case, data in {"garbage": b"\xc1\xc1garbage", "str32 over the limit": b"\xdb" + struct.pack(">I", CLAIM),
                       "bin32 over the limit": b"\xc6" + struct.pack(">I", CLAIM),
                       "array32 over the limit": b"\xdd" + struct.pack(">I", CLAIM)}.items():
        tally.cases += 1
        handler = DirectHandler(handler_env(kv_blocks))
        try:
            handler.send(msgpack.packb({"id": 1, "name": "chat_completions",
                                        "data": {"messages": CAPITAL, "max_tokens": 400, "ignore_eos": True}}))
            if handler.answered(1, 600) is None:
                tally.fail(case, "the stream never started")
                continue
            started = time.monotonic()
            handler.send(data)
            failed = handler.read_until(lambda replies: any("error" in r for r in replies), 30)
            code = handler.proc.wait(30)
            if not failed or code != 1:
                tally.fail(case, f"error reply {failed}, exit code {code}")
            tally.notes.append(f"{case}: error reply and exit {code} in {time.monotonic() - started:.1f} s")
        except subprocess.TimeoutExpired:
            tally.fail(case, "the handler did not exit")
        finally:
            handler.close()
    return tally


async def read_stream(session, url: str, body: dict, disconnect_after: int | None = None) -> dict:
    """One SSE chat stream: its text, last finish_reason, whether [DONE] came; or stops reading after
    `disconnect_after` chunks and closes the connection."""
    text, finish_reason, done, chunks = [], None, False, 0
    async with asyncio.timeout(HANG_S):
        async with session.post(url + "/v1/chat/completions", json={**body, "stream": True}, headers=AUTH) as response:
            if response.status != 200:
                return {"status": response.status, "error": await response.text()}
            async for line in response.content:
                if line == b"data: [DONE]\n":
                    done = True
                elif line.startswith(b"data: "):
                    event = json.loads(line[6:])
                    if "choices" not in event:
                        return {"status": 200, "error": event}
                    choice = event["choices"][0]
                    text.append(choice["delta"].get("content") or "")
                    finish_reason = choice["finish_reason"] or finish_reason
                    chunks += 1
                    if disconnect_after is not None and chunks >= disconnect_after:
                        response.close()
                        return {"status": 200, "disconnected": True}
    return {"status": 200, "text": "".join(text), "finish_reason": finish_reason, "done": done}


async def phase_storm(service: Service, streams: int) -> Tally:
    tally = Tally("storm")
    rng = random.Random(0)
    probes = ["Name three colors.", "What is 2 + 2?", "Say hello in Spanish.", "What is the capital of France?"]
    async with aiohttp.ClientSession() as session:
        alone = {p: (await read_stream(session, service.url, {"messages": [{"role": "user", "content": p}],
                                                              "max_tokens": 24, "temperature": 0}))["text"]
                 for p in probes}
        before = (await service.stats())["num_preemptions"]
        jobs = []
        for i in range(streams):
            if i % 10 == 0:
                prompt, body = probes[i // 10 % len(probes)], {"temperature": 0, "max_tokens": 24}
            else:
                prompt = f"Tell me a story about the number {i}."
                body = {"max_tokens": rng.randint(16, 48), "ignore_eos": True, "temperature": 0.8, "seed": i}
            body["messages"] = [{"role": "user", "content": prompt}]
            disconnect = rng.randint(1, 6) if i % 3 == 2 else None
            jobs.append((i, prompt, body, disconnect))
        results = await asyncio.gather(*(read_stream(session, service.url, body, disconnect)
                                         for _, _, body, disconnect in jobs), return_exceptions=True)
    for (i, prompt, body, disconnect), result in zip(jobs, results):
        tally.cases += 1
        if isinstance(result, BaseException):
            tally.fail(f"stream {i}", "hang" if isinstance(result, TimeoutError) else repr(result))
        elif "error" in result:
            tally.fail(f"stream {i}", f"{result['status']}: {str(result['error'])[:120]}")
        elif disconnect is None and not (result["done"] and result["finish_reason"] in ("stop", "length")):
            tally.fail(f"stream {i}", f"ended without finish_reason and [DONE]: {result}")
        elif disconnect is None and body.get("temperature") == 0 and result["text"] != alone[prompt]:
            tally.fail(f"stream {i}", "greedy text differs under load")
    stats = await service.stats()
    tally.notes.append(f"{streams} streams, {sum(d is not None for *_, d in jobs)} disconnecting, "
                       f"{stats['num_preemptions'] - before} preemptions")
    tally.leaked = await service.leaked_blocks()
    return tally


def attack_inputs() -> list[tuple[str, str, object, str | None]]:
    """(case, path, body, the param its 400 must name) of issue 41's hostile inputs."""
    deep_arguments = "[" * 100_000 + "]" * 100_000
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep_arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]

    def schema(value):
        return {"type": "json_schema", "json_schema": {"name": "s", "schema": value}}

    nan_bias = (b'{"model": "smollm2", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], '
                b'"logit_bias": {"5": NaN}}')
    cases = [
        ("stop 30,000 characters", chat(stop=["z" * 30_000]), "stop"),
        ("stop 16 x 100,000 characters", chat(stop=["z" * 100_000] * 16), "stop"),
        ("stop 10,000 strings", chat(stop=["z"] * 10_000), "stop"),
        ("schema $ref #", chat(response_format=schema({"$ref": "#"})), "response_format"),
        ("schema $ref cycle", chat(response_format=schema({"$defs": {"a": {"$ref": "#/$defs/b"},
                                                                     "b": {"$ref": "#/$defs/a"}},
                                                           "$ref": "#/$defs/a"})), "response_format"),
        ("schema unclosed pattern", chat(response_format=schema({"type": "string", "pattern": "(a"})),
         "response_format"),
        ("schema nonsense type", chat(response_format=schema({"type": "strin"})), "response_format"),
        ("schema properties a list", chat(response_format=schema({"type": "object", "properties": [1]})),
         "response_format"),
        ("schema enum of 40,000", chat(response_format=schema({"enum": [f"v{i}" for i in range(40_000)]})),
         "response_format"),
        ("schema enum of 20,000 (under the size cap)",
         chat(response_format=schema({"enum": [f"u{i}" for i in range(20_000)]})), "response_format"),
        ("schema 5 MB", chat(response_format=schema({"enum": ["x" * 1000] * 5000})), "response_format"),
        ("schema 3,000 allOf", chat(response_format=schema({"type": "object", "properties": {
            f"p{i}": {"allOf": [{"type": "string"}, {"maxLength": 5}]} for i in range(3000)}})), None),
        ("tool schema $ref #", chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
            "$ref": "#"}}}], tool_choice={"type": "function", "function": {"name": "f"}}), "tools"),
        ("tool-call arguments nested 100,000 deep", chat(messages=history), "messages"),
        ("metadata nested 500 deep", chat(metadata={"a": json.loads("[" * 500 + "]" * 500)}), "metadata"),
        ("logit_bias key x", chat(logit_bias={"x": 1}), "logit_bias"),
        ("logit_bias key of 5,000 digits", chat(logit_bias={"1" * 5000: 1}), "logit_bias"),
        ("logit_bias NaN", nan_bias, "logit_bias"),
        ("logit_bias 200,000 entries", chat(logit_bias={str(i % 40_000): 1 for i in range(200_000)}),
         "logit_bias"),
        ("n 10,000", chat(n=10_000), "n"),
        ("top_logprobs 1,000", chat(logprobs=True, top_logprobs=1000), "top_logprobs"),
        ("1,000 tools", chat(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(1000)],
                             tool_choice="required"), "tools"),
        ("lone surrogate", b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 4}', "messages"),
        ("responses max_output_tokens 0", {"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ("embeddings text of 5 MB", {"input": "word " * 1_000_000}, "input"),
    ]
    return [(case, "/v1/responses" if case.startswith("responses") else "/v1/embeddings"
             if case.startswith("embeddings") else "/v1/chat/completions", body, param) for case, body, param in cases]


async def phase_attack(service: Service) -> Tally:
    tally = Tally("attack")
    async with aiohttp.ClientSession() as session:
        for case, path, body, param in attack_inputs():
            before = await service.rss()
            started = time.monotonic()
            try:
                status, text = await post(session, service.url + path, body)
            except TimeoutError:
                tally.cases += 1
                tally.fail(case, "hang")
                continue
            growth = await service.rss() - before
            tally.rss_growth = max(tally.rss_growth, growth)
            classify(tally, case, False, status, text)
            named = json.loads(text)["error"].get("param") if status >= 400 else None
            if param is not None and status < 500 and named != param:
                tally.fail(case, f"{status} names param {named!r}, not {param!r}: {text[:120]}")
            tally.notes.append(f"{case}: {status} in {time.monotonic() - started:.1f} s, RSS {growth / 2**20:+.0f} MiB")
        for case, headers in (("metrics without the key", {"Authorization": ""}),):
            status, _ = await post(session, service.url + "/metrics", None, headers, "GET")
            tally.cases += 1
            if status != 401:
                tally.fail(case, f"expected 401, got {status}")
        tally.cases += 1
        received = await raw_exchange(service.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                                                    b"Authorization: Bearer \xff\xfe\r\n\r\n")
        if not received.startswith(b"HTTP/1.1 401"):
            tally.fail("non-UTF-8 Authorization header", f"expected 401, got {received[:40]!r}")
        await starved_chat(service, session, tally)
    tally.leaked = await service.leaked_blocks()
    return tally


async def starved_chat(service: Service, session, tally: Tally) -> None:
    """Four compiles that would run for minutes and a long embeddings call, beside a chat: the chat's first
    token must come within 15 s, the compiles must be refused within their budget."""
    slow = chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "enum": [f"w{i}" for i in range(20_000)]}}})  # under the size cap; compiles far longer than the budget
    long_embedding = {"input": [[1] * 500] * 12}
    _, baseline = await timed(read_stream(session, service.url, chat(max_tokens=8), disconnect_after=1))
    hostile = [asyncio.ensure_future(post(session, service.url + "/v1/chat/completions", slow)) for _ in range(4)]
    hostile.append(asyncio.ensure_future(post(session, service.url + "/v1/embeddings", long_embedding)))
    await asyncio.sleep(0.5)
    (_, first_token_s) = await timed(read_stream(session, service.url, chat(max_tokens=8), disconnect_after=1))
    results = await asyncio.gather(*hostile, return_exceptions=True)
    tally.cases += 1
    if first_token_s > 15:
        tally.fail("chat beside slow compiles and embeddings", f"first token after {first_token_s:.1f} s")
    tally.notes.append(f"chat first token beside 4 slow compiles and a 12-batch embeddings call: "
                       f"{first_token_s:.2f} s (alone {baseline:.2f} s); their statuses "
                       f"{[r[0] if isinstance(r, tuple) else repr(r) for r in results]}")


async def phase_soak(service: Service, total: int) -> Tally:
    """total streams, at most 24 at once, a third of the clients going away mid-stream; some constrained to
    JSON, some with n > 1."""
    tally = Tally("soak")
    rng = random.Random(41)
    gate = asyncio.Semaphore(24)
    rss_before = await service.rss()
    started = time.monotonic()

    async def one(i: int):
        body = {"messages": [{"role": "user", "content": f"Tell me about the number {i}."}],
                "max_tokens": rng.randint(8, 24), "temperature": 0.8, "seed": i}
        if i % 5 == 1:
            body["response_format"] = {"type": "json_object"}
        if i % 7 == 2:
            body["n"] = 3
        disconnect = rng.randint(1, 4) if i % 3 == 2 else None
        async with gate:
            return body, disconnect, await read_stream(session, service.url, body, disconnect)

    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*(one(i) for i in range(total)), return_exceptions=True)
    for i, result in enumerate(results):
        tally.cases += 1
        if isinstance(result, BaseException):
            tally.fail(f"stream {i}", "hang" if isinstance(result, TimeoutError) else repr(result))
            continue
        body, disconnect, outcome = result
        if "error" in outcome:
            tally.fail(f"stream {i}", f"{outcome['status']}: {str(outcome['error'])[:120]}")
        elif disconnect is None and not (outcome["done"] and outcome["finish_reason"] in ("stop", "length")):
            tally.fail(f"stream {i}", f"ended without finish_reason and [DONE]: {outcome}")
    tally.leaked = await service.leaked_blocks()
    growth = await service.rss() - rss_before
    tally.notes.append(f"{total} streams in {time.monotonic() - started:.0f} s, {total // 3} disconnecting, "
                       f"{sum(i % 5 == 1 for i in range(total))} JSON-constrained, "
                       f"{sum(i % 7 == 2 for i in range(total))} with n = 3; handler RSS {rss_before / 2**20:.0f} "
                       f"-> {(rss_before + growth) / 2**20:.0f} MiB ({growth / 2**20:+.0f} MiB)")
    return tally


async def timed(coroutine) -> tuple[object, float]:
    started = time.monotonic()
    result = await coroutine
    return result, time.monotonic() - started


async def phase_hostage(service: Service, kv_blocks: int) -> Tally:
    tally = Tally("hostage")
    looping = "{% for i in range(20000) %}{% for j in range(5000) %}{% endfor %}{% endfor %}{{ messages[0].content }}"
    normal = chat(max_tokens=8)
    async with aiohttp.ClientSession() as session:
        url = service.url + "/v1/chat/completions"
        _, alone = await timed(post(session, url, normal))
        attacks = {"looping template": chat(chat_template_kwargs={"chat_template": looping}),
                   "21 MB prompt": chat(messages=[{"role": "user", "content": "x" * 21_000_000}])}
        for case, attack in attacks.items():
            tally.cases += 1
            (attacked, attack_s), (answered, normal_s) = await asyncio.gather(timed(post(session, url, attack)),
                                                                             timed(post(session, url, normal)))
            if attacked[0] == 200 or answered[0] != 200:
                tally.fail(case, f"attack answered {attacked[0]}, normal request {answered[0]}")
            if attacked[0] >= 500:
                tally.issue21.append(f"{case}: {json.loads(attacked[1])['error']['message'][:90]}")
            tally.notes.append(f"{case}: refused in {attack_s:.2f} s; a normal request beside it {normal_s:.2f} s "
                               f"(alone {alone:.2f} s)")
    trusting = await Service().start(handler_env(kv_blocks, HFENDPOINT_TRUST_REQUEST_CHAT_TEMPLATE="true"))
    try:
        async with aiohttp.ClientSession() as session:
            url = trusting.url + "/v1/chat/completions"
            tally.cases += 1
            attack = asyncio.ensure_future(timed(post(session, url,
                                                      chat(chat_template_kwargs={"chat_template": looping}))))
            await asyncio.sleep(0.5)
            (answered, normal_s) = await timed(post(session, url, normal))
            (attacked, attack_s) = await attack
            if answered[0] != 200 or normal_s > attack_s:
                tally.fail("trusted looping template", f"normal request {answered[0]} in {normal_s:.1f} s, "
                                                       f"after the template's {attack_s:.1f} s")
            tally.notes.append(f"trusted looping template rendered in {attack_s:.1f} s; a normal request sent "
                               f"0.5 s after it answered in {normal_s:.2f} s")
    finally:
        await trusting.stop()
    return tally


def ended_well(result) -> bool:
    """A stream read to its end: finish_reason "length" (every fault stream ignores EOS) and [DONE]."""
    return isinstance(result, dict) and result.get("done") is True and result.get("finish_reason") == "length"


def start_daemon(kv_blocks: int) -> tuple[subprocess.Popen, int, list]:
    command = [sys.executable, "-m", "front", "--port", "0", "--api-key", KEY, "--",
               *HANDLER]
    process = subprocess.Popen(command, env=handler_env(kv_blocks), cwd=ROOT, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    log = []
    for line in process.stderr:
        log.append(line)
        if found := re.search(r"listening on http://127\.0\.0\.1:(\d+)", line):
            threading.Thread(target=lambda: log.extend(process.stderr), daemon=True).start()
            return process, int(found.group(1)), log
    raise RuntimeError("our front exited before listening:\n" + "".join(log))


def handler_pid(daemon: subprocess.Popen) -> int:
    children = subprocess.run(["pgrep", "-P", str(daemon.pid)], capture_output=True, text=True,
                              check=True).stdout.split()
    return int(children[0])


async def phase_faults(service: Service, kv_blocks: int) -> Tally:
    tally = Tally("faults")
    long_stream = {"messages": CAPITAL, "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    async with aiohttp.ClientSession() as session:
        # SIGSTOP / SIGCONT of the handler while 8 streams run
        tally.cases += 1
        streams = [asyncio.ensure_future(read_stream(session, service.url, long_stream)) for _ in range(8)]
        await asyncio.sleep(2)
        pid = service.connection.process.pid
        os.kill(pid, signal.SIGSTOP)
        await asyncio.sleep(3)
        os.kill(pid, signal.SIGCONT)
        results = await asyncio.gather(*streams, return_exceptions=True)
        if sum(map(ended_well, results)) != 8:
            tally.fail("SIGSTOP/SIGCONT", f"{8 - sum(map(ended_well, results))} of 8 streams did not end: {results}")
    tally.leaked = await service.leaked_blocks()
    for fault in ("SIGTERM to the daemon", "SIGKILL to the handler"):
        tally.cases += 1
        daemon, port, log = start_daemon(kv_blocks)
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as session:
                await post(session, url + "/v1/chat/completions", chat(), None)  # once the model is loaded
                streams = [asyncio.ensure_future(read_stream(session, url, long_stream)) for _ in range(8)]
                await asyncio.sleep(3)
                started = time.monotonic()
                if fault == "SIGTERM to the daemon":
                    daemon.send_signal(signal.SIGTERM)
                else:
                    os.kill(handler_pid(daemon), signal.SIGKILL)
                results = await asyncio.gather(*streams, return_exceptions=True)
            code = await asyncio.to_thread(daemon.wait, 90)
            elapsed = time.monotonic() - started
            ended = sum(ended_well(r) for r in results)
            errors = sum(isinstance(r, dict) and "error" in r for r in results)
            if fault == "SIGTERM to the daemon":
                worker_code = re.search(r"the worker exited with code (\d+)", "".join(log))
                if ended != 8 or code != 0 or worker_code:
                    tally.fail(fault, f"{ended} of 8 streams ended; daemon exit {code}; {worker_code}")
                tally.notes.append(f"{fault}: {ended} of 8 streams ended with finish_reason and [DONE]; "
                                   f"daemon exit {code} {elapsed:.1f} s after the signal")
            else:
                if ended + errors != 8 or code != 1:
                    tally.fail(fault, f"{ended} ended, {errors} errors of 8; daemon exit {code}")
                tally.notes.append(f"{fault}: {errors} of 8 streams got an error event, {ended} had ended; "
                                   f"daemon exit {code} {elapsed:.1f} s after the kill")
        except (TimeoutError, subprocess.TimeoutExpired):
            tally.fail(fault, "hang")
        finally:
            if daemon.poll() is None:
                os.killpg(daemon.pid, signal.SIGKILL)
                daemon.wait()
    return tally


def report(tallies: list[Tally], total_blocks: int, started: float) -> None:
    print("\nphase     cases  failures  500s (issue 21)  accepted  KV blocks leaked  largest RSS growth of one case")
    for t in tallies:
        leaked = "-" if t.leaked is None else f"{t.leaked} of {total_blocks}"
        print(f"{t.phase:<9} {t.cases:>5}  {len(t.failures):>8}  {len(t.issue21):>15}  {len(t.accepted):>8}  "
              f"{leaked:>16}  {t.rss_growth / 2**20:+.0f} MiB")
    print(f"total     {sum(t.cases for t in tallies):>5}  {sum(len(t.failures) for t in tallies):>8}  "
          f"{sum(len(t.issue21) for t in tallies):>15}  {sum(len(t.accepted) for t in tallies):>8}  "
          f"({time.monotonic() - started:.0f} s)")
    for t in tallies:
        for title, items in (("failures", t.failures), ("500s that issue 21 turns into 400s", t.issue21),
                             ("bad inputs answered 200", t.accepted), ("notes", t.notes)):
            if items:
                print(f"\n{t.phase}, {title}:")
                print("\n".join(f"  {item}" for item in items))


async def campaign(args) -> None:
    started = time.monotonic()
    phases = args.phases.split(",")
    tallies = []
    service = await Service().start(handler_env(args.kv_blocks))
    try:
        if "http" in phases:
            tallies.append(await phase_http(service))
        if "attack" in phases:
            tallies.append(await phase_attack(service))
        if "soak" in phases:
            tallies.append(await phase_soak(service, args.soak))
        if "storm" in phases:
            tallies.append(await phase_storm(service, args.streams))
        if "hostage" in phases:
            tallies.append(await phase_hostage(service, args.kv_blocks))
        if "faults" in phases:
            tallies.append(await phase_faults(service, args.kv_blocks))
        if "frames" in phases:
            tallies.append(await asyncio.to_thread(phase_frames, args.kv_blocks))
    finally:
        code = await service.stop()
        if code:
            tallies.append(Tally("shutdown", 1, [f"the handler exited {code} on EOF"]))
    report(tallies, service.total_blocks, started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-blocks", type=int, default=48, help="HFENDPOINT_NUM_KV_BLOCKS (16 tokens each)")
    parser.add_argument("--streams", type=int, default=90, help="concurrent streams in the storm")
    parser.add_argument("--soak", type=int, default=600, help="streams in the soak")
    parser.add_argument("--phases", default="http,attack,soak,storm,hostage,faults,frames")
    asyncio.run(campaign(parser.parse_args()))


if __name__ == "__main__":
    main()
