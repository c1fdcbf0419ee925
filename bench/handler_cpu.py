"""CPU latency and throughput of `python -m handler` serving SmolLM2 behind our front.

    python bench/handler_cpu.py [--max-tokens 128] [--concurrency 16] [--repeats 3]

Starts `python -m front --port 0 -- python -m handler` with the packaged
SmolLM2-135M-Instruct on CPU, warms up, then reports for one stream the time to first token and the
decode rate (tokens after the first / time after the first), medians over --repeats runs, and the total
output tokens/s of --concurrency simultaneous streams. Every stream generates exactly --max-tokens
tokens (ignore_eos, greedy).
"""

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import threading
import time

import openai

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from handler.model_source import packaged_model_path  # noqa: E402


def start_service() -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "MODEL_ID": packaged_model_path(), "HFENDPOINT_DEVICE": "cpu",
           "HFENDPOINT_REPOSITORY_DIR": "/nonexistent"}
    command = [sys.executable, "-m", "front", "--port", "0", "--",
               sys.executable, "-m", "handler"]
    process = subprocess.Popen(command, env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    for line in process.stderr:
        sys.stderr.write(line)
        found = re.search(r"listening on (http://\S+)", line)
        if found:
            threading.Thread(target=sys.stderr.writelines, args=(process.stderr,), daemon=True).start()
            return process, found.group(1) + "/v1"
    raise RuntimeError("our front exited before listening")


async def one_stream(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """(time to first token, seconds from first token to the end, completion tokens)."""
    started = time.perf_counter()
    first = None
    tokens = 0
    response = await client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=max_tokens,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in response:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return first - started, time.perf_counter() - first, tokens


async def bench(url: str, args) -> None:
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=3600) as client:
        await one_stream(client, "Warm up.", 8)  # waits for the model to load, then warms the engine
        singles = [await one_stream(client, f"Tell me a story about the number {i}.", args.max_tokens)
                   for i in range(args.repeats)]
        ttft = statistics.median(s[0] for s in singles)
        rate = statistics.median((s[2] - 1) / s[1] for s in singles)
        print(f"1 stream: time to first token {ttft * 1000:.0f} ms, {rate:.1f} tokens/s after it "
              f"(median of {args.repeats}, {args.max_tokens} tokens each)")
        started = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, f"Tell me a story about the number {i}.", args.max_tokens)
                                         for i in range(args.concurrency)))
        wall = time.perf_counter() - started
        total = sum(r[2] for r in results)
        print(f"{args.concurrency} streams: {total} tokens in {wall:.1f} s = {total / wall:.1f} tokens/s total, "
              f"median time to first token {statistics.median(r[0] for r in results) * 1000:.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    process, url = start_service()
    try:
        asyncio.run(bench(url, args))
    finally:
        process.terminate()
        process.wait(60)


if __name__ == "__main__":
    main()
