"""Tool-call formats: detection from chat templates, and the streaming parser against whole-text parsing."""
import json

import pytest

from handler.tool_calls import ToolCallParser, parse_tool_calls, tool_call_format

WEATHER = '{"city": "Paris", "days": [1, {"unit": "}\\"c"}], "note": null}'


def stream(style, text, step, function_name=None, max_calls=None):
    """(content, deltas, parser) of text fed `step` characters at a time."""
    parser = ToolCallParser(style, function_name, max_calls)
    content, deltas = "", []
    outs = [parser.feed(text[start:start + step]) for start in range(0, len(text), step)] + [parser.finish()]
    for out in outs:
        indexes = [delta["index"] for delta in out.tool_calls]
        assert len(indexes) == len(set(indexes)), f"one delta per call index in a chunk, got {out.tool_calls}"
        content, deltas = content + out.content, deltas + out.tool_calls
    return content, deltas, parser


def merged(deltas):
    """The calls OpenAI clients rebuild from deltas, checking their shape on the way."""
    calls = {}
    for delta in deltas:
        if "id" in delta:
            assert delta["index"] not in calls, "one header per call"
            assert delta["type"] == "function" and delta["id"].startswith("call_")
            calls[delta["index"]] = [delta["function"]["name"], delta["function"]["arguments"]]
        else:
            assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
            calls[delta["index"]][1] += delta["function"]["arguments"]
    return [tuple(calls[i]) for i in sorted(calls)]


CASES = [
    ("hermes", 'Let me look.\n\n<tool_call>\n{"name": "weather", "arguments": ' + WEATHER + '}\n</tool_call>\n'
     '<tool_call>\n{"arguments": {"x": 1}, "name": "clock"}\n</tool_call>',
     "Let me look.", [("weather", WEATHER), ("clock", '{"x": 1}')]),
    ("hermes", "No tools needed.\n", "No tools needed.\n", []),
    ("hermes", '<tool_call>{"name": "now"}</tool_call>', "", [("now", "{}")]),
    ("llama3_json", ' {"name": "weather", "parameters": ' + WEATHER + '}; {"name": "clock", "parameters": {}}', "",
     [("weather", WEATHER), ("clock", "{}")]),
    ("llama3_json", '<|python_tag|>{"name": "clock", "parameters": "{\\"tz\\": \\"UTC\\"}"}', "",
     [("clock", '{"tz": "UTC"}')]),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", "It is sunny. <|python_tag|>{\"name\": \"clock\", \"parameters\": {}}", "It is sunny.",
     [("clock", "{}")]),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "weather", "arguments": ' + WEATHER + '}, {"name": "clock", '
     '"arguments": {}}]', "Sure.", [("weather", WEATHER), ("clock", "{}")]),
    ("mistral", "[TOOL_CALLS]weather[ARGS]" + WEATHER + "[TOOL_CALLS]clock[ARGS]{}", "",
     [("weather", WEATHER), ("clock", "{}")]),
    ("json_array", '[{"name": "weather", "arguments": ' + WEATHER + '}, {"name": "clock", "arguments": {}}]', "",
     [("weather", WEATHER), ("clock", "{}")]),
]


@pytest.mark.parametrize("style, text, content, calls", CASES)
@pytest.mark.parametrize("step", [1, 2, 5, 10_000])
def test_streamed_deltas_rebuild_the_calls_whatever_the_piece_sizes(style, text, content, calls, step):
    streamed_content, deltas, parser = stream(style, text, step)
    assert streamed_content == content
    assert merged(deltas) == calls
    assert [(call.name, call.arguments) for call in parser.calls] == calls
    assert parse_tool_calls(text, style)[0] == content
    for _, arguments in calls:
        json.loads(arguments)


def test_named_choice_reads_the_whole_reply_as_its_arguments():
    content, deltas, _ = stream("arguments", WEATHER, 3, function_name="weather")
    assert content == "" and merged(deltas) == [("weather", WEATHER)]
    assert deltas[0]["function"] == {"name": "weather", "arguments": WEATHER[:3]}, "the name comes with the text read"


@pytest.mark.parametrize("style, text, function_name", [
    ("arguments", WEATHER, "weather"),
    ("hermes", '<tool_call>{"name": "weather", "arguments": ' + WEATHER + "}</tool_call>", None),
    ("hermes", '<tool_call>{"arguments": ' + WEATHER + ', "name": "weather"}</tool_call>', None),
])
@pytest.mark.parametrize("step", [1, 4, 10_000])
def test_a_client_reading_only_the_first_entry_of_each_chunk_gets_the_whole_call(style, text, function_name, step):
    """As instructor and llama-index read streamed tool calls: tool_calls[0] of each chunk, nothing more."""
    parser = ToolCallParser(style, function_name)
    outs = [parser.feed(text[start:start + step]) for start in range(0, len(text), step)] + [parser.finish()]
    firsts = [out.tool_calls[0] for out in outs if out.tool_calls]
    assert firsts[0]["function"]["name"] == "weather"
    assert "".join(delta["function"]["arguments"] for delta in firsts) == WEATHER


def test_arguments_stream_as_they_are_generated():
    parser = ToolCallParser("hermes")
    first = parser.feed('<tool_call>{"name": "weather", "arguments": {"city": "Par')
    assert merged(first.tool_calls) == [("weather", '{"city": "Par')]
    second = parser.feed('is"}}</tool_call>')
    assert second.tool_calls == [{"index": 0, "function": {"arguments": 'is"}'}}]


def test_max_calls_stops_reading_after_the_first_complete_call():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    content, deltas, parser = stream("hermes", text, 7, max_calls=1)
    assert merged(deltas) == [("a", "{}")] and parser.finished
    assert not stream("hermes", text, 7)[2].finished


def test_a_marker_split_across_pieces_is_never_content():
    parser = ToolCallParser("hermes")
    assert parser.feed("Hi <tool_").content == "Hi"
    assert parser.feed('call>{"name": "a", "arguments": {}}').tool_calls[0]["function"]["name"] == "a"


def test_text_that_only_looks_like_a_marker_start_is_released_at_the_end():
    assert stream("hermes", "a < b and <tool", 1)[0] == "a < b and <tool"


def test_a_malformed_call_is_dropped_up_to_its_closing_tag():
    content, deltas, _ = stream("hermes", 'A<tool_call>{"name": "a", oops}</tool_call> B', 1)
    assert content == "AB" and merged(deltas) == [("a", "")]  # whitespace around calls goes


@pytest.mark.parametrize("template, expected", [
    ("{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>\n</tool_call>", "hermes"),
    ("{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),
    ("Environment: ipython", "llama3_json"),
    ("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]", "mistral"),
    ("{{ messages[0]['content'] }}", None),
    (None, None),
])
def test_format_from_the_chat_template(template, expected):
    assert tool_call_format(template) == expected
