"""A small handler process for the protocol and mock-daemon tests (no model, no torch).

Chat (`chat_completions`) picks its behaviour from the request's `model`:
  echo (default)  streams the last message's content back word by word; the last chunk carries
                  finish_reason "stop" and usage (prompt_tokens = characters in, completion = words out)
  slow            a chunk every 20 ms, up to 500 (or max_tokens); its cleanup is recorded as "<last message's content> cancelled"
                  (or "... done" when it ran out)
  cleanups        answers with the recorded cleanups, space separated
  fail            raises ValueError("echo worker was asked to fail")
  stall           sends nothing for an hour (its cleanup is recorded like slow's)
  crash           sends one chunk, then the whole process exits with code 3
`tokenize` maps each character to its code point; `embeddings` returns a 4-float vector per token list.
Protocol-test handlers: count, echo, echo_sync, echo_lambda, fail, slow, paced, cleanups, big, silent_stream,
unencodable. Every recorded cleanup is also written to stderr as "cleanup: <tag>". HFENDPOINT_DRAIN_TIMEOUT sets
the drain timeout after EOF, as it does for the real handler.
"""
import asyncio
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import daemon_protocol  # noqa: E402  (importable without installing the package)

cleanups: list[str] = []


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


@daemon_protocol.handler("chat_completions")
async def chat_completions(data):
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list) or not data["messages"]:
        raise ValueError("'messages' must be a non-empty list")
    model = data.get("model") or "echo"
    last = text_of(data["messages"][-1].get("content"))
    if model == "fail":
        raise ValueError("echo worker was asked to fail")
    if model == "stall":
        try:
            await asyncio.sleep(3600)
        finally:
            record_cleanup(f"{last} cancelled")
    if model == "crash":
        yield {"content": "bye", "finish_reason": None}
        await asyncio.sleep(0.05)
        os._exit(3)
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


@daemon_protocol.handler("tokenize")
async def tokenize(data):
    return {"tokens": [[ord(c) for c in text] for text in data["input"]]}


@daemon_protocol.handler("embeddings")
async def embeddings(data):
    return {"embeddings": [[float(len(t)), float(sum(t) % 1000), float(t[0]), 0.5] for t in data["input"]]}


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
    daemon_protocol.serve(sys.argv[1] if len(sys.argv) > 1 else None,
                          drain_timeout=float(os.environ.get("HFENDPOINT_DRAIN_TIMEOUT", "30")))
