"""A small handler process for the protocol and mock-daemon tests (no model, no torch).

Chat (`chat_completions`) checks its data with the handler's schema (schema/chat.py), then picks its behaviour from
the request's `model`:
  echo (default)  streams the last message's content back word by word; the last chunk carries
                  finish_reason "stop" and usage (prompt_tokens = characters in, completion = words out)
  slow            a chunk every 20 ms, up to 500 (or max_tokens); its cleanup is recorded as
                  "<last message's content> cancelled" (or "... done" when it ran out)
  cleanups        answers with the recorded cleanups, space separated
  fail            raises RequestError("echo worker was asked to fail") (an error reply with status 400)
  value_error     raises ValueError("echo worker has a bug") (status 500: only a RequestError is the client's fault)
  error           raises RuntimeError("echo worker broke") (status 500)
  unavailable     raises RequestError("echo worker is unavailable", status=503, code="echo_unavailable")
  stall           sends nothing for an hour (its cleanup is recorded like slow's)
  crash           sends one chunk, then the whole process exits with code 3
  features        two choices in the extended payloads of docs/chat-extensions.md (FEATURE_CHUNKS)
  request         answers with the request's data as JSON text (what a front made of its client's request)
  stops           echoes the last message's content up to the first of the request's `stop` strings, which ends
                  the reply with finish_reason "stop" and `stop_sequence` naming it ("length" when none occurs)
  tool_call       one call of the named tool_choice's function (else the first tool's) whose arguments are the
                  last message's content, in three deltas (the first with the name); finish_reason "tool_calls"
`tokenize` maps each character to its code point; `embeddings` returns a 4-float vector per token list.
`models` answers {"id": "echo-model"}; `stats` answers fixed engine numbers (ECHO_STATS).
Protocol-test handlers: count, echo, echo_sync, echo_lambda, fail, refuse, teapot, slow, cleanups, big, silent_stream,
unencodable, paced.
Every recorded cleanup is also written to stderr as "cleanup: <tag>". ECHO_WORKER_START_DELAY_S=S waits S seconds
before serving, as a model load would. HFENDPOINT_DRAIN_TIMEOUT sets
the drain timeout after EOF, as it does for the real handler.
"""
import asyncio
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import daemon_protocol  # importable without installing the package
from schema import ChatCompletionRequest, decode

cleanups: list[str] = []
ECHO_STATS = {"running": 2, "waiting": 1, "num_free_blocks": 70, "num_total_blocks": 100,
              "prefix_cache_hit_rate": 0.25, "num_preemptions": 3, "handler_rss_bytes": 123 << 20}


def record_cleanup(tag: str) -> None:
    cleanups.append(tag)
    daemon_protocol.error(f"cleanup: {tag}")


def text_of(content) -> str:
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


async def slow_stream(tag: str, count: int = 500, delay: float = 0.02):
    """Records "<tag> cancelled" when stopped early (cancel, EOF), "<tag> done" when it ran out."""
    outcome = "cancelled"
    try:
        for i in range(count):
            await asyncio.sleep(delay)
            yield i
        outcome = "done"
    finally:
        record_cleanup(f"{tag} {outcome}")


HI_LOGPROBS = {"content": [{"token": "Hi", "logprob": -0.25, "bytes": [72, 105],
                             "top_logprobs": [{"token": "Hi", "logprob": -0.25, "bytes": [72, 105]},
                                              {"token": "Hello", "logprob": -1.5, "bytes": [72, 101, 108, 108, 111]}]}]}
FEATURE_CHUNKS = [
    {"index": 0, "content": "", "reasoning_content": "The user wants the weather.", "finish_reason": None},
    {"index": 1, "content": "Hi", "logprobs": HI_LOGPROBS, "finish_reason": None},
    {"index": 0, "content": "", "finish_reason": None, "tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "weather", "arguments": ""}}]},
    {"index": 0, "content": "", "finish_reason": None, "tool_calls": [
        {"index": 0, "function": {"arguments": '{"city": '}}]},
    {"index": 0, "content": "", "finish_reason": None, "choice_finish_reason": "tool_calls", "tool_calls": [
        {"index": 0, "function": {"arguments": '"Paris"}'}}]},
    {"index": 1, "content": "!", "finish_reason": "length",
     "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}},
]


@daemon_protocol.handler("chat_completions")
async def chat_completions(data):
    decode(data, ChatCompletionRequest)
    model = data.get("model") or "echo"
    last = text_of(data["messages"][-1].get("content"))
    if model == "fail":
        raise daemon_protocol.RequestError("echo worker was asked to fail")
    if model == "value_error":
        raise ValueError("echo worker has a bug")
    if model == "error":
        raise RuntimeError("echo worker broke")
    if model == "unavailable":
        raise daemon_protocol.RequestError("echo worker is unavailable", status=503, code="echo_unavailable")
    if model == "stall":
        try:
            await asyncio.sleep(3600)
        finally:
            record_cleanup(f"{last} cancelled")
    if model == "crash":
        yield {"content": "bye", "finish_reason": None}
        await asyncio.sleep(0.05)
        os._exit(3)
    if model == "features":
        for chunk in FEATURE_CHUNKS:
            yield chunk
        return
    if model in ("request", "stops", "tool_call"):
        for chunk in REPLIES[model](data, last):
            yield chunk
        return
    if model == "slow":
        async for i in slow_stream(last, data.get("max_tokens") or 500):
            yield {"content": f"{i} ", "finish_reason": None}
        yield {"content": "", "finish_reason": "length"}
        return
    words = [" ".join(cleanups)] if model == "cleanups" else re.findall(r"\S+\s*", last)
    for word in words:
        yield {"content": word, "finish_reason": None}
    prompt = sum(len(text_of(m.get("content"))) for m in data["messages"])
    yield {"content": "", "finish_reason": "stop",
           "usage": {"prompt_tokens": prompt, "completion_tokens": len(words), "total_tokens": prompt + len(words)}}


def request_reply(data, last):
    text = json.dumps(data)
    yield {"content": text, "finish_reason": "stop",
           "usage": {"prompt_tokens": len(last), "completion_tokens": 1, "total_tokens": len(last) + 1}}


def stops_reply(data, last):
    found = [(last.find(stop), stop) for stop in data.get("stop") or () if stop in last]
    at, stop = min(found) if found else (len(last), None)
    yield {"content": last[:at], "finish_reason": None}
    yield {"content": "", "finish_reason": "stop" if stop else "length", **({"stop_sequence": stop} if stop else {}),
           "usage": {"prompt_tokens": len(last), "completion_tokens": at, "total_tokens": len(last) + at}}


def tool_call_reply(data, last):
    choice = data.get("tool_choice")
    name = choice["function"]["name"] if isinstance(choice, dict) else data["tools"][0]["function"]["name"]
    third = len(last) // 3
    yield {"content": "", "finish_reason": None, "tool_calls": [
        {"index": 0, "id": "call_echo", "type": "function", "function": {"name": name, "arguments": last[:third]}}]}
    yield {"content": "", "finish_reason": None, "tool_calls": [
        {"index": 0, "function": {"arguments": last[third:2 * third]}}]}
    yield {"content": "", "finish_reason": "tool_calls", "tool_calls": [
        {"index": 0, "function": {"arguments": last[2 * third:]}}],
        "usage": {"prompt_tokens": len(last), "completion_tokens": 3, "total_tokens": len(last) + 3}}


REPLIES = {"request": request_reply, "stops": stops_reply, "tool_call": tool_call_reply}


@daemon_protocol.handler("tokenize")
async def tokenize(data):
    return {"tokens": [[ord(c) for c in text] for text in data["input"]]}


@daemon_protocol.handler("embeddings")
async def embeddings(data):
    return {"embeddings": [[float(len(t)), float(sum(t) % 1000), float(t[0]), 0.5] for t in data["input"]]}


@daemon_protocol.handler("models")
async def models(data):
    return {"id": "echo-model"}


@daemon_protocol.handler("stats")
async def stats(data):
    return ECHO_STATS


@daemon_protocol.handler("count")
async def count(data):
    """Yields 0..n-1, going through the event loop between chunks so that streams interleave."""
    for i in range(data["n"]):
        yield i
        await asyncio.sleep(0)


@daemon_protocol.handler("echo")
async def echo(data):
    return data


@daemon_protocol.handler("echo_sync")
def echo_sync(data):
    return data


@daemon_protocol.handler("echo_lambda")
def echo_lambda(data):
    """A plain function returning a coroutine: served like a coroutine handler."""
    return echo(data)


@daemon_protocol.handler("fail")
async def fail(data):
    raise RuntimeError(f"failing as asked: {data}")


@daemon_protocol.handler("refuse")
async def refuse(data):
    """RequestError(**data): the message, param, status and code the test chose."""
    raise daemon_protocol.RequestError(**data)


class Teapot(Exception):
    status = 418


@daemon_protocol.handler("teapot")
async def teapot(data):
    """An exception that is no ReplyError but has an int `status` attribute: a 500 all the same. data: the status
    it carries."""
    error = Teapot("short and stout")
    error.status = data
    raise error


@daemon_protocol.handler("reply_error")
async def reply_error(data):
    """A ReplyError with the status data asks for."""
    raise daemon_protocol.ReplyError("short and stout", data)


@daemon_protocol.handler("slow")
async def slow(data):
    async for i in slow_stream(str(data)):
        yield i


@daemon_protocol.handler("paced")
async def paced(data):
    """{"tag", "n"}: n chunks, one every 20 ms."""
    async for i in slow_stream(data["tag"], data["n"]):
        yield i


@daemon_protocol.handler("cleanups")
def list_cleanups(data):
    return cleanups


@daemon_protocol.handler("big")
def big(data):
    return b"\xab" * data


@daemon_protocol.handler("silent_stream")
async def silent_stream(data):
    return
    yield


@daemon_protocol.handler("unencodable")
async def unencodable(data):
    yield 1
    yield object()


if __name__ == "__main__":
    time.sleep(float(os.environ.get("ECHO_WORKER_START_DELAY_S", "0")))
    daemon_protocol.serve(sys.argv[1] if len(sys.argv) > 1 else None,
                          drain_timeout=float(os.environ.get("HFENDPOINT_DRAIN_TIMEOUT", "30")))
