"""Incremental detokenization with stop strings.

tokenizers' DecodeStream turns one token at a time into text and returns nothing while a character is
still incomplete (multi-byte UTF-8 split across byte-level or byte-fallback tokens), so no broken UTF-8
ever comes out. On top of it this module holds back text that may be the start of a stop string: a
client must never see any part of a stop string, even when its first characters arrive tokens earlier.
"""

from collections.abc import Mapping, Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from handler.text_markers import MarkerScanner

# Prompt tokens the stream starts from, so the first generated token decodes as it would after the
# prompt (decoders such as Metaspace strip a leading space from the first token of a sequence).
PRIMING_TOKENS = 8


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = (),
                 kept_tokens: Mapping[int, str] | None = None):
        """kept_tokens: special tokens whose text the reply needs (a tool-call marker such as Llama's
        <|python_tag|>), by id; every other special token decodes to nothing."""
        self._tokenizer = tokenizer
        self._stream = DecodeStream(ids=list(prompt_token_ids[-PRIMING_TOKENS:]), skip_special_tokens=True)
        self._stops = MarkerScanner(tuple(stop)) if stop else None
        self._kept = kept_tokens or {}
        self.stop_string: str | None = None  # the stop string found; the text released ends right before it

    def add(self, token_id: int) -> str:
        """The text this token releases. After a stop string completes, `stopped` is set and the
        text up to it has been released; feed no more tokens."""
        piece = self._stream.step(self._tokenizer, token_id) or ""  # None while a character is incomplete
        if token_id in self._kept:
            piece += self._kept[token_id]
        if self._stops is None or not piece:
            return piece
        released, self.stop_string, _ = self._stops.split(piece)
        return released

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    def flush(self) -> str:
        """The held-back text, at the end of generation: no stop string can complete any more."""
        return self._stops.flush() if self._stops is not None else ""
