"""Which of N data-parallel engines takes a request: the one holding the longest cached prefix of its prompt,
unless that engine is markedly busier than the least-loaded one (the rule SGLang's cache-aware router and
vLLM's prefix-aware routing follow).

The engines' prefix caches live in other processes, so the router keeps its own picture of each: the chained
hashes of the full blocks of every prompt it sent there, the most recently used kept up to the engine's pool
size (an engine evicts its least recently freed blocks; the picture forgets its least recently routed ones).
Load is the number of requests in flight on an engine, counted here from submission to finish.
"""
from collections import OrderedDict
from dataclasses import dataclass

from engine.block_manager import hash_block


@dataclass(frozen=True)
class Balance:
    """An engine with a cached prefix is "markedly busier" than the least-loaded one when it has more than
    `slack` requests beyond it and more than `ratio` times its load: either alone is no reason to give up a
    cache hit (a few requests more on a big batch cost little; twice nothing is still nothing)."""
    slack: int = 8
    ratio: float = 1.5


def block_hashes(tokens: list[int], block_size: int) -> list[int]:
    """Chained hashes of the prompt's full blocks, as the engines' block managers chain them: equal hashes at
    position i mean equal first i + 1 blocks."""
    hashes, parent = [], 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start:start + block_size])
        hashes.append(parent)
    return hashes


class PrefixRouter:
    def __init__(self, capacities: list[int], block_size: int, balance: Balance = Balance()):
        """capacities: each engine's KV pool in blocks (how much of what it was sent it can still hold)."""
        self.block_size, self.balance = block_size, balance
        self.capacities = capacities
        self.cached: list[OrderedDict[int, None]] = [OrderedDict() for _ in capacities]
        self.loads = [0] * len(capacities)

    def matched_blocks(self, engine: int, hashes: list[int]) -> int:
        """How many leading blocks of the prompt engine `engine` was sent before (and may still hold)."""
        cached = self.cached[engine]
        count = 0
        for h in hashes:
            if h not in cached:
                break
            count += 1
        return count

    def choose(self, tokens: list[int]) -> int:
        """The engine for a prompt: the longest cached prefix (the least loaded among equals), else, when it
        has none or is markedly busier, the least-loaded engine (the lowest index among equals)."""
        hashes = block_hashes(tokens, self.block_size)
        least = min(range(len(self.loads)), key=lambda engine: self.loads[engine])
        matches = [self.matched_blocks(engine, hashes) for engine in range(len(self.loads))]
        best = max(range(len(self.loads)), key=lambda engine: (matches[engine], -self.loads[engine]))
        if matches[best] == 0 or self._markedly_busier(best, least):
            return least
        return best

    def _markedly_busier(self, engine: int, least: int) -> bool:
        load, lowest = self.loads[engine], self.loads[least]
        return load > lowest + self.balance.slack and load > lowest * self.balance.ratio

    def started(self, engine: int, tokens: list[int]) -> None:
        """A request went to `engine`: its prompt's blocks are now (most recently) cached there."""
        self.loads[engine] += 1
        cached = self.cached[engine]
        for h in reversed(block_hashes(tokens, self.block_size)):  # a prompt's first blocks are forgotten last
            cached[h] = None
            cached.move_to_end(h)
        while len(cached) > self.capacities[engine]:
            cached.popitem(last=False)

    def finished(self, engine: int) -> None:
        self.loads[engine] -= 1
