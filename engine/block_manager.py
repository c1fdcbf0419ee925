"""KV-cache block bookkeeping: ref-counted blocks, a free queue in eviction order, and the prefix cache.

Only metadata lives here; the KV tensors are indexed by block id in the model runner. A full block is
identified by an xxhash of its tokens chained on its parent block's hash, so equal hashes mean equal
prefixes; a block from a prompt's first image on also hashes the content of its images. Freed blocks keep
their hash and contents and join the back of the free queue: a later request with the same prefix takes them
back (a hit) until allocation reaches them at the front (eviction).

With a sliding window on every layer (`window` > 0), a query at position q reads only keys q - window < p <= q,
so a running request's blocks that lie wholly before the window of its next token are freed as it advances
(their entries in its block table become -1; the kernels never read them), and a prefix hit needs only the
blocks inside the window of the first token it computes to be cached: the earlier ones are never read.
"""
import numpy as np
import xxhash

from engine.images import image_keys
from engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "prev", "next")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None  # a cached block's tokens, to verify a hash hit
        self.prev: Block | None = None
        self.next: Block | None = None


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks: O(1) push at either end, pop at the front, and removal
    of any block (a prefix-cache hit on a free block)."""

    def __init__(self, blocks: list[Block]):
        self.head, self.tail = Block(-1), Block(-1)  # sentinels
        self.head.next, self.tail.prev = self.tail, self.head
        self.length = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        block = self.head.next
        while block is not self.tail:
            yield block
            block = block.next

    def _insert_after(self, anchor: Block, block: Block) -> None:
        block.prev, block.next = anchor, anchor.next
        anchor.next.prev = block
        anchor.next = block
        self.length += 1

    def append(self, block: Block) -> None:
        self._insert_after(self.tail.prev, block)

    def appendleft(self, block: Block) -> None:
        self._insert_after(self.head, block)

    def remove(self, block: Block) -> None:
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.length -= 1

    def popleft(self) -> Block:
        block = self.head.next
        assert block is not self.tail, "pop from an empty free queue"
        self.remove(block)
        return block


def hash_block(parent_hash: int, token_ids: list[int], image_keys: list[int] = ()) -> int:
    """image_keys: the content hashes of the images whose soft tokens the block's keys depend on
    (engine/images.py), after its tokens."""
    values = np.asarray(token_ids, dtype=np.int64).tobytes()
    if image_keys:
        values += np.asarray(image_keys, dtype=np.uint64).tobytes()
    return xxhash.xxh3_64_intdigest(values, seed=parent_hash)


FREED = -1  # a block-table entry whose block was freed (out of the window): never read


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, window: int = 0):
        """window: the model's sliding window when every layer has one (0: some layer reads all keys)."""
        self.block_size = block_size
        self.window = window
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, Block] = {}  # hash -> block holding that prefix
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix (a benchmark that repeats its workload must not hit its last run)."""
        if self.num_free_blocks != len(self.blocks):
            raise RuntimeError(f"{len(self.blocks) - self.num_free_blocks} KV blocks are in use: reset the prefix "
                               "cache only when no request is running")
        self.cached.clear()
        for block in self.blocks:
            block.hash = block.token_ids = None

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The chained hashes of seq's first num_blocks full blocks, each computed once per sequence."""
        size = self.block_size
        for i in range(len(seq.block_hashes), num_blocks):
            parent = seq.block_hashes[i - 1] if i else 0
            keys = image_keys(seq.images, (i + 1) * size) if seq.images else ()
            seq.block_hashes.append(hash_block(parent, seq.token_ids[i * size:(i + 1) * size], keys))
        return seq.block_hashes

    def num_out_of_window(self, num_tokens: int) -> int:
        """How many leading blocks no query at position num_tokens or later reads (0 without a window)."""
        return max(num_tokens - self.window + 1, 0) // self.block_size if self.window else 0

    def find_cached_prefix(self, seq: Sequence) -> list[Block | None]:
        """The longest prefix of seq's leading full blocks that the cache can serve: every block of it cached,
        or, with a window, every block inside the window of the first token left to compute (None stands for
        the blocks before it, which are never read; the chained hashes of the later ones cover their tokens).
        The last token is never covered, so the step that admits seq always computes at least one token and
        gets logits. A request that still needs its prompt's logits (prompt logprobs) is served nothing."""
        if seq.needs_prompt_logits:
            return []
        size = self.block_size
        num_blocks = (len(seq) - 1) // size
        found: list[Block | None] = []
        run_start = best = 0  # the first block of the current run of cached blocks; the longest servable prefix
        for i, h in enumerate(self._block_hashes(seq, num_blocks)[:num_blocks]):
            block = self.cached.get(h)
            if block is None or block.token_ids != tuple(seq.token_ids[i * size:(i + 1) * size]):
                if not self.window:
                    break
                block, run_start = None, i + 1
            found.append(block)
            if run_start <= self.num_out_of_window((i + 1) * size):
                best = i + 1
        num_unread = self.num_out_of_window(best * size)
        return [None] * num_unread + found[num_unread:best]

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_prefix: list[Block | None] = ()) -> bool:
        """Gives seq the blocks for its next num_new_tokens tokens (after the cached prefix, for a newly
        admitted seq; its None entries, out of the window, are FREED at once). Returns False and changes
        nothing when the free queue cannot cover it."""
        num_computed = seq.num_computed_tokens + len(cached_prefix) * self.block_size
        needed = -(-(num_computed + num_new_tokens) // self.block_size) - len(seq.block_table) - len(cached_prefix)
        if needed <= 0 and not cached_prefix:  # a decode inside its last block
            return True
        hits = [block for block in cached_prefix if block is not None]
        reclaimed = sum(1 for block in hits if block.ref_count == 0)  # hits sitting in the free queue
        if needed > len(self.free_queue) - reclaimed:
            return False
        seq.block_table.extend([FREED] * (len(cached_prefix) - len(hits)))
        seq.num_freed_blocks += len(cached_prefix) - len(hits)
        for block in hits:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1
            seq.block_table.append(block.block_id)
        seq.num_committed_blocks += len(cached_prefix)
        for _ in range(needed):
            seq.block_table.append(self._take_free_block().block_id)
        return True

    def _take_free_block(self) -> Block:
        block = self.free_queue.popleft()
        if block.hash is not None:  # evict the least recently freed cached prefix
            if self.cached.get(block.hash) is block:
                del self.cached[block.hash]
            block.hash = block.token_ids = None
        block.ref_count = 1
        return block

    def record_lookup(self, seq: Sequence, num_hit_tokens: int) -> None:
        self.num_queried_tokens += len(seq)
        self.num_hit_tokens += num_hit_tokens

    def commit(self, seq: Sequence) -> None:
        """Registers seq's blocks that its computed tokens have filled since the last call, so later
        requests can share them. Called after the step that wrote their KV."""
        size = self.block_size
        num_full = seq.num_computed_tokens // size
        if num_full <= seq.num_committed_blocks:  # no block filled (most decode steps)
            return
        hashes = self._block_hashes(seq, num_full)
        for i in range(seq.num_committed_blocks, num_full):
            if hashes[i] not in self.cached:  # else an equal block is cached already; keep that one
                block = self.blocks[seq.block_table[i]]
                block.hash, block.token_ids = hashes[i], tuple(seq.token_ids[i * size:(i + 1) * size])
                self.cached[block.hash] = block
        seq.num_committed_blocks = num_full

    def free_out_of_window(self, seq: Sequence) -> None:
        """With a window, frees seq's blocks that lie wholly before the window of its next token (position
        num_computed_tokens): no query of seq reads them again. Their block-table entries become FREED. A
        block that other requests share stays theirs (one reference less). Called after each step."""
        num_unread = min(self.num_out_of_window(seq.num_computed_tokens), len(seq.block_table))
        for i in range(seq.num_freed_blocks, num_unread):
            self._release(seq.block_table[i])
            seq.block_table[i] = FREED
        seq.num_freed_blocks = max(seq.num_freed_blocks, num_unread)

    def release_uncomputed(self, seq: Sequence) -> None:
        """Frees seq's blocks past its computed tokens: those a verification step took for draft tokens the
        model rejected. The block table is replaced, not shortened in place (step inputs rewrite a table they
        have not seen; engine/step_inputs.py)."""
        keep = -(-seq.num_computed_tokens // self.block_size)
        if keep < len(seq.block_table):
            for block_id in reversed(seq.block_table[keep:]):
                self._release(block_id)
            seq.block_table = seq.block_table[:keep]

    def free(self, seq: Sequence) -> None:
        """Drops seq's references, tail blocks first so they are evicted before the shared prefix."""
        for block_id in reversed(seq.block_table):
            if block_id != FREED:
                self._release(block_id)
        seq.block_table = []
        seq.num_committed_blocks = 0
        seq.num_freed_blocks = 0
        seq.num_computed_tokens = 0

    def _release(self, block_id: int) -> None:
        """One reference less; a block nobody holds joins the free queue: unhashed at the front (nothing to
        keep), cached at the back (kept longest)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            (self.free_queue.append if block.hash is not None else self.free_queue.appendleft)(block)
