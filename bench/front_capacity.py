"""How many chat chunks per second the served path's front carries without an engine: our front, in front
of this file as a handler (`--serve`: every chat stream yields --tokens one-token chunks, one per event-loop
iteration), and an aiohttp client streaming --streams requests at once. Prints chunks/s over the wall time and,
per process (client, daemon, handler), chunks per CPU-second, which stays meaningful when the processes share
cores. bench/serve.py's served/offline ratio is only the engine's to explain where these are well above it.

    python bench/front_capacity.py [--streams 256] [--tokens 256]
"""
import argparse
import asyncio
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from protocol import cpu_seconds
from serve import client_session


def serve(tokens: int) -> None:
    import daemon_protocol

    @daemon_protocol.handler("models")
    async def models(data):
        return {"id": "front-capacity", "object": "model"}

    @daemon_protocol.handler("chat_completions")
    async def chat(data):
        for _ in range(tokens - 1):
            yield {"content": " w", "finish_reason": None}
            await asyncio.sleep(0)
        yield {"content": " w", "finish_reason": "length",
               "usage": {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1}}

    daemon_protocol.serve()


async def stream(session, url: str) -> int:
    body = {"model": "front-capacity", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    chunks = 0
    async with session.post(url, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        async for line in response.content:
            chunks += line.startswith(b"data: {")
    return chunks


def start_daemon(tokens: int) -> tuple[subprocess.Popen, str]:
    handler = [sys.executable, os.path.abspath(__file__), "--serve", "--tokens", str(tokens)]
    daemon = subprocess.Popen([sys.executable, "-m", "front", "--port", "0", "--", *handler],
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in daemon.stdout:
        if match := re.search(r"http://127\.0\.0\.1:(\d+)", line):
            return daemon, f"http://127.0.0.1:{match.group(1)}"
    raise RuntimeError("our front exited before it listened")


async def measure(url: str, streams: int, pids: dict[str, int]) -> None:
    async with client_session() as session:
        while True:
            async with session.get(f"{url}/health") as response:
                if response.status == 200:
                    break
            await asyncio.sleep(0.2)
        await stream(session, f"{url}/v1/chat/completions")
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        start = time.perf_counter()
        total = sum(await asyncio.gather(*(stream(session, f"{url}/v1/chat/completions") for _ in range(streams))))
        elapsed = time.perf_counter() - start
        after = {name: cpu_seconds(pid) for name, pid in pids.items()}
    print(f"{streams} streams: {total:,} chunks in {elapsed:.2f} s = {total / elapsed:,.0f} chunks/s")
    for name in pids:
        print(f"  {name:8} {total / max(after[name] - before[name], 1e-9):,.0f} chunks per CPU-second")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(args.tokens)
    daemon, url = start_daemon(args.tokens)
    try:
        children = subprocess.run(["pgrep", "-P", str(daemon.pid)], capture_output=True, text=True).stdout.split()
        pids = {"client": os.getpid(), "daemon": daemon.pid, "handler": int(children[0])}
        asyncio.run(measure(url, args.streams, pids))
    finally:
        daemon.terminate()
        daemon.wait()


if __name__ == "__main__":
    main()
