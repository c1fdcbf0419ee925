"""A completion's choices from engine outputs to reply chunks: reasoning, tool calls, logprobs, finish reasons,
and how chunks of several choices end (docs/chat-extensions.md)."""
import asyncio

import pytest

from daemon_protocol import RequestError
from engine import RequestOutput
from handler.choices import ChatReplies, Choice
from handler.grammar import Grammars
from handler.output_plan import OutputPlan
from handler.tools import ToolPlan

REPLY = ('<think>\nThe user wants a call.\n</think>\n\nSure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n'
         '</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')


def outputs(request_id, token_ids, finish_reason, logprobs=False):
    """One engine output per token, the last one finishing."""
    last = len(token_ids) - 1
    return [RequestOutput(request_id, [token], finish_reason if i == last else None, None, 3, i + 1, 0,
                          [(-0.5, [token], [-0.5])] if logprobs else None) for i, token in enumerate(token_ids)]


@pytest.fixture(scope="module")
def grammars(smollm2_tokenizer):
    return Grammars(smollm2_tokenizer, len(smollm2_tokenizer), (smollm2_tokenizer.eos_token_id,))


@pytest.fixture(scope="module")
def replies(smollm2_tokenizer, grammars):
    return ChatReplies(smollm2_tokenizer, grammars.token_bytes, grammars)


def choice(replies, plan, index=0, stop=()):
    request = type("Request", (), {"prompt_token_ids": [1, 2, 3], "stop": stop})
    return Choice(index, replies._detokenizer(request), plan, replies.logprobs, replies.grammars)


def run(choice, token_outputs):
    chunks = [chunk for output in token_outputs if (chunk := choice.consume([output]))]
    return chunks, "".join(c.get("reasoning_content", "") for c in chunks), "".join(c["content"] for c in chunks)


def test_reasoning_content_and_tool_calls_apart(smollm2_tokenizer, replies):
    ids = smollm2_tokenizer.encode(REPLY) + [smollm2_tokenizer.eos_token_id]
    plan = OutputPlan(reasoning=False, tools=ToolPlan([], "hermes"))
    chunks, reasoning, content = run(choice(replies, plan), outputs("r", ids, "stop"))
    assert (reasoning, content) == ("The user wants a call.", "Sure.")
    calls = [delta for chunk in chunks for delta in chunk.get("tool_calls", ())]
    assert [d["function"]["name"] for d in calls if "id" in d] == ["f", "g"]
    assert chunks[-1]["choice_finish_reason"] == "tool_calls"
    assert "<" not in content + reasoning


def test_without_parallel_calls_the_choice_ends_after_its_first_call(smollm2_tokenizer, replies):
    ids = smollm2_tokenizer.encode(REPLY)
    plan = OutputPlan(reasoning=False, tools=ToolPlan([], "hermes", parallel=False))
    one = choice(replies, plan)
    chunks, _, _ = run(one, outputs("r", ids, None))
    assert one.finish_reason == "tool_calls" and not one.completion.engine_finished, "to be aborted"
    assert [d["function"]["name"] for c in chunks for d in c.get("tool_calls", ()) if "id" in d] == ["f"]
    assert sum("choice_finish_reason" in chunk for chunk in chunks) == 1


def test_the_chunk_that_a_stop_string_ends_names_it(smollm2_tokenizer, replies):
    ids = smollm2_tokenizer.encode("Paris is nice. Lyon too.")
    chunks, _, content = run(choice(replies, OutputPlan(), stop=("Lyon", "nice")), outputs("r", ids, None))
    assert content == "Paris is "
    assert [(c.get("choice_finish_reason"), c.get("stop_sequence")) for c in chunks][-1] == ("stop", "nice")
    ended_by_eos = run(choice(replies, OutputPlan(), stop=("Lyon",)), outputs("r", ids[:3], "stop"))[0]
    assert "stop_sequence" not in ended_by_eos[-1]


def test_logprobs_cover_the_text_tokens_not_the_stop_token(smollm2_tokenizer, replies):
    ids = smollm2_tokenizer.encode("Paris is nice.") + [smollm2_tokenizer.eos_token_id]
    chunks, _, content = run(choice(replies, OutputPlan(logprobs=0)), outputs("r", ids, "stop", True))
    entries = [entry for chunk in chunks for entry in chunk.get("logprobs", {}).get("content", [])]
    assert "".join(entry["token"] for entry in entries) == content == "Paris is nice."
    assert all(entry["logprob"] == -0.5 and entry["top_logprobs"][0]["token"] == entry["token"] for entry in entries)


def test_only_the_requests_last_chunk_has_finish_reason_and_usage(smollm2_tokenizer, replies):
    plan = OutputPlan(n=2)
    choices = {f"r/{i}": choice(replies, plan, i) for i in range(2)}
    first = smollm2_tokenizer.encode("One two") + [smollm2_tokenizer.eos_token_id]
    second = smollm2_tokenizer.encode("Three")
    batch = outputs("r/0", first[:1], None) + outputs("r/1", second, "length")
    chunks = ChatReplies._chunks(batch, choices, 2, 3)
    assert [(c["index"], c.get("choice_finish_reason"), c.get("finish_reason")) for c in chunks] == [
        (0, None, None), (1, "length", None)]
    chunks = ChatReplies._chunks(outputs("r/0", first[1:], "stop"), choices, 2, 3)
    assert [(c["index"], c.get("choice_finish_reason"), c.get("finish_reason")) for c in chunks] == [
        (0, None, "stop")]
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": len(first) + len(second),
                                   "total_tokens": 3 + len(first) + len(second)}


def test_a_grammar_that_dead_ends_is_the_schemas_fault(smollm2_tokenizer, replies, grammars):
    """A token the grammar refused (it allowed none) ends the engine request with "error": the reply is a 400
    naming the schema's field, not an engine failure."""
    grammar = asyncio.run(grammars.compile_json_schema('{"type": "string"}', "response_format", 60.0))
    one = choice(replies, OutputPlan(schema='{"type": "string"}', schema_field="response_format", grammar=grammar))
    token = smollm2_tokenizer.convert_tokens_to_ids("x")  # a string starts with '"'
    assert not one.constraint.accept_token(token)
    failed = RequestOutput("r", [token], "error", f"token {token} broke the request's constraint", 3, 1, 0)
    with pytest.raises(RequestError, match="response_format: the JSON schema's grammar reached a point") as raised:
        one.consume([failed])
    assert raised.value.param == "response_format" and raised.value.status == 400


def test_a_choices_constraint_carries_its_kept_grammars_json(replies, grammars):
    """What goes to a data-parallel engine: the JSON the grammar was compiled to, kept with it (handler/grammar.py)."""
    schema = '{"type": "string"}'
    grammar = asyncio.run(grammars.compile_json_schema(schema, "response_format", 60.0))
    one = choice(replies, OutputPlan(schema=schema, schema_field="response_format", grammar=grammar))
    assert one.constraint.grammar.value == grammar.serialize_json()
