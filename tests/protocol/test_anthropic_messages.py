"""Anthropic's Messages API on our front, driven by the official anthropic SDK, with tests/workers/echo_worker.py
behind it: what the handler is asked (the `request` worker answers with it) and the reply's shapes."""
import json
import re
import urllib.error
import urllib.request

import anthropic
import pytest

pytestmark = pytest.mark.slow  # our front and its worker as processes

KEY = "test-key"  # the front_server fixture's
USER = [{"role": "user", "content": "hello  there world"}]
WEATHER_TOOL = {"name": "get_weather", "description": "Weather in a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


@pytest.fixture(scope="module")
def client(front_server) -> anthropic.Anthropic:
    """The SDK sends the key as x-api-key."""
    with anthropic.Anthropic(base_url=front_server.base_url, api_key=KEY, max_retries=0, timeout=20) as client:
        yield client


def post(front_server, body: str) -> tuple[int, dict]:
    """(status, JSON reply) of a raw POST /v1/messages with the key as x-api-key."""
    request = urllib.request.Request(f"{front_server.base_url}/v1/messages", data=body.encode(), method="POST",
                                     headers={"x-api-key": KEY, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def handler_request(client, **kwargs) -> dict:
    """The chat data the front made of a Messages request (the `request` worker answers with it)."""
    reply = client.messages.create(model="request", **{"max_tokens": 10, "messages": USER, **kwargs})
    return json.loads(reply.content[0].text)


def test_a_plain_message(client):
    reply = client.messages.create(model="echo", max_tokens=10, system="be brief", messages=USER)
    assert reply.id.startswith("msg_")
    assert (reply.type, reply.role, reply.model) == ("message", "assistant", "echo-model")
    assert [(block.type, block.text) for block in reply.content] == [("text", "hello  there world")]
    assert (reply.stop_reason, reply.stop_sequence) == ("end_turn", None)
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (len("be brief") + len("hello  there world"), 3)


def test_a_streamed_message_in_anthropics_event_sequence(client):
    with client.messages.stream(model="echo", max_tokens=10, messages=USER) as stream:
        events = list(stream)
        final = stream.get_final_message()
    raw = [event.type for event in events if event.type != "text"]
    assert raw == ["message_start", "content_block_start", *["content_block_delta"] * 3, "content_block_stop",
                   "message_delta", "message_stop"]
    assert "".join(event.text for event in events if event.type == "text") == "hello  there world"
    assert events[0].message.stop_reason is None and events[0].message.content == []
    assert [block.text for block in final.content] == ["hello  there world"]
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == ("end_turn", 18, 3)


def test_the_request_reaches_the_handler_as_chat_data(client):
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "A tool knows.", "signature": "s"},
                                          {"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "sunny"}]},
                                     {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no such city",
                                      "is_error": True},
                                     {"type": "text", "text": "Thanks."}]}]
    data = handler_request(client, system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
                           messages=history, tools=[WEATHER_TOOL], stop_sequences=["END", "STOP"],
                           tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                           metadata={"user_id": "u1"}, extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 7})
    assert data["messages"] == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "A tool knows.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such city"},
        {"role": "user", "content": "Thanks."}]
    assert data["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER_TOOL["input_schema"]}}]
    assert data["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert data["parallel_tool_calls"] is False
    assert (data["stop"], data["max_tokens"], data["stream"]) == (["END", "STOP"], 10, False)
    assert (data["temperature"], data["top_p"], data["top_k"]) == (0.5, 0.9, 7)


@pytest.mark.parametrize("choice, chat", [({"type": "auto"}, "auto"), ({"type": "any"}, "required"),
                                          ({"type": "none"}, "none")])
def test_tool_choice_modes(client, choice, chat):
    data = handler_request(client, tools=[WEATHER_TOOL], tool_choice=choice)
    assert data["tool_choice"] == chat and "parallel_tool_calls" not in data


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_is_a_tool_use_block_with_its_input(client, stream):
    arguments = '{"city": "Paris", "days": [1, 2]}'
    kwargs = dict(model="tool_call", max_tokens=10, messages=[{"role": "user", "content": arguments}],
                  tools=[WEATHER_TOOL], tool_choice={"type": "tool", "name": "get_weather"})
    if stream:
        with client.messages.stream(**kwargs) as events:
            partial = [event.partial_json for event in events if event.type == "input_json"]
            reply = events.get_final_message()
        assert "".join(partial) == arguments, "the arguments arrive as input_json_delta fragments"
    else:
        reply = client.messages.create(**kwargs)
    [block] = reply.content
    assert (block.type, block.id, block.name) == ("tool_use", "call_echo", "get_weather")
    assert block.input == json.loads(arguments)
    assert reply.stop_reason == "tool_use"


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_sequence_is_named(client, stream):
    kwargs = dict(model="stops", max_tokens=10, stop_sequences=["END", "there"], messages=USER)
    if stream:
        with client.messages.stream(**kwargs) as events:
            reply = events.get_final_message()
    else:
        reply = client.messages.create(**kwargs)
    assert (reply.content[0].text, reply.stop_reason, reply.stop_sequence) == ("hello  ", "stop_sequence", "there")


def test_max_tokens_is_the_stop_reason_of_a_reply_cut_short(client):
    reply = client.messages.create(model="slow", max_tokens=2, messages=USER)
    assert (reply.content[0].text, reply.stop_reason) == ("0 1 ", "max_tokens")


def test_a_bearer_token_is_accepted_as_well(front_server):
    with anthropic.Anthropic(base_url=front_server.base_url, auth_token=KEY, api_key=None, max_retries=0) as bearer:
        assert bearer.messages.create(model="echo", max_tokens=5, messages=USER).content[0].text == "hello  there world"


def test_a_wrong_key_is_an_authentication_error(front_server):
    with (anthropic.Anthropic(base_url=front_server.base_url, api_key="wrong", max_retries=0) as wrong,
          pytest.raises(anthropic.AuthenticationError) as error):
        wrong.messages.create(model="echo", max_tokens=5, messages=USER)
    assert error.value.status_code == 401 and error.value.body["error"]["type"] == "authentication_error"
    assert "x-api-key" in error.value.body["error"]["message"]


BAD = [
    ({"max_tokens": None}, "max_tokens is required"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
    ({"temperature": "hot"}, "temperature must be a number >= 0, got 'hot'"),
    ({"messages": []}, "messages must be a non-empty list"),
    ({"messages": [{"role": "system", "content": "x"}]}, r"messages\[0\].role must be 'user' or 'assistant'"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     r"messages\[0\].content\[0\].type must be 'text' or 'tool_result' here, got 'image': this server reads text only"),
    ({"messages": USER + [{"role": "assistant", "content": "Sure"}]}, "prefill"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
     r"messages\[0\].content\[0\].tool_use_id must be a string"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}]},
                   *USER]}, r"messages\[0\].content\[0\].input must be an object"),
    ({"system": 5}, "system must be a string or a list of text blocks"),
    ({"tools": [{"name": "get_weather"}]}, r"tools\[0\].input_schema must be a JSON schema object"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, r"tools\[0\].type: 'web_search_20250305'"),
    ({"tool_choice": {"type": "tool"}, "tools": [WEATHER_TOOL]}, "tool_choice.name must name the tool"),
    ({"tool_choice": {"type": "any"}}, "tool_choice 'any' needs tools"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type must be one of auto, any, tool, none"),
    ({"stop_sequences": "END"}, "stop_sequences must be a list of non-empty strings"),
    ({"metadata": {"user_id": 5}}, "metadata.user_id must be a string"),
    ({"stream": "yes"}, "stream must be a boolean"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking is not supported here; leave it out"),
]


@pytest.mark.parametrize("fields, problem", BAD)
def test_bad_input_is_a_400_in_anthropics_error_shape_naming_the_field(front_server, fields, problem):
    body = {"model": "echo", "max_tokens": 10, "messages": USER, **fields}
    status, reply = post(front_server, json.dumps({k: v for k, v in body.items() if v is not None}))
    assert status == 400 and reply["type"] == "error" and set(reply["error"]) == {"type", "message"}
    assert reply["error"]["type"] == "invalid_request_error"
    assert re.search(problem, reply["error"]["message"]), reply


def test_the_sdk_raises_the_error_with_its_message(client):
    with pytest.raises(anthropic.BadRequestError, match="max_tokens must be an integer >= 1, got 0"):
        client.messages.create(model="echo", max_tokens=0, messages=USER)


@pytest.mark.parametrize("body, status, kind, problem", [
    ("{not json", 400, "invalid_request_error", "request body is not valid JSON"),
    ("[1]", 400, "invalid_request_error", "request body must be a JSON object"),
    (json.dumps({"model": "unavailable", "max_tokens": 5, "messages": USER}), 503, "overloaded_error",
     "echo worker is unavailable"),
])
def test_other_failures_are_in_anthropics_error_shape(front_server, body, status, kind, problem):
    got, reply = post(front_server, body)
    assert (got, reply["type"], reply["error"]["type"]) == (status, "error", kind)
    assert problem in reply["error"]["message"]


def test_a_failure_mid_stream_is_an_error_event(spawn_front_server):
    daemon = spawn_front_server()
    texts = []
    with (anthropic.Anthropic(base_url=daemon.base_url, api_key="unused", max_retries=0, timeout=20) as client,
          pytest.raises(anthropic.APIStatusError, match="the handler exited") as error,
          client.messages.stream(model="crash", max_tokens=10, messages=USER) as stream):
        for event in stream:
            texts += [event.text] if event.type == "text" else []
    assert texts == ["bye"], "the stream had begun"
    assert error.value.body == {"type": "error", "error": {"type": "api_error", "message": "the handler exited"}}
