"""Grammars for structured outputs and forced tool calls: JSON schemas compiled by xgrammar.

One Grammars per served model, made at start-up from its tokenizer and the model's vocabulary size (the LM
head may have more rows than the tokenizer has tokens; xgrammar never allows those). Schemas compile in child
processes within the operator's time budget (handler/grammar_compiler.py); what they compiled is kept here by
schema, with the JSON they sent it as (what a data-parallel engine's copy is built from), so a schema sent again
costs a lookup. Each choice of a request gets its own GrammarConstraint (an xgrammar GrammarMatcher), the
per-request object the engine fills token masks from and advances with each token it takes (engine/constraints.py).

The grammars write compact JSON (", " and ": " as separators, no other whitespace), and strict mode allows
no property a schema does not list: both narrow what a schema allows to outputs that still satisfy it, and
keep a small model sampled at a high temperature from wandering into endless whitespace or extra keys.
"""
import functools
import warnings
from collections import OrderedDict

import xgrammar

from daemon_protocol import RequestError
from engine.sent_once import SentOnce
from handler.grammar_compiler import CompileRefused, CompileTimeout, GrammarCompilerPool
from handler.limits import RequestLimits

CACHE_LIMIT_BYTES = 256 << 20  # compiled grammars (and their JSON) kept for reuse; the least recently used go first
COMPILE_PROCESSES = 2  # grammars compiled at once


class Grammars:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...],
                 max_grammar_bytes: int = RequestLimits.max_grammar_bytes):
        """stop_token_ids: the tokens that end a reply; a grammar allows them once its text is complete. A model
        without any (a bare tokenizer) still gets the token bytes that logprobs report, but no grammars.
        max_grammar_bytes: the largest compiled grammar a request may have (HFENDPOINT_MAX_GRAMMAR_BYTES)."""
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.max_grammar_bytes = max_grammar_bytes
        self.can_constrain = bool(stop_token_ids)
        with warnings.catch_warnings():  # without stop tokens xgrammar warns that it found none
            warnings.simplefilter("ignore")
            self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                stop_token_ids=list(stop_token_ids) or None)
        self.token_bytes: list[bytes] = self.info.decoded_vocab  # each token's exact bytes
        self._pool: GrammarCompilerPool | None = None
        self._cache: OrderedDict[str, tuple[xgrammar.CompiledGrammar, SentOnce]] = OrderedDict()  # by schema, with JSON
        self._cache_bytes = 0

    def made_for(self, vocab_size: int, stop_token_ids: tuple[int, ...], max_grammar_bytes: int) -> bool:
        """Whether these are the grammars of that vocabulary size, stop tokens and grammar size limit."""
        return (self.vocab_size, self.stop_token_ids, self.max_grammar_bytes) == (vocab_size, tuple(stop_token_ids),
                                                                                  max_grammar_bytes)

    async def compile_json_schema(self, schema: str, field: str, timeout: float) -> xgrammar.CompiledGrammar:
        """The grammar of a JSON schema (as JSON text); a schema xgrammar cannot compile, that no value satisfies,
        or that takes longer than timeout seconds to compile is the request's error, naming field."""
        if schema in self._cache:
            self._cache.move_to_end(schema)
            return self._cache[schema][0]
        try:
            compiled, serialized = await self.start_compilers().compile(schema, timeout)
        except CompileRefused as exc:
            raise RequestError(f"{field}: {exc}", param=field) from None
        except CompileTimeout:
            raise RequestError(f"{field}: this JSON schema's grammar did not compile within {timeout:g} s (the "
                               "server's HFENDPOINT_GRAMMAR_COMPILE_TIMEOUT); simplify the schema",
                               param=field) from None
        self._remember(schema, compiled, serialized)
        return compiled

    def constraint(self, schema: str, compiled: xgrammar.CompiledGrammar) -> "GrammarConstraint":
        """A choice's constraint of the grammar compiled here for schema; while that grammar is kept, with the JSON
        it came as (a SentOnce), so that sending it to a data-parallel engine does not serialize it again for each
        request, nor send it again while that engine keeps it."""
        kept = self._cache.get(schema)
        grammar = kept[1] if kept is not None and kept[0] is compiled else None
        return GrammarConstraint(compiled, self.shared_info, grammar)

    @functools.cached_property
    def info_json(self) -> str:
        """The tokenizer info, serialized, for the compiling processes."""
        return self.info.serialize_json()

    @functools.cached_property
    def shared_info(self) -> SentOnce:
        """The serialized tokenizer info as each constraint carries it to a data-parallel engine's process
        (GrammarConstraint): down each engine's pipe once."""
        return SentOnce(self.info_json)

    def start_compilers(self) -> GrammarCompilerPool:
        """The compiling processes, started on first use (the handler starts them with the service)."""
        if self._pool is None:
            self._pool = GrammarCompilerPool(self.info_json, self._deserialize, COMPILE_PROCESSES,
                                             self.max_grammar_bytes)
        return self._pool

    def _deserialize(self, serialized: str) -> tuple[xgrammar.CompiledGrammar, str]:
        return xgrammar.CompiledGrammar.deserialize_json(serialized, self.info), serialized

    def _remember(self, schema: str, compiled: xgrammar.CompiledGrammar, serialized: str) -> None:
        self._cache[schema] = compiled, SentOnce(serialized)
        self._cache_bytes += kept_bytes(*self._cache[schema])
        while self._cache_bytes > CACHE_LIMIT_BYTES and len(self._cache) > 1:
            _, dropped = self._cache.popitem(last=False)
            self._cache_bytes -= kept_bytes(*dropped)


def kept_bytes(compiled: xgrammar.CompiledGrammar, serialized: SentOnce) -> int:
    return compiled.memory_size_bytes + len(serialized.value)


class GrammarConstraint:
    """One choice's grammar as the engine drives it (engine/constraints.py). It pickles, for an engine in another
    process (engine/data_parallel.py), as its grammar's JSON (which leaves the tokenizer info out) and its tokenizer
    info's, each a SentOnce (engine/sent_once.py: the tokenizer info crosses each engine's pipe once, a grammar once
    while the engine keeps it); the engine builds a matcher of its own from them, deserializing each once."""

    __slots__ = ("matcher", "broken", "compiled", "info", "grammar")
    batch: xgrammar.BatchGrammarMatcher | None = None  # fills many rows in parallel threads; made on first use

    def __init__(self, compiled: xgrammar.CompiledGrammar, info: SentOnce | None = None,
                 grammar: SentOnce | None = None):
        """info: the compiled grammar's tokenizer info, serialized; grammar: the grammar, serialized; each made from
        it where not given."""
        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.broken = False  # a token it did not allow came: its grammar allowed none (a dead end)
        self.compiled, self.info, self.grammar = compiled, info, grammar

    def __reduce__(self):
        info = self.info or SentOnce(self.compiled.tokenizer_info.serialize_json())
        return rebuilt_constraint, (self.grammar or SentOnce(self.compiled.serialize_json()), info)

    def accept_token(self, token_id: int) -> bool:
        accepted = self.matcher.accept_token(token_id)
        self.broken = self.broken or not accepted
        return accepted

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    @classmethod
    def fill_bitmasks(cls, constraints: list["GrammarConstraint"], bitmask, rows: list[int]) -> None:
        if cls.batch is None:
            cls.batch = xgrammar.BatchGrammarMatcher()
        cls.batch.batch_fill_next_token_bitmask([c.matcher for c in constraints], bitmask, rows)


def rebuilt_constraint(grammar: SentOnce, info: SentOnce) -> GrammarConstraint:
    """A pickled GrammarConstraint, in the process that unpickles it (the tokenizer info and each grammar
    deserialized once while this process keeps them)."""
    tokenizer_info = info.decoded(xgrammar.TokenizerInfo.deserialize_json)
    compiled = grammar.decoded(lambda value: xgrammar.CompiledGrammar.deserialize_json(value, tokenizer_info))
    return GrammarConstraint(compiled, info, grammar)
