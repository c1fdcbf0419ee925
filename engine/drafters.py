"""Draft tokens without a second model: guesses of a request's next tokens that the target model verifies in
one step (engine/speculation.py). A drafter has

    propose(seq, k) -> list[int]   up to k tokens likely to follow seq.token_ids (may be fewer, or none)

keeping what it knows of a request in seq.draft_state. It learns a request's tokens only when it proposes for
it, catching up on those added since: a request costs a drafter nothing between its proposals (a drafting
step's, or one a plain step checks on the side, engine/speculation.py).

Prompt lookup (NgramDrafter) matches the last few tokens of the request against its own prompt and output and
proposes what followed the latest earlier occurrence: outputs that copy their prompt (code edits, summaries,
retrieval answers) are guessed many tokens at a time. While the request's new tokens are those its last
proposal copied, it goes on copying from there, as a copy does, rather than from wherever the last few tokens
occurred latest. SuffixDrafter does the same over the request's own tokens and, where they hold no match,
follows a depth-limited suffix trie over the recent outputs of all requests, so answers repeated across
requests are guessed too (as in suffix decoding).
"""
from array import array
from collections import deque

TOKEN_BYTES = array("i").itemsize  # a token id as a native int in a request's byte string


class TokenBytes:
    """A request's tokens as one byte string, extended with the tokens added since its last use, so that a
    match of the last n tokens is a search in C (bytearray.rfind) rather than an index kept per token; and
    where the last proposal copied from (copied_from, the position of its first token) when the request had
    copied_at tokens."""

    __slots__ = ("data", "length", "copied_from", "copied_at")

    def __init__(self):
        self.data, self.length = bytearray(), 0
        self.copied_from: int | None = None
        self.copied_at = 0

    def catch_up(self, tokens: list[int]) -> None:
        if len(tokens) > self.length:
            self.data += array("i", tokens[self.length:]).tobytes()
            self.length = len(tokens)

    def latest_match(self, n: int) -> int | None:
        """Where the token after the latest earlier occurrence of the last n tokens is, or None."""
        width = n * TOKEN_BYTES
        pattern = bytes(self.data[-width:])
        end = len(self.data) - TOKEN_BYTES  # an earlier occurrence ends before the last token
        while (found := self.data.rfind(pattern, 0, end)) >= 0:
            if found % TOKEN_BYTES == 0:  # aligned on a token, not straddling two
                return found // TOKEN_BYTES + n
            end = found + width - 1
        return None


class NgramDrafter:
    """Prompt lookup: what follows the source the last proposal copied from, while the tokens since are that
    source's; else the longest of the request's last max_n..min_n tokens that occurred before, and what followed
    its latest occurrence. A single token (min_n 1) is a weaker clue than a few, but a request's drafts that it
    misleads are accepted less and so drafted shorter (engine/speculation.py's draft_length), while a step where
    nothing is found gains nothing at all."""

    def __init__(self, min_n: int = 1, max_n: int = 4):
        self.lengths = range(max_n, min_n - 1, -1)  # longest match first

    def propose(self, seq, k: int) -> list[int]:
        if seq.draft_state is None:
            seq.draft_state = TokenBytes()
        return self.lookup(seq.token_ids, seq.draft_state, k)

    def lookup(self, tokens: list[int], known: TokenBytes, k: int) -> list[int]:
        known.catch_up(tokens)
        start = still_copying(tokens, known)
        if start is None:
            start = next((found for n in self.lengths if len(tokens) > n
                          and (found := known.latest_match(n)) is not None), None)
        known.copied_from, known.copied_at = start, len(tokens)
        return tokens[start:start + k] if start is not None else []


def still_copying(tokens: list[int], known: TokenBytes) -> int | None:
    """Where the copy of the last proposal's source goes on, if every token since that proposal is the source's
    (the accepted draft tokens and the model's own next one), and the source has tokens left."""
    source = known.copied_from
    if source is None:
        return None
    added = len(tokens) - known.copied_at
    follows = source + added
    if follows >= len(tokens) or tokens[known.copied_at:] != tokens[source:follows]:
        return None
    return follows


class SuffixState:
    """What SuffixDrafter knows of a request: its tokens for prompt lookup, and how many the trie holds."""

    __slots__ = ("tokens", "inserted")

    def __init__(self, num_prompt_tokens: int):
        self.tokens, self.inserted = TokenBytes(), num_prompt_tokens  # the trie takes outputs only


class SuffixDrafter:
    """Prompt lookup first; else a suffix trie of depth `depth` over recent outputs, stored as the counts of
    each token following each context of depth, depth/2, ... min_match tokens (halving, so that a token costs
    a few insertions, not one per length); the oldest outputs are forgotten once the trie holds more than
    `capacity` output tokens. A proposal from the trie walks from the longest context that matches the
    request's tokens, taking the most frequent next token each time.

    What was inserted is remembered as spans of requests' token lists, one per proposal, not per count: an
    object per inserted count would make Python's garbage collector walk them all, again and again."""

    def __init__(self, depth: int = 8, capacity: int = 1 << 20, min_match: int = 2):
        self.depth, self.capacity = depth, capacity
        self.lengths = [depth >> i for i in range(depth.bit_length()) if depth >> i >= min_match]  # longest first
        self.own = NgramDrafter(min_n=2)  # a single token's match would pass over the trie's longer context
        self.next_counts: dict[tuple[int, ...], dict[int, int]] = {}
        self.spans: deque[tuple[list[int], int, int]] = deque()  # (a request's tokens, start, end), oldest first
        self.num_inserted = 0  # output tokens the spans hold

    def propose(self, seq, k: int) -> list[int]:
        if seq.draft_state is None:
            seq.draft_state = SuffixState(seq.num_prompt_tokens)
        own = self.own.lookup(seq.token_ids, seq.draft_state.tokens, k)
        self._insert(seq.token_ids, seq.draft_state)
        if own:
            return own
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
        for m in self.lengths:
            if m <= longest and m <= len(context) and (counts := self.next_counts.get(tuple(context[-m:]))):
                return max(counts, key=counts.__getitem__), m
        return None, 0

    def _insert(self, tokens: list[int], state: SuffixState) -> None:
        """Adds the request's output tokens since its last proposal, then forgets the oldest spans past
        capacity."""
        start, end = state.inserted, len(tokens)
        if start >= end:
            return
        self._count(tokens, start, end, 1)
        self.spans.append((tokens, start, end))
        self.num_inserted += end - start
        state.inserted = end
        while self.num_inserted > self.capacity:
            old_tokens, old_start, old_end = self.spans.popleft()
            self._count(old_tokens, old_start, old_end, -1)
            self.num_inserted -= old_end - old_start

    def _count(self, tokens: list[int], start: int, end: int, change: int) -> None:
        """Adds `change` to the count of each token of tokens[start:end] under its contexts of the trie's
        lengths, dropping counts that reach zero."""
        for i in range(start, end):
            token = tokens[i]
            for m in self.lengths:
                if m > i:
                    continue
                key = tuple(tokens[i - m:i])
                counts = self.next_counts.setdefault(key, {})
                counts[token] = counts.get(token, 0) + change
                if not counts[token]:
                    del counts[token]
                    if not counts:
                        del self.next_counts[key]


DRAFTERS = {"ngram": NgramDrafter, "suffix": SuffixDrafter}
