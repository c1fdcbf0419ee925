"""A drafter for speculative-decoding tests, shared by the test folders: random weights copy little, so
drafts that the model accepts come from its own greedy output."""
import random

from engine.sequence import Sequence


class CorruptedOracle:
    """Proposes the model's greedy continuation (from a run without drafts), one draft in two with a token
    replaced by another: accepted runs of every length, and rejections at every position."""

    def __init__(self, continuations: list[list[int]], vocab_size: int):
        self.continuations, self.vocab_size = continuations, vocab_size
        self.rng = random.Random(0)

    def propose(self, seq: Sequence, k: int) -> list[int]:
        done = seq.num_output_tokens
        draft = list(self.continuations[seq.request_id][done:done + k])
        if draft and self.rng.random() < 0.5:
            i = self.rng.randrange(len(draft))
            draft[i] = (draft[i] + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size
        return draft
