"""Draft tokens without a second model: guesses of a request's next tokens that the target model verifies in
one step (engine/speculation.py). A drafter has

    propose(seq, k) -> list[int]   up to k tokens likely to follow seq.token_ids (may be fewer, or none)

keeping what it knows of a request in seq.draft_state.

Prompt lookup (NgramDrafter) matches the last few tokens of the request against its own prompt and output and
proposes what followed the latest earlier occurrence: outputs that copy their prompt (code edits, summaries,
retrieval answers) are guessed many tokens at a time. SuffixDrafter keeps a depth-limited suffix trie over
the recent prompts and outputs of all requests and follows the most frequent continuation of the longest
suffix of the request it finds there, so repeated answers across requests are guessed too.
"""
from collections import deque


class NgramDrafter:
    """Prompt lookup. Each request keeps, per n-gram length, where each n-gram of its tokens last ended,
    updated with the tokens added since its last proposal, so a proposal costs a few dictionary lookups."""

    def __init__(self, min_n: int = 2, max_n: int = 4):
        self.lengths = range(max_n, min_n - 1, -1)  # longest match first

    def propose(self, seq, k: int) -> list[int]:
        tokens = seq.token_ids
        state = seq.draft_state
        if state is None:
            state = seq.draft_state = [{n: {} for n in self.lengths}, 0]
        ends, indexed = state
        for end in range(max(indexed, 1), len(tokens)):  # n-grams that end before the last token
            for n, index in ends.items():
                if end >= n:
                    index[tuple(tokens[end - n:end])] = end
        state[1] = len(tokens)
        for n, index in ends.items():
            end = index.get(tuple(tokens[-n:])) if len(tokens) > n else None
            if end is not None:
                return tokens[end:end + k]
        return []


class SuffixDrafter:
    """A suffix trie of depth `depth` over recent token streams, stored as the counts of each token following
    each context of 1..depth tokens; the oldest `capacity` insertions are forgotten first. A proposal walks
    from the longest context that matches the request's tokens, taking the most frequent next token each time."""

    def __init__(self, depth: int = 8, capacity: int = 1 << 20, min_match: int = 2):
        self.depth, self.capacity, self.min_match = depth, capacity, min_match
        self.next_counts: dict[tuple[int, ...], dict[int, int]] = {}
        self.inserted: deque[tuple[tuple[int, ...], int]] = deque()

    def propose(self, seq, k: int) -> list[int]:
        self._insert(seq)
        context = seq.token_ids[-self.depth:]
        draft: list[int] = []
        match = self.depth
        for _ in range(k):
            token, match = self._continuation(context, match + 1)
            if token is None:
                break
            draft.append(token)
            context = context[1 - self.depth:] + [token] if len(context) >= self.depth else context + [token]
        return draft

    def _continuation(self, context: list[int], longest: int) -> tuple[int | None, int]:
        """The most frequent token after the longest suffix of context (at most `longest` tokens) the trie
        holds, and that suffix's length."""
        for m in range(min(longest, self.depth, len(context)), self.min_match - 1, -1):
            counts = self.next_counts.get(tuple(context[-m:]))
            if counts:
                return max(counts, key=counts.__getitem__), m
        return None, 0

    def _insert(self, seq) -> None:
        """Adds the request's tokens since its last proposal, each under the contexts of 1..depth tokens
        before it."""
        tokens, start = seq.token_ids, seq.draft_state or 1
        for i in range(start, len(tokens)):
            token = tokens[i]
            for m in range(1, min(self.depth, i) + 1):
                key = tuple(tokens[i - m:i])
                counts = self.next_counts.setdefault(key, {})
                counts[token] = counts.get(token, 0) + 1
                self.inserted.append((key, token))
        seq.draft_state = len(tokens)
        while len(self.inserted) > self.capacity:
            self._remove(*self.inserted.popleft())

    def _remove(self, key: tuple[int, ...], token: int) -> None:
        counts = self.next_counts[key]
        counts[token] -= 1
        if not counts[token]:
            del counts[token]
            if not counts:
                del self.next_counts[key]


DRAFTERS = {"ngram": NgramDrafter, "suffix": SuffixDrafter}
