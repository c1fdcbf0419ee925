"""Anthropic's Messages API end to end: the anthropic SDK against our front and the packaged SmolLM2 handler on
CPU, on the same chat_completions call as chat completions (the same greedy tokens either way)."""
import json

import anthropic
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow  # SmolLM2 served by the handler behind our front

ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]
GREEDY = {"temperature": 0}


class WeatherInput(BaseModel):
    city: str = Field(max_length=24)


WEATHER_TOOL = {"name": "get_weather", "description": "Current weather in a city",
                "input_schema": WeatherInput.model_json_schema()}
FORCE_WEATHER = {"type": "tool", "name": "get_weather"}


@pytest.fixture(scope="module")
def client(smollm2_service):
    base_url = smollm2_service.url.removesuffix("/v1")
    with anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=300) as client:
        yield client


def test_a_forced_tool_use_and_its_result_round_trip(client, smollm2_service):
    first = client.messages.create(model="smollm2", max_tokens=60, messages=ASK_WEATHER, tools=[WEATHER_TOOL],
                                   tool_choice=FORCE_WEATHER, extra_body=GREEDY)
    [call] = first.content
    assert (call.type, call.name, first.stop_reason) == ("tool_use", "get_weather", "tool_use")
    WeatherInput.model_validate(call.input)
    with openai.OpenAI(base_url=smollm2_service.url, api_key="unused", max_retries=0, timeout=300) as chat:
        [chat_call] = chat.chat.completions.create(
            model="smollm2", max_tokens=60, temperature=0, messages=ASK_WEATHER,
            tools=[{"type": "function", "function": {"name": "get_weather", "description": WEATHER_TOOL["description"],
                                                     "parameters": WEATHER_TOOL["input_schema"]}}],
            tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0].message.tool_calls
    assert call.input == json.loads(chat_call.function.arguments), "the same call as chat completions makes"
    with client.messages.stream(model="smollm2", max_tokens=60, messages=ASK_WEATHER, tools=[WEATHER_TOOL],
                                tool_choice=FORCE_WEATHER, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert [(block.name, block.input) for block in streamed.content] == [("get_weather", call.input)]
    history = ASK_WEATHER + [
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": json.dumps({"temperature": 21, "sky": "sunny"})}]}]
    second = client.messages.create(model="smollm2", max_tokens=30, messages=history, tools=[WEATHER_TOOL],
                                    tool_choice={"type": "none"}, extra_body=GREEDY)
    assert [block.type for block in second.content] == ["text"] and second.content[0].text
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert second.usage.input_tokens > first.usage.input_tokens and second.usage.output_tokens > 0


def test_plain_and_streamed_text_agree_and_a_stop_sequence_cuts_it(client):
    ask = [{"role": "user", "content": "Name three colours."}]
    plain = client.messages.create(model="smollm2", max_tokens=16, messages=ask, system="Be brief.",
                                   extra_body=GREEDY)
    text = plain.content[0].text
    assert plain.stop_reason in ("end_turn", "max_tokens") and plain.usage.output_tokens <= 16
    with client.messages.stream(model="smollm2", max_tokens=16, messages=ask, system="Be brief.",
                                extra_body=GREEDY) as stream:
        assert "".join(stream.text_stream) == text
    word = text.split()[2]
    cut = client.messages.create(model="smollm2", max_tokens=16, messages=ask, system="Be brief.",
                                 stop_sequences=["no such text", word], extra_body=GREEDY)
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", word)
    assert cut.content[0].text == text[:text.index(word)]


def test_top_k_reaches_the_sampler(client):
    ask = [{"role": "user", "content": "Tell me a story."}]
    greedy = client.messages.create(model="smollm2", max_tokens=12, messages=ask, extra_body=GREEDY)
    top_one = client.messages.create(model="smollm2", max_tokens=12, messages=ask,
                                     extra_body={"temperature": 1.0, "top_k": 1})
    assert top_one.content[0].text == greedy.content[0].text, "top_k 1 samples the greedy tokens"
    with pytest.raises(anthropic.BadRequestError, match="top_k") as error:
        client.messages.create(model="smollm2", max_tokens=12, messages=ask, extra_body={"top_k": "many"})
    assert error.value.body["type"] == "error" and error.value.body["error"]["type"] == "invalid_request_error"
