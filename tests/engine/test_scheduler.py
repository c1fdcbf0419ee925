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


def test_a_preempted_request_goes_ahead_of_those_already_waiting():
    """It arrived before them, so it is admitted again before them (first come, first served)."""
    scheduler = setup(num_blocks=4, budget=100, block_size=4)
    old, new = seq(8, "old", max_tokens=6), seq(8, "new", max_tokens=6, first=100)
    later = [seq(4, "w1", max_tokens=2, first=200), seq(4, "w2", max_tokens=2, first=300)]
    for s in (old, new, *later):
        scheduler.add(s)
    assert run_step(scheduler) == [("old", 8), ("new", 8)]  # the pool is full: w1 and w2 wait
    assert run_step(scheduler) == [("old", 1)]  # old needs a third block: new is preempted
    assert list(scheduler.waiting) == [new, *later]
    while not old.is_finished:
        run_step(scheduler)
    assert run_step(scheduler) == [("new", 9), ("w1", 4)]


def test_a_step_that_preempts_admits_nothing():
    """Admitting in the step that preempted would hand the blocks just freed straight back to a waiting request
    (here the one preempted), so that the running requests preempt again next step."""
    scheduler = setup(num_blocks=3, budget=5, block_size=4)
    old, new = seq(4, "old", max_tokens=6), seq(8, "new", max_tokens=6, first=100)
    for s in (old, new):
        scheduler.add(s)
    assert run_step(scheduler) == [("old", 4), ("new", 1)]  # a block each, one free
    assert run_step(scheduler) == [("old", 1)]  # old takes the free block; new's next chunk needs one: preempted
    assert scheduler.num_preemptions == 1 and list(scheduler.waiting) == [new]
    assert scheduler.block_manager.num_free_blocks == 1  # room for a chunk of new within the budget left
    assert run_step(scheduler) == [("old", 1), ("new", 4)]  # admitted in the next step

def test_abort_frees_blocks():
    scheduler = setup()
    a = seq(9, "a")
    scheduler.add(a)
    run_step(scheduler)
    scheduler.abort(a)
    assert a.finish_reason == "abort" and scheduler.block_manager.num_free_blocks == 64 and not scheduler.has_work()


def launch_ahead(scheduler, seqs, counts, token=7):
    """One step of the engine's overlapped loop: plans the step after (seqs, counts), then applies it."""
    samples = [row for row, (s, n) in enumerate(zip(seqs, counts)) if s.num_computed_tokens + n == len(s)]
    planned = scheduler.schedule_ahead(seqs, counts, samples)
    scheduler.update(seqs, counts, [token if row in samples else None for row in range(len(seqs))])
    return planned


def test_schedule_ahead_plans_the_step_schedule_makes_afterwards():
    """While nothing finishes, the step planned with one in flight (its tokens unknown) is the one
    schedule() makes once they are known: decodes first, the rest of a chunked prompt, admissions."""
    plain, overlapped = setup(budget=16), setup(budget=16)
    for scheduler in (plain, overlapped):
        for i, n in enumerate([6, 40, 3, 9, 21]):
            scheduler.add(seq(n, i, max_tokens=50, first=10 * i + 1))
    expected = [run_step(plain) for _ in range(8)]
    seqs, counts = overlapped.schedule()
    steps = []
    for _ in range(8):
        in_flight = dict(zip(map(id, seqs), counts))
        sampling = [s for s, n in zip(seqs, counts) if s.num_computed_tokens + n == len(s)]
        steps.append([(s.request_id, n) for s, n in zip(seqs, counts)])
        seqs, counts, ahead, follows = launch_ahead(overlapped, seqs, counts)
        assert seqs[:len(follows)] == sampling and follows == list(range(len(sampling)))
        assert ahead == [in_flight.get(id(s), 0) for s in seqs]
    assert steps == expected
    assert any(n > 1 for _, n in expected[2]) and len(expected[3]) == 5  # chunks, and every request admitted


def test_schedule_ahead_drops_finished_requests_and_admits_to_free_seats():
    scheduler = setup(budget=16, max_seqs=2)
    a, b, c = seq(3, "a"), seq(3, "b", first=10), seq(3, "c", first=20)
    for s in (a, b, c):
        scheduler.add(s)
    seqs, counts = scheduler.schedule()
    assert [s.request_id for s in seqs] == ["a", "b"]
    scheduler.abort(a)  # while its prompt is in flight
    planned_seqs, counts, ahead, follows = scheduler.schedule_ahead(seqs, counts, [0, 1])
    assert planned_seqs == [b, c] and counts == [1, 3] and ahead == [3, 0] and follows == [1]
    assert scheduler.running == [b, c] and not scheduler.waiting


def test_schedule_ahead_waits_where_the_plain_schedule_would_preempt():
    scheduler = setup(num_blocks=3, budget=16, block_size=4)
    a, b, c = seq(3, "a"), seq(3, "b", first=10), seq(3, "c", first=20)
    for s in (a, b):
        scheduler.add(s)
    seqs, counts = scheduler.schedule()  # the prompts: a block each
    seqs, counts, _, _ = launch_ahead(scheduler, seqs, counts)  # token 3 of each fits those blocks
    scheduler.add(c)
    assert launch_ahead(scheduler, seqs, counts) is None  # token 4 of each needs a block; one is left
    assert scheduler.waiting[0] is c and scheduler.running == [a, b] and scheduler.num_preemptions == 0
    assert scheduler.schedule() == ([a], [1]) and scheduler.num_preemptions == 1  # the plain schedule preempts b


def test_schedule_ahead_waits_when_the_sampling_requests_do_not_lead():
    scheduler = setup(budget=16)
    a, b = seq(3, "a"), seq(3, "b", first=10)
    for s in (a, b):
        scheduler.add(s)
    seqs, counts = scheduler.schedule()
    assert scheduler.schedule_ahead([b], [4], [0]) is None  # a runs before b: b's token cannot lead
    assert [s.request_id for s in scheduler.running] == ["a", "b"]


def test_schedule_ahead_plans_nothing_when_every_request_ends_in_flight():
    """A step ahead of one whose tokens finish every request by length would compute only throwaway tokens (on the
    CPU, where a launch runs at once, it delayed the last token's delivery by a whole forward)."""
    scheduler = setup(budget=16)
    a = seq(3, "a", max_tokens=2)
    scheduler.add(a)
    seqs, counts = scheduler.schedule()
    planned, counts, _, follows = launch_ahead(scheduler, seqs, counts)  # its first token: one more to go
    assert planned == [a] and follows == [0]
    assert launch_ahead(scheduler, planned, counts) is None and a.finish_reason == "length"
    b, c, d = seq(3, "b", max_tokens=1), seq(3, "c", first=10, max_tokens=5), seq(3, "d", first=20, max_tokens=1)
    scheduler.add(b)
    scheduler.add(c)
    seqs, counts = scheduler.schedule()
    planned, _, _, follows = launch_ahead(scheduler, seqs, counts)  # c goes on: b computes a throwaway token
    assert planned == [b, c] and follows == [0, 1] and b.finish_reason == "length"
    waiting = setup(budget=16, max_seqs=1)  # a request waits for a seat: the steps go on
    waiting.add(d)
    waiting.add(seq(3, "e", first=30))
    seqs, counts = waiting.schedule()
    assert seqs == [d] and launch_ahead(waiting, seqs, counts)[0] == [d]


def test_schedule_ahead_plans_nothing_when_the_last_requests_end_in_flight_after_others_ended():
    """Requests whose prompts took one step more end one step after the others, by length: the step in flight
    still has rows of those that ended before it, and the last requests need no step after it either."""
    scheduler = setup(budget=16)
    a, b = seq(3, "a", max_tokens=2), seq(3, "b", first=10, max_tokens=3)
    scheduler.add(a)
    scheduler.add(b)
    seqs, counts = scheduler.schedule()
    seqs, counts, _, _ = launch_ahead(scheduler, seqs, counts)  # both take their first token
    seqs, counts, _, _ = launch_ahead(scheduler, seqs, counts)  # a's second, its last: a throwaway row ahead
    assert seqs == [a, b] and a.finish_reason == "length" and scheduler.running == [b]
    assert scheduler.schedule_ahead(seqs, counts, [0, 1]) is None, "the step in flight samples b's last token"
