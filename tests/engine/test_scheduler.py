"""Scheduling decisions: token budget, running before waiting, chunked prefill, preemption of the newest."""
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence


def setup(num_blocks=64, budget=16, max_seqs=8, block_size=4):
    config = EngineConfig(model="-", block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=max_seqs)
    return Scheduler(config, BlockManager(num_blocks, block_size))


def seq(n, request_id, max_tokens=8, first=1, **kw):
    tokens = list(range(first, first + n))
    return Sequence(request_id, tokens, SamplingParams(max_tokens=max_tokens, **kw), 1000, (0,))


def run_step(scheduler, token=7):
    seqs, counts = scheduler.schedule()
    sampled = [token if s.num_computed_tokens + n == len(s) else None for s, n in zip(seqs, counts)]
    scheduler.update(seqs, counts, sampled)
    return [(s.request_id, n) for s, n in zip(seqs, counts)]


def test_chunked_prefill_shares_steps_with_decodes():
    scheduler = setup(budget=16)
    scheduler.add(seq(6, "a"))
    assert run_step(scheduler) == [("a", 6)]
    scheduler.add(seq(40, "b", first=100))
    assert run_step(scheduler) == [("a", 1), ("b", 15)]  # the decode first, then a chunk of the prompt
    assert run_step(scheduler) == [("a", 1), ("b", 15)]
    assert run_step(scheduler) == [("a", 1), ("b", 10)]
    assert run_step(scheduler) == [("a", 1), ("b", 1)]


def test_max_num_seqs_caps_running():
    scheduler = setup(max_seqs=2, budget=100)
    for i in range(3):
        scheduler.add(seq(3, i))
    assert run_step(scheduler) == [(0, 3), (1, 3)]
    assert len(scheduler.waiting) == 1


def test_finish_on_stop_token_max_tokens_and_ignore_eos():
    scheduler = setup(budget=100)
    stops, lengthy, ignores = seq(3, "s"), seq(3, "l", max_tokens=2), seq(3, "i", max_tokens=2, ignore_eos=True)
    for s in (stops, lengthy, ignores):
        scheduler.add(s)
    seqs, counts = scheduler.schedule()
    scheduler.update(seqs, counts, [0, 5, 0])  # 0 is the eos id
    assert stops.finish_reason == "stop" and lengthy.finish_reason is None and ignores.finish_reason is None
    run_step(scheduler)
    assert lengthy.finish_reason == "length" and ignores.finish_reason == "length"
    assert not scheduler.has_work() and scheduler.block_manager.num_free_blocks == 64


def test_preempts_the_newest_and_recomputes_it_later():
    scheduler = setup(num_blocks=4, budget=100, block_size=4)
    old, new = seq(8, "old", max_tokens=6), seq(8, "new", max_tokens=6, first=100)
    scheduler.add(old)
    scheduler.add(new)
    assert run_step(scheduler) == [("old", 8), ("new", 8)]  # 2 blocks each: the pool is full
    assert run_step(scheduler) == [("old", 1)]  # old needs a third block: new is preempted
    assert scheduler.num_preemptions == 1 and scheduler.waiting[0] is new and new.num_computed_tokens == 0
    while not old.is_finished:
        run_step(scheduler)
    assert run_step(scheduler) == [("new", 9)]  # its prompt and its sampled token, computed again
    assert new.num_output_tokens == 2


def test_abort_frees_blocks():
    scheduler = setup()
    a = seq(9, "a")
    scheduler.add(a)
    run_step(scheduler)
    scheduler.abort(a)
    assert a.finish_reason == "abort" and scheduler.block_manager.num_free_blocks == 64 and not scheduler.has_work()


def test_schedule_ahead_only_where_the_plain_schedule_would_continue():
    """The step after a decode step in flight may be scheduled before its tokens are known only when it is
    that step again, one token further: all running requests, nobody admitted, nobody preempted."""
    scheduler = setup(num_blocks=5, budget=16, max_seqs=3)
    a, b = seq(3, "a"), seq(3, "b", first=10)
    scheduler.add(a)
    scheduler.add(b)
    run_step(scheduler)  # both prompts: 4 tokens each, 1 block each
    seqs, counts = scheduler.schedule()  # the step in flight: token 4 of each
    assert counts == [1, 1] and not scheduler.schedule_ahead([a])  # b runs too
    assert scheduler.schedule_ahead(seqs)
    assert [len(s.block_table) for s in seqs] == [2, 2]  # tokens 4 and 5 need a second block each
    scheduler.add(seq(3, "c", first=20))
    assert not scheduler.schedule_ahead(seqs)  # c could be admitted: the plain schedule differs
    scheduler.max_num_seqs = 2
    assert scheduler.schedule_ahead(seqs)  # no seat for c before a request finishes
    scheduler.update(seqs, counts, [7, 7])
    for _ in range(3):
        seqs, counts = scheduler.schedule()
        assert counts == [1, 1] and scheduler.block_manager.num_free_blocks == 1
        scheduler.update(seqs, counts, [7, 7])
    seqs, counts = scheduler.schedule()  # in flight: token 7 of each; token 8 needs a third block each
    assert not scheduler.schedule_ahead(seqs)  # one block left: the plain schedule would preempt b
    assert scheduler.num_preemptions == 0 and [len(s.block_table) for s in seqs] == [3, 2]
    scheduler.update(seqs, counts, [7, 7])
    assert scheduler.schedule() == ([a], [1]) and scheduler.num_preemptions == 1
