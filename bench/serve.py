"""The online benchmark through our front's HTTP API, with aiohttp as the client.

    PYTHONPATH=. python3 bench/serve.py                              # concurrency 1, 16, 64, 256
    PYTHONPATH=. python3 bench/serve.py --request-rate 20 --num-prompts 400
    PYTHONPATH=. python3 bench/serve.py --workload nanovllm --repeat 3   # served against bench/throughput.py
    PYTHONPATH=. python3 bench/serve.py --trace t.json && python3 bench/serve_trace.py t.json   # inside the handler
    PYTHONPATH=. python3 bench/serve.py --trace t.json --trace-stacks ...  # and the engine thread's stacks

Starts `python -m front --port 0 -- python -m handler` on a model's weights (random
Qwen3-0.6B-shaped ones unless --model names another config under bench/models or a model directory), waits for
/health, warms up, then streams chat completions with `ignore_eos`, so that each request generates exactly its
max_tokens:

- latency mode: prompts of --prompt-len random tokens and --output-len output tokens, each prompt fresh (no
  prefix-cache hits), at each --concurrency (requests in flight at once; --num-prompts per level, default
  max(16, 4 x concurrency)) or, with --request-rate, arriving as a Poisson process. Per level: time to first
  token (TTFT, as the client sees it and as the handler's access lines say), time per output token after the
  first (TPOT), the gaps between content chunks, median and p99, and output tokens/s.
- `--workload nanovllm`: bench/throughput.py's workload (256 requests, 133,966 output tokens, temperature 0.6),
  all sent at once after one warm-up request; output tokens/s over the wall time, then bench/throughput.py on the
  same weights with the same token budget per step (the server is stopped first: one engine per GPU), and the
  ratio of the two. With --repeat N both run N times (the served prompts shifted each time, so that none hits
  the prefix cache) and the ratio is of the medians: one run of either varies by several percent on some hosts.
  With `--data-parallel-sizes 1 2` the server is started once per size (HFENDPOINT_DATA_PARALLEL_SIZE: that
  many engines behind the one handler, engine i on the GPUs from i x tensor-parallel size on; on CPU, that
  many engine processes) and the served throughputs are compared with the first size's, instead of offline.

The served copy of the model (in a temporary folder) links its weights and adds a word-level tokenizer: token i is
the word "w<i>" and the chat template is the messages' content, so a prompt of N random token ids travels as N
words and reaches the engine as exactly those N ids, as bench/throughput.py gives them. Speed depends on shapes,
not on which ids. Runs on CPU too (--device cpu, a tiny model, small lengths) as a smoke test.

The client builds every request body and opens its connections (as many as it will have in flight) before the
clock starts, as a client with a connection pool has them: what is timed is the server. After each run of the
workload it prints the CPU time each process took per output token (the client, our front, the handler and each
data-parallel engine process) and its share of one core over the run: a process near 100% is the ceiling.

`--fake-tok-s X` measures the served path's own capacity without a GPU: every engine (the handler's and the
spawned data-parallel ones) runs its scheduler, staging and outputs as it does on a GPU but skips the forward and
the sampling, taking the same token each step, and sleeps instead as long as a device producing X tokens per
second would take for the step's sampled rows (with the GIL released, as a wait on the device releases it). N
engines then produce N x X tokens per second whatever their batch: served throughput below that, with a process
near 100% of a core, is the served path's ceiling. The model is a tiny Qwen3 unless --model names another.
`--fake-host-ms H` adds H ms of Python per step, holding the GIL, as a GPU step's host side (staging, launches,
sampling) does: what it costs the other threads of an engine's process.

    PYTHONPATH=. python3 bench/serve.py --workload nanovllm --fake-tok-s 4000 --data-parallel-sizes 1 2
"""
import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "chat_template.jinja")
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
MAX_PROMPT_ID = 10000  # prompt ids are drawn below this, as the Nano-vLLM workload does
DEFAULT_MAX_BATCHED_TOKENS = 8192  # the handler's default (engine/config.py)
STARTUP_TIMEOUT_S = 1800.0
JSON = {"Content-Type": "application/json"}
FAKE_RATE_ENV = "SERVE_BENCH_FAKE_TOK_S"  # set in the server's environment by --fake-tok-s
FAKE_HOST_ENV = "SERVE_BENCH_FAKE_HOST_MS"  # and by --fake-host-ms
FAKE_TOKEN = 1234  # what a fake step samples (the word "w1234")
TINY = {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 32}  # the fake engines' model: its forward never runs
ENGINE_PID = re.compile(r"data-parallel engine (\d+) ready \(pid (\d+)\)")


# Engines without a device (--fake-step-ms)
def install_fake_engine(tokens_per_s: float, host_s: float = 0.0) -> None:
    """Every ModelRunner of this process skips its forward and sampling: a step runs Python for host_s, sleeps for
    its sampled rows at tokens_per_s and samples FAKE_TOKEN in each."""
    import torch

    from engine.model_runner import ModelRunner

    def execute(self, staged, images=None, prompt_rows=None, rope_positions=None):
        busy_until = time.perf_counter() + host_s
        while time.perf_counter() < busy_until:
            pass
        time.sleep(len(staged.sample_rows) / tokens_per_s)
        return (torch.empty(len(staged.sample_rows), 0) if staged.sample_rows else None), None

    def sample(self, step):
        self.last_sampled = torch.full((len(step.sampling),), FAKE_TOKEN)
        step.ids, step.logprobs, step.ready, step.logits, step.logprob_rows = self.last_sampled, None, None, None, None

    ModelRunner.execute, ModelRunner.sample = execute, sample


def serve_fake_handler() -> int:
    """`python bench/serve.py --fake-handler`: `python -m handler` with fake engines (its spawned engine processes
    run this file as their main module, where the same patch is installed below)."""
    install_fake_engine(float(os.environ[FAKE_RATE_ENV]), float(os.environ.get(FAKE_HOST_ENV, 0)) / 1000)
    from handler.__main__ import main as handler_main
    return handler_main([])


if __name__ == "__mp_main__" and os.environ.get(FAKE_RATE_ENV):  # a process the fake handler spawned
    install_fake_engine(float(os.environ[FAKE_RATE_ENV]), float(os.environ.get(FAKE_HOST_ENV, 0)) / 1000)


# The served model: the weights with a word-level tokenizer
def served_model_dir(model_dir: Path, parent: Path) -> Path:
    """parent/<name>: links to every file of model_dir but its tokenizer, and the word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    served = parent / model_dir.name
    served.mkdir()
    for source in model_dir.iterdir():
        if source.name not in TOKENIZER_FILES:
            (served / source.name).symlink_to(source.resolve())
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(served / "tokenizer.json"))
    (served / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE}))
    return served


def prompt_text(token_ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in token_ids)


# The server
class Server:
    """Our front and the handler; the handler's stdout (its access lines) goes to `access_log`."""

    def __init__(self, model_dir: Path, env: dict[str, str], log_dir: Path):
        self.stderr_path, self.access_log = log_dir / "server.stderr", log_dir / "server.stdout"
        handler = [str(HERE / "serve.py"), "--fake-handler"] if env.get(FAKE_RATE_ENV) else ["-m", "handler"]
        command = [sys.executable, "-m", "front", "--host", "127.0.0.1", "--port", "0", "--", sys.executable, *handler]
        path = [str(ROOT), env.get("PYTHONPATH"), os.environ.get("PYTHONPATH")]
        environment = {**os.environ, **env, "MODEL_ID": str(model_dir), "HFENDPOINT_REPOSITORY_DIR": "/nonexistent",
                       "PYTHONPATH": os.pathsep.join(filter(None, path))}
        with open(self.stderr_path, "wb") as stderr, open(self.access_log, "wb") as stdout:
            self.process = subprocess.Popen(command, env=environment, cwd=ROOT, stdin=subprocess.DEVNULL,
                                            stdout=stdout, stderr=stderr)
        self.url = ""

    def wait_until_listening(self) -> None:
        deadline = time.monotonic() + 60
        while not (found := re.search(r"listening on (http://\S+)", self.stderr_path.read_text())):
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"our front is not listening after 60 s; see {self.stderr_path}")
            time.sleep(0.1)
        self.url = found.group(1)

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            tail = "".join(self.stderr_path.read_text().splitlines(keepends=True)[-20:])
            raise RuntimeError(f"the server exited with code {self.process.returncode}:\n{tail}")

    def handler_ttfts(self, start: int) -> list[float]:
        """The handler's time to first token (from its access lines) of the chat requests logged past byte
        `start` of its stdout."""
        with open(self.access_log, "rb") as log:
            log.seek(start)
            text = log.read().decode(errors="replace")
        return [float(t) for t in re.findall(r" chat_completions status=200 .* ttft=(\d+\.\d+)s ", text)]

    def access_log_size(self) -> int:
        return self.access_log.stat().st_size

    def processes(self) -> dict[str, int]:
        """Our front's, the handler's and each spawned data-parallel engine's pid, by name."""
        found = {"front": self.process.pid}
        try:
            with open(f"/proc/{self.process.pid}/task/{self.process.pid}/children") as f:
                found["handler"] = int(f.read().split()[0])
        except (OSError, IndexError):
            pass
        for index, pid in ENGINE_PID.findall(self.stderr_path.read_text()):
            found[f"engine {index}"] = int(pid)
        return found

    def stop(self) -> None:
        stop_process(self.process)


class CpuMeter:
    """The CPU time of this process (the client) and of the server's processes over a run."""

    def __init__(self, server: Server):
        from protocol import cpu_seconds

        self.pids = {"client": os.getpid(), **server.processes()}
        self.read = cpu_seconds
        self.started = (time.perf_counter(), {name: self.read(pid) for name, pid in self.pids.items()})

    def report(self, output_tokens: int) -> str:
        """Per process: CPU microseconds per output token, and its share of one core over the run."""
        wall = time.perf_counter() - self.started[0]
        cells = []
        for name, pid in self.pids.items():
            before, after = self.started[1][name], self.read(pid)
            if before is not None and after is not None:
                cpu = after - before
                cells.append(f"{name} {1e6 * cpu / output_tokens:.1f} us ({cpu / wall:.0%})")
        return "CPU per output token (share of one core): " + ", ".join(cells)


async def wait_for_health(session: aiohttp.ClientSession, server: Server) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        server.check_alive()
        try:
            async with session.get(f"{server.url}/health") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError(f"/health did not answer 200 within {STARTUP_TIMEOUT_S:.0f} s; see {server.stderr_path}")


# One request
@dataclass
class Result:
    started: float
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.started

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def chat_body(prompt_ids: list[int], max_tokens: int, temperature: float) -> bytes:
    """A streamed chat request as JSON bytes, built before the clock starts: the client must not be what is
    measured."""
    return json.dumps({"messages": [{"role": "user", "content": prompt_text(prompt_ids)}], "max_tokens": max_tokens,
                       "temperature": temperature, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()


async def stream_chat(session: aiohttp.ClientSession, url: str, body: bytes, max_tokens: int) -> Result:
    """One streamed chat completion; the time of every chunk with content and the usage of the last one. SSE
    lines are checked as bytes and only the usage line is parsed."""
    result = Result(time.perf_counter())
    async with session.post(f"{url}/v1/chat/completions", data=body, headers=JSON) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: "):
                if line.startswith(b"event: error"):
                    raise RuntimeError(f"the stream failed: {await response.content.readline()!r}")
                continue
            now = time.perf_counter()
            if b'"content":"' in line and b'"content":""' not in line:
                result.chunk_times.append(now)
            elif b'"usage":{' in line:
                result.output_tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    if result.output_tokens != max_tokens or not result.chunk_times:
        raise RuntimeError(f"asked for {max_tokens} tokens, got {result.output_tokens} in {len(result.chunk_times)} "
                           "chunks")
    return result


# Runs
@dataclass
class Level:
    name: str
    results: list[Result]
    seconds: float
    handler_ttfts: list[float]

    @property
    def output_tokens_per_s(self) -> float:
        return sum(r.output_tokens for r in self.results) / self.seconds


async def run_requests(session, url: str, requests: list[tuple[list[int], int, float]], concurrency: int | None,
                       request_rate: float | None, seed: int) -> tuple[list[Result], float]:
    """Every request, at most `concurrency` in flight, arriving as a Poisson process of `request_rate` per second
    when given (all at once otherwise); (results, wall seconds). The bodies are built and the connections opened
    before the clock starts, as a client with a connection pool has them."""
    limit = asyncio.Semaphore(concurrency or len(requests))
    arrivals = random.Random(seed)
    bodies = [(chat_body(*request), request[1]) for request in requests]
    await open_connections(session, url, min(concurrency or len(requests), len(requests)))

    async def one(body, max_tokens):
        async with limit:
            return await stream_chat(session, url, body, max_tokens)

    started = time.perf_counter()
    tasks = []
    for body, max_tokens in bodies:
        tasks.append(asyncio.create_task(one(body, max_tokens)))
        if request_rate:
            await asyncio.sleep(arrivals.expovariate(request_rate))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - started


async def open_connections(session: aiohttp.ClientSession, url: str, count: int) -> None:
    """`count` keep-alive connections in the session's pool (concurrent requests each open one)."""
    async def probe():
        async with session.get(f"{url}/health") as response:
            await response.read()

    await asyncio.gather(*(probe() for _ in range(count)))


def random_requests(count: int, prompt_len: int, output_len: int, rng: random.Random) -> list:
    return [([rng.randrange(MAX_PROMPT_ID) for _ in range(prompt_len)], output_len, 0.0) for _ in range(count)]


async def latency_levels(server: Server, args) -> list[Level]:
    rng = random.Random(args.seed)
    levels = []
    async with client_session() as session:
        await wait_for_health(session, server)
        await stream_chat(session, server.url, chat_body([1, 2, 3], 8, 0.0), 8)  # warm-up
        runs = [(None, args.request_rate)] if args.request_rate else [(c, None) for c in args.concurrency]
        for concurrency, rate in runs:
            count = args.num_prompts or max(16, 4 * (concurrency or 1))
            requests = random_requests(count, args.prompt_len, args.output_len, rng)
            logged = server.access_log_size()
            results, seconds = await run_requests(session, server.url, requests, concurrency, rate, args.seed)
            name = f"rate {rate:g}/s" if rate else f"concurrency {concurrency}"
            levels.append(Level(name, results, seconds, await logged_ttfts(server, logged, count)))
            print_level(levels[-1])
    return levels


async def logged_ttfts(server: Server, start: int, count: int) -> list[float]:
    """The handler's access lines of the last `count` requests (they are written as each request ends)."""
    deadline = time.monotonic() + 5
    while len(ttfts := server.handler_ttfts(start)) < count and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return ttfts


def client_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=None, sock_read=600))


async def served_workload(server: Server, num_seqs: int, repeat: int, engines: int = 1) -> list[tuple[int, float]]:
    """bench/throughput.py's workload through HTTP, all at once after a warm-up (one request per data-parallel
    engine, sent together: the router gives each to an idle engine), `repeat` times; each time's (output tokens,
    seconds). Repeat r adds r to every prompt id: the same shapes, and no prefix-cache hits on the earlier
    repeats' prompts."""
    from throughput import workload

    prompts, params = workload(num_seqs)
    runs = []
    async with client_session() as session:
        await wait_for_health(session, server)
        await asyncio.gather(*(stream_chat(session, server.url, chat_body([1, 2, 3], 8, 0.0), 8)
                               for _ in range(engines)))
        for r in range(repeat):
            requests = [([(i + r) % MAX_PROMPT_ID for i in prompt], p.max_tokens, p.temperature)
                        for prompt, p in zip(prompts, params)]
            meter = CpuMeter(server)
            results, seconds = await run_requests(session, server.url, requests, None, None, 0)
            runs.append((sum(result.output_tokens for result in results), seconds))
            print(f"served run {r + 1}: {runs[-1][0]:,} output tokens in {seconds:.2f} s = "
                  f"{runs[-1][0] / seconds:,.0f} tok/s\n  {meter.report(runs[-1][0])}", flush=True)
        if engines > 1:
            print(f"engines in /metrics: {await engines_in_metrics(session, server.url)}", flush=True)
    return runs


def offline_throughput(model: str, max_batched_tokens: int, num_seqs: int, repeat: int) -> list[float]:
    """bench/throughput.py on the same weights and token budget per step, `repeat` times in one process; each
    time's tokens/s."""
    command = [sys.executable, str(HERE / "throughput.py"), "--model", model, "--num-seqs", str(num_seqs),
               "--repeat", str(repeat), "--config", f"max_num_batched_tokens={max_batched_tokens}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    output = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    print(output.strip())
    return [float(found.replace(",", "")) for found in re.findall(r"throughput ([\d,]+) tok/s", output)]


# Report
def ms(values: list[float], q: float) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{1000 * ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]:.1f}"


HEADER = (f"{'run':<18} {'reqs':>5} {'TTFT p50':>9} {'p99':>8} {'handler':>8} {'TPOT p50':>9} {'p99':>7} "
          f"{'gap p50':>8} {'p99':>7} {'out tok/s':>10}")


def level_row(level: Level) -> str:
    ttfts = [r.ttft for r in level.results]
    tpots = [t for t in (r.tpot for r in level.results) if t is not None]
    gaps = [g for r in level.results for g in r.gaps]
    return (f"{level.name:<18} {len(level.results):>5} {ms(ttfts, .5):>9} {ms(ttfts, .99):>8} "
            f"{ms(level.handler_ttfts, .5):>8} {ms(tpots, .5):>9} {ms(tpots, .99):>7} {ms(gaps, .5):>8} "
            f"{ms(gaps, .99):>7} {level.output_tokens_per_s:>10,.0f}")


def print_level(level: Level) -> None:
    print(level_row(level), flush=True)


def model_path(name: str, device: str | None, overrides: dict | None = None) -> Path:
    if "/" in name:
        return Path(name).resolve()
    import torch

    from random_model import make_random_model
    return Path(make_random_model(name, device=device or ("cuda" if torch.cuda.is_available() else "cpu"),
                                  overrides=overrides))


def stop_process(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if the process has not exited within a minute."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def serve(model: Path, env: dict[str, str], args, engines: int = 1) -> list:
    """Starts our front and handler on the model (engines: its data-parallel size), runs the latency levels (their
    Levels) or the nanovllm workload (its runs' (output tokens, seconds)), and stops them."""
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as log_dir:
        server = Server(served_model_dir(model, Path(log_dir)), env, Path(log_dir))
        try:
            server.wait_until_listening()
            if args.workload == "latency":
                print(f"{model.name}, prompts {args.prompt_len} tokens, {args.output_len} output tokens; times in ms "
                      "(handler: TTFT in the handler's access lines)")
                print(HEADER, flush=True)
                return asyncio.run(latency_levels(server, args))
            return asyncio.run(served_workload(server, args.num_seqs, args.repeat, engines))
        finally:
            server.stop()


async def engines_in_metrics(session: aiohttp.ClientSession, url: str, wait_s: float = 3.0) -> int:
    """How many data-parallel engines the front's /metrics reports gauges of (waiting up to wait_s for its first
    stats probe)."""
    deadline = time.monotonic() + wait_s
    while True:
        async with session.get(f"{url}/metrics") as response:
            engines = set(re.findall(r'^\w+_engine_\w+\{engine="(\d+)"\}', await response.text(), re.MULTILINE))
        if engines or time.monotonic() > deadline:
            return len(engines)
        await asyncio.sleep(0.25)


def served_tok_s(runs: list[tuple[int, float]]) -> float:
    return statistics.median(tokens / seconds for tokens, seconds in runs)


def compare_data_parallel_sizes(model: Path, env: dict[str, str], args) -> None:
    """The nanovllm workload served at each of args.data_parallel_sizes, one server after the other."""
    throughputs = {}
    for size in args.data_parallel_sizes:
        print(f"data parallel size {size}:", flush=True)
        throughputs[size] = served_tok_s(serve(model, {**env, "HFENDPOINT_DATA_PARALLEL_SIZE": str(size)}, args,
                                               size))
    first = args.data_parallel_sizes[0]
    print(f"\nnanovllm workload served, {model.name}, max_num_batched_tokens {args.max_batched_tokens}, medians of "
          f"{args.repeat}")
    for size, tok_s in throughputs.items():
        print(f"data parallel {size}: {tok_s:,.0f} tok/s, {tok_s / throughputs[first]:.2f}x data parallel {first}")


def main() -> None:
    if sys.argv[1:] == ["--fake-handler"]:
        sys.exit(serve_fake_handler())
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b", help="a config name under bench/models or a model directory")
    parser.add_argument("--workload", choices=("latency", "nanovllm"), default="latency")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--request-rate", type=float, help="requests per second, Poisson arrivals (instead of levels)")
    parser.add_argument("--num-prompts", type=int, help="requests per level (default max(16, 4 x concurrency))")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-seqs", type=int, default=256, help="nanovllm: requests of the workload")
    parser.add_argument("--max-batched-tokens", type=int, default=DEFAULT_MAX_BATCHED_TOKENS,
                        help="the engine's token budget per step, served and offline alike")
    parser.add_argument("--repeat", type=int, default=1, help="nanovllm: runs served (one server) and offline (one "
                                                               "process); the ratio is of their medians")
    parser.add_argument("--offline-tok-s", type=float, nargs="+",
                        help="nanovllm: the offline numbers, instead of running it")
    parser.add_argument("--data-parallel-sizes", type=int, nargs="+",
                        help="nanovllm: serve once per HFENDPOINT_DATA_PARALLEL_SIZE and compare the throughputs with "
                             "the first size's (instead of the offline run)")
    parser.add_argument("--device", help="HFENDPOINT_DEVICE for the handler (default: the handler's choice)")
    parser.add_argument("--fake-tok-s", type=float, help="engines skip the forward and sampling, each producing this "
                                                         "many tokens/s (the served path's capacity, on CPU)")
    parser.add_argument("--fake-host-ms", type=float, default=0.0,
                        help="with --fake-tok-s: Python run per step, holding the GIL (a GPU step's host side)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", metavar="FILE", help="record the handler's trace into FILE (bench/handler_trace; "
                                                        "read it with bench/serve_trace.py)")
    parser.add_argument("--trace-stacks", action="store_true",
                        help="with --trace: also sample the engine thread's stack every millisecond")
    args = parser.parse_args()
    if args.trace_stacks and not args.trace:
        parser.error("--trace-stacks samples into the trace: give --trace FILE too")
    if args.data_parallel_sizes and (args.workload != "nanovllm" or args.offline_tok_s):
        parser.error("--data-parallel-sizes compares served throughputs of the nanovllm workload: give --workload "
                     "nanovllm, without --offline-tok-s")
    sys.path[:0] = [str(HERE), str(ROOT)]  # bench's modules and this checkout's packages
    env = {"HFENDPOINT_MAX_BATCHED_TOKENS": str(args.max_batched_tokens)}
    if args.fake_tok_s is not None:
        if args.trace:
            parser.error("--trace follows `python -m handler`; --fake-tok-s runs this file as the handler")
        args.device = args.device or "cpu"
        env.update({FAKE_RATE_ENV: str(args.fake_tok_s), FAKE_HOST_ENV: str(args.fake_host_ms),
                    "HFENDPOINT_CPU_KV_CACHE_GB": "0.25"})
    model = model_path(args.model, args.device, TINY if args.fake_tok_s is not None else None)
    if args.device:
        env["HFENDPOINT_DEVICE"] = args.device
    if args.trace:
        env.update(HANDLER_TRACE_OUT=str(Path(args.trace).resolve()), PYTHONPATH=str(HERE / "handler_trace"))
        if args.trace_stacks:
            env["HANDLER_TRACE_STACKS"] = "1"
    if args.data_parallel_sizes:
        compare_data_parallel_sizes(model, env, args)
        return
    if args.workload == "latency":
        levels = serve(model, env, args)
        print("\nsummary\n" + HEADER + "\n" + "\n".join(level_row(level) for level in levels))
        return
    served = served_tok_s(serve(model, env, args))
    offline = statistics.median(args.offline_tok_s or
                                offline_throughput(str(model), args.max_batched_tokens, args.num_seqs, args.repeat))
    print(f"\nnanovllm workload, {model.name}, max_num_batched_tokens {args.max_batched_tokens}, medians of "
          f"{args.repeat}\nserved {served:,.0f} tok/s; offline {offline:,.0f} tok/s; "
          f"served/offline {served / offline:.1%}")


if __name__ == "__main__":
    main()
