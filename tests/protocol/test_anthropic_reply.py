"""Reply chunks (docs/chat-extensions.md) -> Anthropic's stream events and message (front/anthropic.py): thinking,
text and tool_use blocks in order, stop reasons, usage."""
import pytest

from front.anthropic import MessageEvents

USAGE = {"prompt_tokens": 7, "completion_tokens": 9, "total_tokens": 16}
CHUNKS = [
    {"content": "", "reasoning_content": "The user wants ", "finish_reason": None},
    {"content": "", "reasoning_content": "the weather.", "finish_reason": None},
    {"content": "Let me ", "finish_reason": None},
    {"content": "look.", "finish_reason": None, "tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": '}}]},
    {"content": "", "finish_reason": None, "tool_calls": [
        {"index": 0, "function": {"arguments": '"Paris"}'}},
        {"index": 1, "id": "call_2", "type": "function", "function": {"name": "clock", "arguments": ""}}]},
    {"content": "", "finish_reason": "tool_calls", "usage": USAGE, "tool_calls": [
        {"index": 1, "function": {"arguments": '{"tz": "U'}}]},
]


def replay(chunks):
    events = MessageEvents("m")
    return events, events.start() + [event for chunk in chunks for event in events.add(chunk)]


def test_blocks_open_in_order_and_each_closes_before_the_next():
    events, stream = replay(CHUNKS)
    shape = [(e["type"], e.get("index"), (e.get("delta") or e.get("content_block") or {}).get("type")) for e in stream]
    assert shape == [
        ("message_start", None, None),
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"), ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"),
        ("content_block_delta", 1, "text_delta"), ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_delta", 2, "input_json_delta"), ("content_block_stop", 2, None),
        ("content_block_start", 3, "tool_use"), ("content_block_delta", 3, "input_json_delta"),
        ("content_block_stop", 3, None),
        ("message_delta", None, None), ("message_stop", None, None)]
    assert stream[9]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "weather", "input": {}}
    assert stream[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert stream[-2]["usage"] == {"input_tokens": 7, "output_tokens": 9}
    assert stream[0]["message"]["content"] == [] and stream[0]["message"]["stop_reason"] is None


def test_the_message_gathers_the_blocks_with_parsed_inputs():
    message = replay(CHUNKS)[0].message()
    assert message["content"] == [
        {"type": "thinking", "thinking": "The user wants the weather.", "signature": ""},
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "call_1", "name": "weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "call_2", "name": "clock", "input": {}}]  # its arguments were cut
    assert (message["stop_reason"], message["usage"]) == ("tool_use", {"input_tokens": 7, "output_tokens": 9})
    assert message["id"].startswith("msg_") and (message["type"], message["role"]) == ("message", "assistant")


@pytest.mark.parametrize("last, stop_reason, stop_sequence", [
    ({"finish_reason": "stop"}, "end_turn", None),
    ({"finish_reason": "stop", "stop_sequence": "END"}, "stop_sequence", "END"),
    ({"finish_reason": "length"}, "max_tokens", None),
])
def test_stop_reasons(last, stop_reason, stop_sequence):
    events, stream = replay([{"content": "Hi", "finish_reason": None}, {"content": "", "usage": USAGE, **last}])
    assert stream[-2]["delta"] == {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
    assert (events.message()["stop_reason"], events.message()["stop_sequence"]) == (stop_reason, stop_sequence)
