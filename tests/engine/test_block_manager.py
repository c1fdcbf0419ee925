"""Block manager and scheduler bookkeeping: invariants under random operation sequences (with and without a
sliding window), LRU eviction, O(1) removal of a prefix hit from the free queue, blocks freed as they leave
the window."""
import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.block_manager import FREED, Block, BlockManager, FreeBlockQueue
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence

BS = 4


def make_seq(tokens, request_id=0, max_tokens=4, max_model_len=1024):
    return Sequence(request_id, tokens, SamplingParams(temperature=0, max_tokens=max_tokens), max_model_len)


def fill(bm: BlockManager, seq: Sequence) -> None:
    """Admit seq with its prefix hits and compute its whole prompt, as a step would."""
    hits = bm.find_cached_prefix(seq)
    seq.num_computed_tokens = len(hits) * BS
    assert bm.allocate(seq, len(seq) - seq.num_computed_tokens, hits)
    seq.num_computed_tokens = len(seq)
    bm.commit(seq)
    bm.free_out_of_window(seq)


class SchedulerMachine(RuleBasedStateMachine):
    """Drives the real scheduler and block manager with a fake model that writes token ids as its "KV"
    and samples a token derived from the context. After every step each running request must find
    exactly its own tokens in its blocks (prefix sharing, eviction and preemption never corrupt a
    context), and ref counts must match owners. With a window, "its tokens" are those its next query can
    see, and it must hold no block before them."""

    @initialize(num_blocks=st.integers(6, 24), budget=st.integers(1, 24), max_seqs=st.integers(1, 6),
                window=st.sampled_from([0, 0, 1, 3, 6, 9]))
    def setup(self, num_blocks, budget, max_seqs, window):
        config = EngineConfig(model="-", block_size=BS, max_num_batched_tokens=budget, max_num_seqs=max_seqs)
        self.bm = BlockManager(num_blocks, BS, window)
        self.window = window
        self.scheduler = Scheduler(config, self.bm)
        self.max_model_len = num_blocks * BS
        self.kv = np.full(num_blocks * BS, -1)
        self.live: list[Sequence] = []
        self.next_id = 0

    @rule(prefix=st.sampled_from([(), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 7, 8), (9,) * 9]),
          suffix=st.lists(st.integers(0, 3), max_size=10), max_tokens=st.integers(1, 8))
    def add(self, prefix, suffix, max_tokens):
        tokens = list(prefix) + suffix
        if not tokens or len(tokens) + 1 > self.max_model_len:
            return
        seq = make_seq(tokens, self.next_id, max_tokens, self.max_model_len)
        self.next_id += 1
        self.scheduler.add(seq)
        self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule()
    def step(self):
        seqs, counts = self.scheduler.schedule()
        assert sum(counts) <= self.scheduler.max_num_batched_tokens
        assert len(self.scheduler.running) <= self.scheduler.max_num_seqs
        sampled = []
        for seq, n in zip(seqs, counts):
            assert n >= 1
            self.check_visible(seq, seq.num_computed_tokens)  # what the step's first query reads
            positions = np.arange(seq.num_computed_tokens, seq.num_computed_tokens + n)
            slots = np.array(seq.block_table)[positions // BS] * BS + positions % BS
            self.kv[slots] = seq.token_ids[seq.num_computed_tokens:seq.num_computed_tokens + n]
            done = seq.num_computed_tokens + n == len(seq)
            sampled.append(sum(seq.token_ids) % 5 if done else None)
        self.scheduler.update(seqs, counts, sampled)
        self.live = [seq for seq in self.live if not seq.is_finished]

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def abort(self, index):
        seq = self.live.pop(index % len(self.live))
        self.scheduler.abort(seq)
        assert seq.finish_reason == "abort" and not seq.block_table

    def check_visible(self, seq, next_position):
        """The keys a query at next_position sees are seq's own tokens, in blocks it holds."""
        first = max(next_position - self.window + 1, 0) if self.window else 0
        positions = np.arange(first, seq.num_computed_tokens)
        blocks = np.array(seq.block_table, dtype=int)[positions // BS]
        assert (blocks != FREED).all()
        assert self.kv[blocks * BS + positions % BS].tolist() == seq.token_ids[first:seq.num_computed_tokens]

    @invariant()
    def contexts_intact(self):
        for seq in getattr(self, "live", []):
            self.check_visible(seq, seq.num_computed_tokens)

    @invariant()
    def blocks_before_the_window_freed(self):
        for seq in getattr(self, "live", []):
            num_unread = max(seq.num_computed_tokens - self.window + 1, 0) // BS if self.window else 0
            assert seq.block_table[:num_unread] == [FREED] * num_unread
            assert FREED not in seq.block_table[num_unread:]

    @invariant()
    def ref_counts_match_owners(self):
        if not hasattr(self, "bm"):
            return
        owners = np.zeros(len(self.bm.blocks), dtype=int)
        for seq in self.live:
            held = [block_id for block_id in seq.block_table if block_id != FREED]
            assert len(set(held)) == len(held)
            owners[held] += 1
        assert [b.ref_count for b in self.bm.blocks] == owners.tolist()
        free = [b.block_id for b in self.bm.free_queue]
        assert len(free) == len(set(free)) == self.bm.num_free_blocks
        assert set(free) == {i for i, n in enumerate(owners) if n == 0}
        assert all(block.hash == h for h, block in self.bm.cached.items())

    def teardown(self):
        if hasattr(self, "bm"):
            for seq in self.live:
                self.scheduler.abort(seq)
            assert not self.scheduler.has_work()
            assert self.bm.num_free_blocks == len(self.bm.blocks)
            assert all(block.ref_count == 0 for block in self.bm.blocks)


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_eviction_takes_least_recently_freed_cached_block_first():
    bm = BlockManager(4, BS)
    for k in range(3):  # A, B, C: one full block each plus a partial one, freed in that order
        seq = make_seq([k] * BS + [0], k)
        fill(bm, seq)
        bm.free(seq)
    cached_ids = [bm.cached[hash_].block_id for hash_ in list(bm.cached)]
    assert [b.block_id for b in bm.free_queue][-3:] == cached_ids  # cached blocks at the back, in free order
    taker = make_seq([7] * (3 * BS), 9)
    assert bm.allocate(taker, 2 * BS)  # the unhashed block and A's block
    fresh = [make_seq([k] * BS + [0], 10 + k) for k in range(3)]
    assert [len(bm.find_cached_prefix(seq)) for seq in fresh] == [0, 1, 1]
    taker.num_computed_tokens = 2 * BS
    assert bm.allocate(taker, BS)  # B's block next
    assert [len(bm.find_cached_prefix(seq)) for seq in fresh] == [0, 0, 1]


def test_hit_on_free_block_removes_it_without_scanning(monkeypatch):
    bm = BlockManager(8, BS)
    first = make_seq(list(range(3 * BS)) + [99], 1)
    fill(bm, first)
    bm.free(first)
    monkeypatch.setattr(FreeBlockQueue, "__iter__", lambda self: pytest.fail("free queue scanned"))
    second = make_seq(list(range(3 * BS)) + [42], 2)
    hits = bm.find_cached_prefix(second)
    assert len(hits) == 3
    free_before = bm.num_free_blocks
    assert bm.allocate(second, 1, hits)
    assert bm.num_free_blocks == free_before - 4  # three hits taken out of the middle, one new block
    assert second.block_table[:3] == [block.block_id for block in hits]
    bm.record_lookup(second, 3 * BS)
    assert bm.hit_rate == pytest.approx(3 * BS / len(second))


def test_hit_shares_the_physical_block_and_never_covers_the_last_token():
    bm = BlockManager(8, BS)
    owner = make_seq(list(range(2 * BS)), 1)
    fill(bm, owner)
    same = make_seq(list(range(2 * BS)), 2)
    hits = bm.find_cached_prefix(same)
    assert len(hits) == 1  # the second block holds the last token: recomputed so the step has logits
    assert bm.allocate(same, BS, hits)
    assert same.block_table[0] == owner.block_table[0] and bm.blocks[owner.block_table[0]].ref_count == 2


def test_allocation_failure_changes_nothing():
    bm = BlockManager(3, BS)
    seq = make_seq(list(range(5 * BS)), 1)
    assert not bm.allocate(seq, 5 * BS)
    assert seq.block_table == [] and bm.num_free_blocks == 3


def test_free_queue_links():
    blocks = [Block(i) for i in range(4)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.appendleft(blocks[2])
    assert [b.block_id for b in queue] == [2, 0, 1, 3] and len(queue) == 4
    assert queue.popleft() is blocks[2] and [b.block_id for b in queue] == [0, 1, 3]


def test_reset_prefix_cache_forgets_prefixes_and_refuses_while_busy():
    bm = BlockManager(4, 4)
    seq = Sequence(0, list(range(9)), SamplingParams(), 100)
    assert bm.allocate(seq, 9)
    seq.num_computed_tokens = 9
    bm.commit(seq)
    with pytest.raises(RuntimeError, match="in use"):
        bm.reset_prefix_cache()
    bm.free(seq)
    again = Sequence(1, list(range(9)), SamplingParams(), 100)
    assert len(bm.find_cached_prefix(again)) == 2
    bm.reset_prefix_cache()
    assert bm.find_cached_prefix(again) == [] and bm.num_free_blocks == 4


def test_blocks_leave_as_the_window_passes_them():
    """Window 6, blocks of 4: a block goes back to the pool once every key in it is at or before the next
    token's position - 6, not a token sooner."""
    bm = BlockManager(8, BS, window=6)
    seq = make_seq(list(range(9)), 1, max_tokens=20)
    assert bm.allocate(seq, 9)
    held = []
    for _ in range(12):  # one token per step, as decodes compute them
        seq.num_computed_tokens += 1 if held else 9
        bm.free_out_of_window(seq)
        seq.token_ids.append(0)
        held.append((seq.num_computed_tokens, bm.num_free_blocks, seq.num_freed_blocks))
        assert bm.allocate(seq, 1)
    # next position p reads keys p - 5.. : block 0 (keys 0-3) is unread from p = 9, block 1 from p = 13
    assert [(p, freed) for p, _, freed in held] == [(9, 1), (10, 1), (11, 1), (12, 1), (13, 2), (14, 2), (15, 2),
                                                     (16, 2), (17, 3), (18, 3), (19, 3), (20, 3)]
    assert [free for _, free, _ in held] == [8 - (-(-p // BS) - freed) for p, _, freed in held]


def test_a_shared_block_is_freed_once_out_of_every_window():
    """Window 6: two requests share blocks 0 and 1 of a prefix; block 1 returns to the pool only when the
    second of them has passed it."""
    bm = BlockManager(10, BS, window=6)
    first = make_seq(list(range(9)), 1)
    fill(bm, first)  # next position 9 reads keys 4 on: block 0 is freed, cached
    assert first.block_table[0] == FREED and bm.blocks[first.block_table[1]].ref_count == 1
    second = make_seq(list(range(9)) + [50, 51], 2)
    fill(bm, second)  # hits blocks 0 and 1; at 11 it reads keys 6 on: block 0 freed again
    shared = bm.blocks[first.block_table[1]]
    assert second.block_table[:2] == [FREED, shared.block_id] and shared.ref_count == 2
    free_before = bm.num_free_blocks
    for seq, expected_refs in [(first, 1), (second, 0)]:
        seq.num_computed_tokens = 13  # reads keys 8 on: block 1 (keys 4-7) is behind
        bm.free_out_of_window(seq)
        assert seq.block_table[1] == FREED and shared.ref_count == expected_refs
    assert bm.num_free_blocks == free_before + 1 and list(bm.free_queue)[-1] is shared  # cached: kept longest


def owner_blocks(bm: BlockManager, tokens: list[int]) -> list[int]:
    """The cached blocks of tokens' full blocks, in order."""
    probe = make_seq(tokens, 99)
    hashes = bm._block_hashes(probe, len(tokens) // BS)
    return [bm.cached[h].block_id for h in hashes]


def test_prefix_hit_needs_only_the_blocks_in_the_window():
    """Blocks 0-2 of a cached prefix were evicted, 3-5 are cached: with a window of 6 (blocks of 4) a request
    whose first new token is at 24 reads keys 19 on (blocks 4 and 5): it hits 6 blocks and takes 2. Without a
    window the evicted block 0 ends the hit."""
    tokens = list(range(6 * BS)) + [99]
    for window, expected_hits, expected_taken in [(6, 6, 2), (0, 0, 0)]:
        bm = BlockManager(8, BS, window)
        owner = make_seq(tokens, 1)
        assert bm.allocate(owner, len(tokens))
        owner.num_computed_tokens = len(tokens)
        bm.commit(owner)
        bm.free(owner)
        for block_id in owner_blocks(bm, tokens)[:3]:  # evict blocks 0-2 from the cache
            block = bm.blocks[block_id]
            del bm.cached[block.hash]
            block.hash = block.token_ids = None
        again = make_seq(tokens, 2)
        hits = bm.find_cached_prefix(again)
        assert len(hits) == expected_hits and sum(block is not None for block in hits) == expected_taken
        assert bm.allocate(again, 1, hits)
        assert again.block_table[:expected_hits - expected_taken] == [FREED] * (expected_hits - expected_taken)
        assert again.num_freed_blocks == expected_hits - expected_taken
        bm.free(again)
        assert bm.num_free_blocks == 8 and all(block.ref_count == 0 for block in bm.blocks)
