"""Our front turns the extended chat payloads (docs/chat-extensions.md) into OpenAI's JSON and SSE:
choices by index, tool calls, reasoning_content, logprobs, per-choice finish reasons, usage."""
import json

import openai
import pytest

from front.openai_chat import ChatReply, stream_choice
from front.server import compact_json, sse, sse_framing

KEY = "test-key"
ASK = [{"role": "user", "content": "weather?"}]


@pytest.fixture(scope="module")
def client(front_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{front_server.base_url}/v1", api_key=KEY, max_retries=0, timeout=20)


@pytest.mark.slow  # our front and its worker as processes
def test_non_streaming_choices_carry_tool_calls_reasoning_and_logprobs(client):
    reply = client.chat.completions.create(model="features", messages=ASK)
    first, second = reply.choices
    assert (first.index, second.index) == (0, 1)
    assert first.finish_reason == "tool_calls" and second.finish_reason == "length"
    assert first.message.content is None, "a reply of tool calls only has no content"
    assert first.message.reasoning_content == "The user wants the weather."
    [call] = first.message.tool_calls
    assert (call.id, call.type, call.function.name) == ("call_1", "function", "weather")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert second.message.content == "Hi!" and second.message.tool_calls is None
    [entry] = second.logprobs.content
    assert (entry.token, entry.logprob, entry.bytes) == ("Hi", -0.25, [72, 105])
    assert [top.token for top in entry.top_logprobs] == ["Hi", "Hello"]
    assert first.logprobs is None
    assert reply.usage.total_tokens == 14


@pytest.mark.slow
def test_streaming_sends_one_chunk_per_reply_chunk_with_its_choice(client):
    chunks = list(client.chat.completions.create(model="features", messages=ASK, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    choices = [chunk.choices[0] for chunk in chunks[:-1]]
    assert [c.index for c in choices] == [0, 1, 0, 0, 0, 1]
    assert [c.delta.role for c in choices] == ["assistant", "assistant", None, None, None, None]
    assert [c.finish_reason for c in choices] == [None, None, None, None, "tool_calls", "length"]
    assert choices[0].delta.reasoning_content == "The user wants the weather."
    assert choices[2].delta.tool_calls[0].function.name == "weather"
    assert "".join(c.delta.tool_calls[0].function.arguments for c in choices[2:5]) == '{"city": "Paris"}'
    assert choices[1].logprobs.content[0].token == "Hi"


def test_chunks_merge_by_choice_and_call_index():
    reply = ChatReply()
    for payload in ({"index": 1, "content": "b"}, {"content": "a", "tool_calls": [
            {"index": 1, "id": "call_2", "type": "function", "function": {"name": "g", "arguments": ""}},
            {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"index": 0, "content": "", "tool_calls": [{"index": 1, "function": {"arguments": "[1]"}}],
             "choice_finish_reason": "tool_calls"},
            {"index": 1, "content": "c", "finish_reason": "stop", "usage": {"total_tokens": 3}}):
        reply.add(payload)
    first, second = reply.choices()
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in first["message"]["tool_calls"]] \
        == [("call_1", "f", "{}"), ("call_2", "g", "[1]")]
    assert (first["message"]["content"], first["finish_reason"]) == ("a", "tool_calls")
    assert (second["message"], second["finish_reason"]) == ({"role": "assistant", "content": "bc"}, "stop")
    assert reply.usage == {"total_tokens": 3} and reply.finish_reason == "stop" and reply.content(1) == "bc"


def test_a_plain_chunk_streams_as_before():
    started = set()
    assert stream_choice({"content": "Hi", "finish_reason": None}, started) == {
        "index": 0, "delta": {"role": "assistant", "content": "Hi"}, "finish_reason": None, "logprobs": None}
    assert stream_choice({"content": "", "finish_reason": "stop"}, started)["delta"] == {"content": ""}


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_streams_sse_framing_frames_each_choice_as_sse_encodes_the_whole_chunk(include_usage):
    """The front encodes the keys every event of a stream shares once; the events are the bytes sse() writes."""
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m\u00e9"}
    before, after = sse_framing(base, include_usage)
    for payload in ({"content": "h\u00e9\n\"x\""}, {"content": "", "finish_reason": "stop", "usage": {"x": 1}}):
        choice = stream_choice(payload, set())
        whole = sse({**base, "choices": [choice], **({"usage": None} if include_usage else {})})
        assert (before + compact_json(choice) + after).encode() == whole
