"""Overlapped decode steps (step N+1 launched before step N's ids reach the host) give exactly the tokens of
the synchronous engine and of transformers: requests stopping at different steps (stop tokens, max_tokens,
max_tokens=1), aborts while a step is in flight, seeded sampling, penalties (which fall back), waiting
requests, preemption, the Worker and two tensor-parallel ranks. On the CPU the launch is synchronous, but the
decisions and the bookkeeping are the same code as on CUDA, forced on here."""
import asyncio

import pytest

from engine import LLM, EngineConfig, SamplingParams, Worker

NEW = 24


def overlapped(llm_or_worker):
    """Turns overlap on; returns a list that records, per launch, whether it went on from a step in flight. The
    warm-up (CUDA graphs) runs first: a step that finishes it launches nothing ahead."""
    core = llm_or_worker.core
    core.finish_warm_up()
    core.overlap = True
    launches, launch = [], core.runner.launch

    def recording(seqs, num_tokens, ahead=None, follows=()):
        launches.append(ahead is not None)
        return launch(seqs, num_tokens, ahead, follows)

    core.runner.launch = recording
    return launches


def cut(reference: list[int], params: SamplingParams) -> list[int]:
    """What greedy decoding returns under params' max_tokens and stop_token_ids."""
    out = reference[:params.max_tokens]
    stops = [i for i, token in enumerate(out) if token in params.stop_token_ids]
    return out[:stops[0] + 1] if stops else out


def staggered(references: list[list[int]]) -> list[SamplingParams]:
    """Requests that end at different steps: a stop token from their own output, or max_tokens, or both."""
    params = []
    for i, reference in enumerate(references):
        stop = [reference[3 + 5 * (i % 4)]] if i % 3 != 2 else []
        params.append(SamplingParams(temperature=0, max_tokens=[NEW, 1, 9, 2, 17, 13][i % 6], stop_token_ids=stop))
    return params


def assert_idle(llm):
    stats = llm.core.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] and stats["running"] == stats["waiting"] == 0


def test_overlap_matches_synchronous_and_transformers(tiny_model, prompts_of_lengths):
    prompts = prompts_of_lengths([3, 17, 33, 50, 8, 21, 5])
    references = [tiny_model.greedy(prompt, NEW) for prompt in prompts]
    params = staggered(references)
    expected = [cut(reference, p) for reference, p in zip(references, params)]
    sync = LLM(tiny_model.path, dtype="float32")
    assert [out["token_ids"] for out in sync.generate(prompts, params)] == expected
    llm = LLM(tiny_model.path, dtype="float32")
    launches = overlapped(llm)
    assert [out["token_ids"] for out in llm.generate(prompts, params)] == expected
    assert not launches[0] and all(launches[1:])  # the prompts, then every step launched ahead
    assert_idle(llm)
    again = llm.generate(prompts, params)  # the last, thrown-away step is still in flight
    assert [out["token_ids"] for out in again] == expected
    assert_idle(llm)


def test_prompt_chunks_and_admissions_launch_ahead(tiny_llama, prompts_of_lengths):
    """Steps carrying prompt chunks and newly admitted prompts beside decodes are launched ahead too (the
    decodes take the step in flight's tokens on the device), with requests waiting for seats."""
    prompts = prompts_of_lengths([40, 7, 26, 13, 3], seed=8)
    references = [tiny_llama.greedy(prompt, NEW) for prompt in prompts]
    params = staggered(references)
    llm = LLM(tiny_llama.path, dtype="float32", max_num_batched_tokens=16, max_num_seqs=3)
    core = llm.core
    core.finish_warm_up()  # a step that finishes the warm-up (CUDA graphs) launches nothing ahead
    core.overlap = True
    mixed_ahead, launch = [], core.runner.launch

    def recording(seqs, num_tokens, ahead=None, follows=()):
        if ahead is not None and follows and max(num_tokens) > 1:
            mixed_ahead.append(len(follows))
        return launch(seqs, num_tokens, ahead, follows)

    core.runner.launch = recording
    assert [out["token_ids"] for out in llm.generate(prompts, params)] == \
        [cut(reference, p) for reference, p in zip(references, params)]
    assert len(mixed_ahead) >= 3
    seeded = [SamplingParams(temperature=0.8, max_tokens=NEW - i, seed=i) for i in range(len(prompts))]
    sync = LLM(tiny_llama.path, dtype="float32", max_num_batched_tokens=16, max_num_seqs=3, overlap_steps=False)
    mixed_ahead.clear()
    assert llm.generate(prompts, seeded) == sync.generate(prompts, seeded)  # drawn at the same positions
    assert mixed_ahead
    assert_idle(llm)


def test_requests_reaching_max_model_len(tiny_llama, prompts_of_lengths):
    """The step launched ahead of a request's last token computes the last position the model allows."""
    prompts = prompts_of_lengths([9, 4, 7], seed=7)
    llm = LLM(tiny_llama.path, dtype="float32", max_model_len=14, block_size=2)
    launches = overlapped(llm)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=None))
    assert [out["token_ids"] for out in outputs] == [tiny_llama.greedy(p, 14 - len(p)) for p in prompts]
    assert any(launches)
    assert_idle(llm)


def test_abort_while_a_step_is_in_flight(tiny_llama, prompts_of_lengths):
    prompts = prompts_of_lengths([6, 19, 11], seed=2)
    references = [tiny_llama.greedy(prompt, NEW) for prompt in prompts]
    llm = LLM(tiny_llama.path, dtype="float32")
    overlapped(llm)
    core = llm.core
    seqs = [core.make_sequence(i, prompt, SamplingParams(temperature=0, max_tokens=NEW))
            for i, prompt in enumerate(prompts)]
    for seq in seqs:
        core.add(seq)
    delivered = {seq.request_id: [] for seq in seqs}
    steps = 0
    while core.has_work():
        for seq, token_id in core.step():
            delivered[seq.request_id].append(token_id)
        steps += 1
        if steps == 6:
            assert core.in_flight is not None and seqs[1] in core.in_flight.seqs
            core.abort(seqs[1])
    assert seqs[1].finish_reason == "abort" and delivered[1] == references[1][:len(delivered[1])]
    assert seqs[1].output_token_ids == delivered[1] and 0 < len(delivered[1]) < NEW
    assert [delivered[0], delivered[2]] == [references[0], references[2]]
    assert_idle(llm)


def test_seeded_sampling_and_penalties(tiny_llama, prompts_of_lengths):
    """Seeded requests draw with noise keyed by their seed and position, so they keep their tokens; a batch with
    a penalised request needs the host's tokens for every step and runs synchronously."""
    prompts = prompts_of_lengths([7, 20, 11], seed=3)
    seeded = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=NEW, seed=42),
              SamplingParams(temperature=0.7, top_k=20, max_tokens=NEW - 7, seed=7),
              SamplingParams(temperature=0, max_tokens=NEW - 3)]
    penalised = [SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, frequency_penalty=0.5)] * 3
    sync = LLM(tiny_llama.path, dtype="float32")
    expected_seeded = sync.generate(prompts, seeded)
    expected_penalised = sync.generate(prompts, penalised)
    llm = LLM(tiny_llama.path, dtype="float32")
    launches = overlapped(llm)
    assert llm.generate(prompts, seeded) == expected_seeded
    assert any(launches)
    launches.clear()
    assert llm.generate(prompts, penalised) == expected_penalised
    assert not any(launches[1:])  # the prompts went ahead of the seeded batch's last, thrown-away step
    assert_idle(llm)


@pytest.mark.parametrize("config", [dict(max_num_seqs=2), dict(num_kv_blocks=7), dict(max_num_batched_tokens=8)])
def test_waiting_preemption_and_small_budgets(tiny_llama, prompts_of_lengths, config):
    """Requests waiting for a seat (admitted one step after a request finishes), preemption when the blocks
    run out (the overlap falls back to the plain schedule) and a token budget smaller than the batch."""
    prompts = prompts_of_lengths([3, 17, 33, 50, 12], seed=4)
    references = [tiny_llama.greedy(prompt, NEW) for prompt in prompts]
    params = staggered(references)
    llm = LLM(tiny_llama.path, dtype="float32", **config)
    launches = overlapped(llm)
    assert [out["token_ids"] for out in llm.generate(prompts, params)] == \
        [cut(reference, p) for reference, p in zip(references, params)]
    assert any(launches)
    assert_idle(llm)


def test_worker_streams_and_aborts_with_overlap(tiny_llama, prompts_of_lengths):
    worker = Worker(EngineConfig(tiny_llama.path, device="cpu"))
    try:
        overlapped(worker)
        idle = worker.stats()["num_free_blocks"]
        prompts = prompts_of_lengths([4, 19, 30], seed=5)
        references = [tiny_llama.greedy(prompt, NEW) for prompt in prompts]

        async def collect(queue):
            tokens = []
            while True:
                item = await queue.get()
                tokens += item.new_token_ids
                if item.finish_reason:
                    return tokens, item.finish_reason

        async def main():
            queues = [worker.submit(i, p, SamplingParams(temperature=0, max_tokens=NEW - 5 * i))
                      for i, p in enumerate(prompts)]
            long = worker.submit("long", prompts[0], SamplingParams(temperature=0, max_tokens=None))
            first = await long.get()
            worker.abort("long")
            rest, reason = await collect(long)
            return await asyncio.gather(*(collect(q) for q in queues)), (first.new_token_ids + rest, reason)

        results, (long_tokens, long_reason) = asyncio.run(main())
        assert results == [(reference[:NEW - 5 * i], "length") for i, reference in enumerate(references)]
        assert long_reason == "abort" and long_tokens == tiny_llama.greedy(prompts[0], len(long_tokens))
        assert worker.stats()["num_free_blocks"] == idle and worker.stats()["running"] == 0
    finally:
        worker.shutdown()


@pytest.mark.slow  # a tensor-parallel rank in a process of its own
def test_two_tensor_parallel_ranks_with_overlap(tiny_llama, prompts_of_lengths):
    """Rank 0 samples and sends each continuation's input ids to the other rank on the device."""
    prompts = prompts_of_lengths([5, 33, 18], seed=6)
    references = [tiny_llama.greedy(prompt, NEW) for prompt in prompts]
    params = staggered(references)
    llm = LLM(tiny_llama.path, dtype="float32", device="cpu", tensor_parallel_size=2)
    try:
        launches = overlapped(llm)
        assert [out["token_ids"] for out in llm.generate(prompts, params)] == \
            [cut(reference, p) for reference, p in zip(references, params)]
        assert any(launches)
        assert_idle(llm)
    finally:
        llm.shutdown()
