"""Grammars for structured outputs and forced tool calls: JSON schemas compiled by xgrammar.

One compiler per served model, made at start-up from its tokenizer and the model's vocabulary size (the LM
head may have more rows than the tokenizer has tokens; xgrammar never allows those). It keeps what it compiled,
so a schema sent again costs a lookup. Each choice of a request gets its own GrammarConstraint (an xgrammar
GrammarMatcher), the per-request object the engine fills token masks from and advances with each token it
takes (engine/constraints.py).

The grammars write compact JSON (", " and ": " as separators, no other whitespace), and strict mode allows
no property a schema does not list: both narrow what a schema allows to outputs that still satisfy it, and
keep a small model sampled at a high temperature from wandering into endless whitespace or extra keys.
"""
import json
import re
import warnings

import xgrammar

from handler.chat import RequestError

CACHE_LIMIT_BYTES = 256 << 20  # compiled grammars kept for reuse; the least recently used go first
LIBRARY_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[21:30:24] /project/cpp/x.cc:4944: " before a message


class Grammars:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
        """stop_token_ids: the tokens that end a reply; a grammar allows them once its text is complete. A model
        without any (a bare tokenizer) still gets the token bytes that logprobs report, but no grammars."""
        self.vocab_size = vocab_size
        self.can_constrain = bool(stop_token_ids)
        with warnings.catch_warnings():  # without stop tokens xgrammar warns that it found none
            warnings.simplefilter("ignore")
            self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                stop_token_ids=list(stop_token_ids) or None)
        self.compiler = xgrammar.GrammarCompiler(self.info, cache_limit_bytes=CACHE_LIMIT_BYTES)
        self.token_bytes: list[bytes] = self.info.decoded_vocab  # each token's exact bytes

    def compile_json_schema(self, schema: dict, field: str) -> xgrammar.CompiledGrammar:
        """The grammar of a JSON schema; a schema xgrammar cannot compile is the request's error, naming field."""
        try:
            return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
        except (RuntimeError, ValueError, TypeError) as exc:
            message = LIBRARY_PREFIX.sub("", str(exc)).strip()
            raise RequestError(f"{field}: xgrammar cannot compile this JSON schema: {message}") from None



class GrammarConstraint:
    """One choice's grammar as the engine drives it (engine/constraints.py)."""

    __slots__ = ("matcher",)
    batch: xgrammar.BatchGrammarMatcher | None = None  # fills many rows in parallel threads; made on first use

    def __init__(self, compiled: xgrammar.CompiledGrammar):
        self.matcher = xgrammar.GrammarMatcher(compiled)

    def accept_token(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    @classmethod
    def fill_bitmasks(cls, constraints: list["GrammarConstraint"], bitmask, rows: list[int]) -> None:
        if cls.batch is None:
            cls.batch = xgrammar.BatchGrammarMatcher()
        cls.batch.batch_fill_next_token_bitmask([c.matcher for c in constraints], bitmask, rows)
