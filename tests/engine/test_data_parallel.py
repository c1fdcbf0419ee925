"""Data parallelism (engine/data_parallel.py): two engines, each a spawned process, answering concurrent requests as
transformers does, routed by prefix and load; constrained requests and embeddings on them, the grammars' tokenizer
info sent down each engine's pipe once (engine/sent_once.py); GPU assignment; a lost engine."""
import asyncio
import pickle

import pytest
import torch
import xgrammar
from test_constraints import SCHEMA, STOP, VOCAB, masked_greedy, tiny_vocabulary

from engine import EngineConfig, SamplingParams, Worker, sent_once
from engine.data_parallel import DataParallelWorker, _InFlight, engine_devices, follow_constraint
from engine.sent_once import PipePickler, SentOnce
from engine.worker import RequestOutput
from handler.grammar import GrammarConstraint

NEW = 12
NEW_CONSTRAINED = 24


async def collect(queue):
    tokens = []
    while True:
        item = await queue.get()
        tokens += item.new_token_ids
        if item.finish_reason:
            return tokens, item


@pytest.fixture
def two_engines(tiny_llama):
    lost = []
    worker = DataParallelWorker(EngineConfig(tiny_llama.path, device="cpu", data_parallel_size=2), lost.append)
    worker.lost = lost
    yield worker
    worker.shutdown()


def test_two_engines_answer_concurrent_requests_as_transformers(two_engines, tiny_llama, prompts_of_lengths):
    worker = two_engines
    first, *others = prompts_of_lengths([40, 9, 23, 17, 31, 5, 12])
    follow_up = first + prompts_of_lengths([6], seed=2)[0]  # the first prompt's blocks, then more
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)

    async def main():
        tokens, _ = await collect(worker.submit("first", first, params))
        engines = {"first": worker.engine_of("first")}
        assert engines["first"] is None  # finished: no longer in flight
        queues = {"follow-up": worker.submit("follow-up", follow_up, params)}
        queues.update({f"other-{i}": worker.submit(f"other-{i}", p, params) for i, p in enumerate(others)})
        engines = {request_id: worker.engine_of(request_id) for request_id in queues}
        results = dict(zip(queues, await asyncio.gather(*(collect(q) for q in queues.values()))))
        return tokens, engines, results

    first_tokens, engines, results = asyncio.run(main())
    assert first_tokens == tiny_llama.greedy(first, NEW)
    for request_id, prompt in [("follow-up", follow_up), *((f"other-{i}", p) for i, p in enumerate(others))]:
        tokens, last = results[request_id]
        assert tokens == tiny_llama.greedy(prompt, NEW), request_id
        assert last.finish_reason == "length" and last.num_prompt_tokens == len(prompt)
    assert engines["follow-up"] == 0  # where the first prompt went (both idle: the first engine) and is cached
    assert results["follow-up"][1].num_cached_tokens >= 32  # its two full blocks of 16, from that engine's cache
    assert set(engines.values()) == {0, 1}  # the others were spread by load
    stats = worker.stats()
    assert len(stats["engines"]) == 2
    assert stats["num_total_blocks"] == sum(engine["num_total_blocks"] for engine in stats["engines"])


def test_choices_of_one_completion_share_their_engine(two_engines, prompts_of_lengths):
    worker = two_engines
    busy, prompt = prompts_of_lengths([30, 40])
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)

    async def main():
        queues = [worker.submit("busy", busy, params), worker.submit("c/0", prompt, params)]
        queues.append(worker.submit("c/1", prompt, params, shares_prompt_with="c/0"))
        engines = [worker.engine_of(request_id) for request_id in ("busy", "c/0", "c/1")]
        return engines, await asyncio.gather(*(collect(q) for q in queues))

    (busy_engine, first_choice, second_choice), results = asyncio.run(main())
    assert first_choice != busy_engine  # the least loaded
    assert second_choice == first_choice  # not the least loaded any more, but where its prompt is
    assert results[2][1].num_cached_tokens == 32  # the first choice's two full prompt blocks, shared there
    worker.shutdown()
    assert worker.unavailable == "the engine has shut down"
    with pytest.raises(RuntimeError, match="shut down"):
        worker.submit("late", prompt, params)


def test_a_lost_engine_fails_its_requests_and_tells_the_handler(two_engines, prompts_of_lengths):
    worker = two_engines
    remote = worker.engines[1]
    params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)

    async def main():
        queues = [worker.submit(i, prompt, params) for i, prompt in enumerate(prompts_of_lengths([8, 9]))]
        on_remote = next(q for i, q in enumerate(queues) if worker.engine_of(i) == 1)
        remote.process.kill()
        return await collect(on_remote)

    _, last = asyncio.run(main())
    assert last.finish_reason == "error" and "data-parallel engine 1 exited" in last.error
    assert worker.lost and worker.unavailable
    with pytest.raises(RuntimeError, match="data-parallel engine 1 exited"):
        worker.submit("late", [1, 2, 3], params)


def test_each_engine_gets_its_own_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    config = EngineConfig("unused", device="cuda", data_parallel_size=2, tensor_parallel_size=2)
    assert engine_devices(config) == ["4,5", "6,7"]
    assert engine_devices(EngineConfig("unused", device="cpu", data_parallel_size=3)) == [None] * 3
    with pytest.raises(ValueError, match="needs 6 GPUs but 4 are visible"):
        engine_devices(EngineConfig("unused", device="cuda", data_parallel_size=3, tensor_parallel_size=2))


@pytest.mark.slow  # four processes: two engines of two tensor-parallel ranks each
def test_data_parallel_engines_of_tensor_parallel_ranks(tiny_llama, prompts_of_lengths):
    worker = DataParallelWorker(EngineConfig(tiny_llama.path, device="cpu", data_parallel_size=2,
                                             tensor_parallel_size=2))
    prompts = prompts_of_lengths([7, 26, 15, 3])
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)

    async def main():
        queues = [worker.submit(i, prompt, params) for i, prompt in enumerate(prompts)]
        engines = {worker.engine_of(i) for i in range(len(prompts))}
        return engines, await asyncio.gather(*(collect(q) for q in queues))

    try:
        engines, results = asyncio.run(main())
    finally:
        worker.shutdown()
    assert engines == {0, 1}
    assert [tokens for tokens, _ in results] == [tiny_llama.greedy(prompt, NEW) for prompt in prompts]


class RecordingPipe:
    """An engine's pipe that keeps the size of each message written to it as bytes (all but its stop message)."""

    def __init__(self, pipe):
        self.pipe, self.sizes = pipe, []

    def send_bytes(self, data) -> None:
        self.sizes.append(len(data))
        self.pipe.send_bytes(data)

    def __getattr__(self, name):
        return getattr(self.pipe, name)


@pytest.mark.slow  # two engine processes and a third engine
def test_constrained_requests_and_embeddings_run_in_the_engine_processes(two_engines, tiny_llama):
    """A constraint travels to its engine's process as its grammar (the handler's copy stays here), the tokenizer
    info with the first one only, and decodes there as transformers does with the grammar's mask applied by hand;
    embeddings come from engine 0's process."""
    worker = two_engines
    info = xgrammar.TokenizerInfo(tiny_vocabulary(), vocab_size=VOCAB, stop_token_ids=[STOP])
    grammar = xgrammar.GrammarCompiler(info).compile_json_schema(SCHEMA, any_whitespace=False)
    shared_info = SentOnce(info.serialize_json())
    prompts = [[5, 17, 40, 3, 99, 12], [8, 2, 77], [8, 2, 78], [5, 17, 41, 3, 99, 12]]  # lengths alike two by two
    params = SamplingParams(temperature=0, max_tokens=NEW_CONSTRAINED, stop_token_ids=[STOP])
    for engine in worker.engines:
        engine.pipe = RecordingPipe(engine.pipe)

    async def main():
        queues = [worker.submit(i, prompt, params, GrammarConstraint(grammar, shared_info))
                  for i, prompt in enumerate(prompts)]
        engines = [worker.engine_of(i) for i in range(len(prompts))]
        vectors = await worker.embed(prompts)
        return engines, await asyncio.gather(*(collect(q) for q in queues)), vectors

    engines, results, vectors = asyncio.run(main())
    assert sorted(engines) == [0, 0, 1, 1]
    assert [tokens for tokens, _ in results] == [masked_greedy(tiny_llama, p, grammar, NEW_CONSTRAINED)
                                                 for p in prompts]
    for engine in worker.engines:
        first, later = engine.pipe.sizes[:2]  # its two requests' (engine 0 then embeds)
        assert first - later >= len(shared_info.value)  # the info went with the first request only
    one = Worker(EngineConfig(tiny_llama.path, device="cpu"))
    try:
        expected = asyncio.run(one.embed(prompts))
    finally:
        one.shutdown()
    assert torch.allclose(torch.tensor(vectors), torch.tensor(expected), atol=1e-6)


def test_a_grammars_tokenizer_info_goes_down_each_pipe_once(monkeypatch):
    """A constrained request's message carries its grammar and the tokenizer info only the first time down a
    pipe; read in order at the other end, a later one rebuilds a constraint that follows the grammar, from the
    grammar deserialized for the first."""
    info = xgrammar.TokenizerInfo(tiny_vocabulary(), vocab_size=VOCAB, stop_token_ids=[STOP])
    grammar = xgrammar.GrammarCompiler(info).compile_json_schema(SCHEMA, any_whitespace=False)
    shared_info = SentOnce(info.serialize_json())
    params = SamplingParams(temperature=0, max_tokens=NEW_CONSTRAINED, stop_token_ids=[STOP])

    def message(pipe: PipePickler, request_id: int) -> bytes:
        constraint = GrammarConstraint(grammar, shared_info)
        return bytes(pipe.dumps(("submit", (request_id, [5, 17, 40], params, constraint, None))))

    engine_0, engine_1 = PipePickler(), PipePickler()
    first, later, another = message(engine_0, 1), message(engine_0, 2), message(engine_1, 3)
    assert len(first) - len(later) >= len(shared_info.value) + len(grammar.serialize_json())
    assert len(another) == len(first)  # another engine's pipe gets it in full
    assert len(message(engine_0, 4)) == len(later)

    monkeypatch.setattr(sent_once, "_received", sent_once.KeptValues())  # engine 0's end, before its first message
    with pytest.raises(RuntimeError, match="referred to but is not kept here"):
        pickle.loads(later)
    _, (_, _, _, first_rebuilt, _) = pickle.loads(first)
    _, (_, _, _, rebuilt, _) = pickle.loads(later)
    assert rebuilt.info is sent_once._received[shared_info.digest]
    assert rebuilt.compiled is first_rebuilt.compiled  # the grammar came once and was deserialized once
    vocabulary = tiny_vocabulary()
    text = '{"name": "ab", "tags": []}'
    assert all(rebuilt.accept_token(vocabulary.index(c)) for c in text) and rebuilt.accept_token(STOP)
    assert rebuilt.is_terminated()
    assert not rebuilt.broken


def test_a_failed_constrained_request_tells_the_handlers_constraint_whether_a_token_broke_it():
    info = xgrammar.TokenizerInfo(tiny_vocabulary(), vocab_size=VOCAB, stop_token_ids=[STOP])
    grammar = xgrammar.GrammarCompiler(info).compile_json_schema(SCHEMA, any_whitespace=False)
    opening, closing = tiny_vocabulary().index("{"), tiny_vocabulary().index("}")

    def failed(tokens_per_output: list[list[int]]) -> bool:
        request = _InFlight(None, None, GrammarConstraint(grammar), [])
        for i, tokens in enumerate(tokens_per_output):
            last = i == len(tokens_per_output) - 1
            follow_constraint(request, RequestOutput(0, tokens, "error" if last else None, "failed", 3, 0, 0))
        return request.constraint.broken

    assert failed([[opening], [closing]])  # "{}" lacks the required keys: the engine's copy refused the "}"
    assert not failed([[opening], []])  # failed for another reason (a lost engine): no token broke it
