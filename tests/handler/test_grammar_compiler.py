"""Grammar compiles in child processes: a time budget, abandoned when their request is cancelled, a cache by
schema, and xgrammar's warnings logged once per kind."""
import asyncio
import json
import logging
import pickle
import time

import pytest
import xgrammar

from handler.chat import RequestError
from handler.grammar import Grammars
from handler.library_warnings import library_warnings

pytestmark = pytest.mark.slow  # child processes
SLOW_SCHEMA = json.dumps({"enum": [f"value number {i}" for i in range(40_000)]})  # compiles for a minute or more
CITY = json.dumps({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})


@pytest.fixture(scope="module")
def grammars(smollm2_tokenizer):
    grammars = Grammars(smollm2_tokenizer, len(smollm2_tokenizer), (smollm2_tokenizer.eos_token_id,))
    yield grammars
    grammars.start_compilers().close()


def compile_schema(grammars, schema: str, timeout: float = 60.0):
    return asyncio.run(grammars.compile_json_schema(schema, "response_format", timeout))


def children(grammars) -> set[int]:
    return {child.pid for child in grammars.start_compilers()._children}


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_compile_past_its_budget_is_a_400_and_its_process_is_killed(grammars):
    compile_schema(grammars, CITY)  # the children have started
    before = children(grammars)
    started = time.monotonic()
    with pytest.raises(RequestError, match="did not compile within 1 s .*HFENDPOINT_GRAMMAR_COMPILE_TIMEOUT") as raised:
        compile_schema(grammars, SLOW_SCHEMA, timeout=1.0)
    assert time.monotonic() - started < 10 and raised.value.param == "response_format"
    wait_for(lambda: len(before - children(grammars)) == 1)  # the compiling child is gone, a fresh one replaces it
    assert compile_schema(grammars, json.dumps({"type": "integer"})) is not None, "the next compile goes on"


def test_a_cancelled_request_abandons_its_compile(grammars):
    compile_schema(grammars, CITY)
    before = children(grammars)

    async def cancel_midway():
        task = asyncio.ensure_future(grammars.compile_json_schema(SLOW_SCHEMA, "response_format", 600.0))
        await asyncio.sleep(1.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_midway())
    wait_for(lambda: len(before - children(grammars)) == 1)


def test_compiled_grammars_are_kept_by_schema(grammars):
    first = compile_schema(grammars, CITY)
    assert compile_schema(grammars, CITY) is first


def test_a_kept_grammars_constraint_travels_as_the_json_it_was_compiled_to(grammars, monkeypatch):
    """Pickled for a data-parallel engine, a constraint of a kept grammar carries the JSON the compiler sent (not
    serialized again for each request), from which the other side rebuilds a constraint of the same grammar."""
    compiled = compile_schema(grammars, CITY)

    def serialize_json(self):
        raise AssertionError("a kept grammar was serialized again")

    monkeypatch.setattr(xgrammar.CompiledGrammar, "serialize_json", serialize_json)
    rebuilt = pickle.loads(pickle.dumps(grammars.constraint(CITY, compiled)))
    assert rebuilt.matcher.accept_string('{"city": "Paris"}') and rebuilt.accept_token(grammars.stop_token_ids[0])
    assert rebuilt.is_terminated()
    assert not pickle.loads(pickle.dumps(grammars.constraint(CITY, compiled))).matcher.accept_string('{"town": "')


def test_xgrammar_warnings_are_logged_once_per_kind_with_a_count(grammars, caplog):
    schema = json.dumps({"type": "object", "properties": {
        f"p{i}": {"allOf": [{"type": "string"}, {"maxLength": 5}]} for i in range(30)}})
    kind = "xgrammar: Warning: Support for allOf with multiple options is still ongoing"
    before = library_warnings.counts().get(kind, 0)
    with caplog.at_level(logging.WARNING, logger="handler.library"):
        compile_schema(grammars, schema)
        wait_for(lambda: library_warnings.counts().get(kind, 0) >= before + 30)
    lines = [record.getMessage() for record in caplog.records if "allOf" in record.getMessage()]
    assert 1 <= len(lines) <= 2, lines  # the first, and at each power of ten reached


def test_a_grammar_past_the_size_budget_is_a_400(smollm2_tokenizer):
    """A short schema can compile to a grammar of tens of MB (an enum of thousands of strings)."""
    small = Grammars(smollm2_tokenizer, len(smollm2_tokenizer), (smollm2_tokenizer.eos_token_id,),
                     max_grammar_bytes=64 << 10)
    try:
        enum = json.dumps({"enum": [f"u{i}" for i in range(2000)]})
        with pytest.raises(RequestError, match=r"compiles to a grammar of \d+ KiB, more than this server's 64 KiB "
                                               r"\(HFENDPOINT_MAX_GRAMMAR_BYTES\)") as raised:
            compile_schema(small, enum)
        assert raised.value.param == "response_format"
        assert compile_schema(small, CITY) is not None
    finally:
        small.start_compilers().close()
