"""Incremental detokenization with stop strings.

tokenizers' DecodeStream turns one token at a time into text and returns nothing while a character is
still incomplete (multi-byte UTF-8 split across byte-level or byte-fallback tokens), so no broken UTF-8
ever comes out. On top of it this module holds back text that may be the start of a stop string: a
client must never see any part of a stop string, even when its first characters arrive tokens earlier.
"""

from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Prompt tokens the stream starts from, so the first generated token decodes as it would after the
# prompt (decoders such as Metaspace strip a leading space from the first token of a sequence).
PRIMING_TOKENS = 8


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = ()):
        self._tokenizer = tokenizer
        self._stream = DecodeStream(ids=list(prompt_token_ids[-PRIMING_TOKENS:]), skip_special_tokens=True)
        self._stops = tuple(stop)
        self._stop_prefixes = frozenset(s[:k] for s in self._stops for k in range(1, len(s)))  # proper prefixes
        self._longest_prefix = max(map(len, self._stop_prefixes), default=0)
        self._pending = ""  # decoded, not released: it may be the start of a stop string
        self.stopped = False  # a stop string was found; the text released ends right before it

    def add(self, token_id: int) -> str:
        """The text this token releases. After a stop string completes, `stopped` is set and the
        text up to it has been released; feed no more tokens."""
        piece = self._stream.step(self._tokenizer, token_id) or ""  # None while a character is incomplete
        if not self._stops or not piece:
            return piece
        self._pending += piece
        hit = self._first_stop()
        if hit is not None:
            self.stopped = True
            released = self._pending[:hit]
            self._pending = ""
            return released
        return self._release(len(self._pending) - self._stop_prefix_length())

    def flush(self) -> str:
        """The held-back text, at the end of generation: no stop string can complete any more."""
        return self._release(len(self._pending))

    def _release(self, end: int) -> str:
        released, self._pending = self._pending[:end], self._pending[end:]
        return released

    def _first_stop(self) -> int | None:
        found = [i for i in (self._pending.find(stop) for stop in self._stops) if i >= 0]
        return min(found) if found else None

    def _stop_prefix_length(self) -> int:
        """Length of the longest end of the pending text that some stop string starts with."""
        for length in range(min(len(self._pending), self._longest_prefix), 0, -1):
            if self._pending[-length:] in self._stop_prefixes:
                return length
        return 0
