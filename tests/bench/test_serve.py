"""bench/serve.py runs end to end on CPU with a tiny model, and its premise holds: a prompt of random token ids
sent as words through the chat API reaches the engine as exactly those ids."""
import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer, Qwen3Config

from random_decoders import save_random_decoder

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import serve  # noqa: E402  (bench/ is not a package)
import serve_trace  # noqa: E402

TINY = dict(vocab_size=10240, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=2048)


def tiny_model(path: Path) -> Path:
    save_random_decoder(Qwen3Config(**TINY), path)
    return path


def test_the_served_copy_turns_random_ids_into_words_and_back(tmp_path):
    (tmp_path / "served").mkdir()
    served = serve.served_model_dir(tiny_model(tmp_path / "tiny"), tmp_path / "served")
    tokenizer = AutoTokenizer.from_pretrained(served)
    ids = [0, 5, 10239, 77, 77, 9999]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": serve.prompt_text(ids)}], tokenize=False,
                                           add_generation_prompt=True)
    assert tokenizer(prompt, add_special_tokens=False)["input_ids"] == ids
    assert (served / "model.safetensors").resolve() == (tmp_path / "tiny" / "model.safetensors").resolve()


@pytest.mark.slow  # our front and a handler process
def test_it_measures_each_level_through_our_front_on_cpu(tmp_path):
    model = tiny_model(tmp_path / "tiny")
    command = [sys.executable, str(ROOT / "bench" / "serve.py"), "--model", str(model), "--device", "cpu",
               "--prompt-len", "32", "--output-len", "8", "--concurrency", "1", "3", "--num-prompts", "6"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = result.stdout.split("summary\n", 1)[1].splitlines()
    assert summary[0].split()[:3] == ["run", "reqs", "TTFT"]
    for row, concurrency in zip(summary[1:], (1, 3)):
        cells = row.split()
        assert cells[:3] == ["concurrency", str(concurrency), "6"]
        assert all(float(cell.replace(",", "")) > 0 for cell in cells[3:]), row


@pytest.mark.slow  # our front, a handler process and bench/throughput.py
def test_the_nanovllm_workload_is_repeated_served_and_offline(tmp_path):
    model = tiny_model(tmp_path / "tiny")
    command = [sys.executable, str(ROOT / "bench" / "serve.py"), "--model", str(model), "--device", "cpu",
               "--workload", "nanovllm", "--num-seqs", "3", "--repeat", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    served = re.findall(r"served run \d: ([\d,]+) output tokens", result.stdout)
    offline = re.findall(r"output tokens (\d+) .* throughput ([\d,]+) tok/s", result.stdout)
    assert len(served) == len(offline) == 2 and {int(s.replace(",", "")) for s in served} == {int(offline[0][0])}
    assert re.search(r"medians of 2\nserved [\d,]+ tok/s; offline [\d,]+ tok/s; served/offline \d+\.\d%",
                     result.stdout)


@pytest.mark.slow  # our front, a handler process and two spawned engines
def test_the_nanovllm_workload_is_served_at_each_data_parallel_size_by_engines_without_a_device(tmp_path):
    """--fake-tok-s: the engines' steps skip the model, each producing tokens at the given rate; each process's CPU
    per output token is reported."""
    model = tiny_model(tmp_path / "tiny")
    command = [sys.executable, str(ROOT / "bench" / "serve.py"), "--model", str(model), "--fake-tok-s", "2000",
               "--workload", "nanovllm", "--num-seqs", "3", "--data-parallel-sizes", "1", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    served = [int(tokens.replace(",", "")) for tokens in re.findall(r"served run 1: ([\d,]+) output tokens",
                                                                    result.stdout)]
    assert len(served) == 2 and served[0] == served[1]  # the whole workload at either size
    cpu = re.findall(r"CPU per output token \(share of one core\): (.*)", result.stdout)
    assert len(cpu) == 2
    assert [re.findall(r"(\w+(?: \d)?) [\d.]+ us \(\d+%\)", line) for line in cpu] == [
        ["client", "front", "handler"], ["client", "front", "handler", "engine 0", "engine 1"]]
    assert "engines in /metrics: 2" in result.stdout
    assert re.search(r"data parallel 1: [\d,]+ tok/s, 1\.00x data parallel 1\n"
                     r"data parallel 2: [\d,]+ tok/s, \d+\.\d\dx data parallel 1", result.stdout)


@pytest.mark.slow  # our front and a handler process
def test_the_handler_trace_follows_every_request_through_its_stages(tmp_path):
    model, trace = tiny_model(tmp_path / "tiny"), tmp_path / "trace.json"
    command = [sys.executable, str(ROOT / "bench" / "serve.py"), "--model", str(model), "--device", "cpu",
               "--prompt-len", "32", "--output-len", "8", "--concurrency", "3", "--num-prompts", "6",
               "--trace", str(trace), "--trace-stacks"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    with open(trace) as f:
        recorded = json.load(f)
    requests, encodings = serve_trace.chat_requests(recorded["events"])
    assert len(requests) == len(encodings) == 7  # the warm-up and six
    for request in requests:
        assert request["dispatch"] < request["submit"] < request["add"] < request["first"] < request["sent"]
    assert sum(1 for _, _, launches in recorded["steps"] if launches) >= 2 * 8  # two rounds of three, 8 tokens
    # the engine thread's stacks: sampled while it stepped, and the report names where it was in its slowest step
    stacks = recorded["stacks"]
    steps = [index for t, index in stacks["samples"] if any(start <= t <= end for start, end, _ in recorded["steps"])]
    assert steps and all(0 <= index < len(stacks["table"]) for index in steps)
    assert any(re.search(r"(engine_core|model_runner|llama|reference)\.py:", stacks["table"][index]) for index in steps)
    report = subprocess.run([sys.executable, str(ROOT / "bench" / "serve_trace.py"), str(trace)],
                            capture_output=True, text=True, timeout=60, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'bench'}"})
    assert report.returncode == 0, report.stderr
    slowest = report.stdout.split("the engine thread in the 5 slowest steps", 1)[1].splitlines()
    assert re.fullmatch(r"  [\d.]+ ms, launches .*", slowest[1])
    assert re.fullmatch(r" +\d+ x \S+\.py:\S+:\d+.*", slowest[2])


def test_requests_reuse_connections_opened_before_the_clock():
    """Every timed chat request travels on a connection the client opened before it started the clock, so the
    benchmark does not time its own connection setup."""
    from aiohttp import web

    seen = []  # (route, the client's port)

    async def health(request):
        seen.append(("health", request.transport.get_extra_info("peername")[1]))
        return web.Response(text="ok")

    async def chat(request):
        body = json.loads(await request.read())
        seen.append(("chat", request.transport.get_extra_info("peername")[1]))
        response = web.StreamResponse()
        await response.prepare(request)
        await asyncio.sleep(0.05)  # all requests in flight at once
        for _ in range(body["max_tokens"]):
            await response.write(b'data: {"choices":[{"delta":{"content":"w"}}]}\n\n')
        await response.write(b'data: {"usage":{"completion_tokens":%d}}\n\n' % body["max_tokens"])
        return response

    async def run():
        app = web.Application()
        app.add_routes([web.get("/health", health), web.post("/v1/chat/completions", chat)])
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            async with serve.client_session() as session:
                requests = [([1, 2, 3], 2, 0.0)] * 6
                results, _ = await serve.run_requests(session, url, requests, None, None, 0)
        finally:
            await runner.cleanup()
        return results

    results = asyncio.run(run())
    assert [r.output_tokens for r in results] == [2] * 6
    opened = {port for route, port in seen if route == "health"}
    chats = [port for route, port in seen if route == "chat"]
    assert len(chats) == 6 and set(chats) <= opened and len(set(chats)) == 6
