"""Structured outputs, forced tool calls, logprobs and n > 1 through our front with the openai client, on
the packaged SmolLM2 (its chat template knows no tools: forced calls work whatever the template)."""
import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow  # SmolLM2 served by the handler behind our front

ASK_CITY = [{"role": "user", "content": "Describe Paris as a city record."}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int


class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    reasons: list[str] = Field(max_length=2)


class WeatherArguments(BaseModel):
    city: str = Field(max_length=24)
    unit: Literal["celsius", "fahrenheit"]


class TimeArguments(BaseModel):
    timezone: str = Field(max_length=24)


def function_tool(name: str, description: str, model: type[BaseModel]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": model.model_json_schema()}}


TOOLS = [function_tool("get_weather", "Current weather in a city", WeatherArguments),
         function_tool("get_time", "Current time in a timezone", TimeArguments)]
ARGUMENTS = {"get_weather": WeatherArguments, "get_time": TimeArguments}


@pytest.fixture(scope="module")
def client(smollm2_service):
    with openai.OpenAI(base_url=smollm2_service.url, api_key="unused", max_retries=0, timeout=300) as client:
        yield client


def create(client, messages, **kwargs):
    return client.chat.completions.create(model="smollm2", messages=messages, **{"max_tokens": 120, **kwargs})


def streamed_calls(client, messages, **kwargs):
    """(tool calls rebuilt from the deltas as (name, arguments), finish reasons) of a streamed request."""
    calls, reasons = {}, []
    for chunk in create(client, messages, stream=True, **kwargs):
        choice = chunk.choices[0]
        reasons.append(choice.finish_reason)
        for delta in choice.delta.tool_calls or ():
            call = calls.setdefault(delta.index, ["", ""])
            if delta.id:
                assert delta.type == "function" and not call[0], "the first delta of a call names it"
                call[0] = delta.function.name
            call[1] += delta.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)], reasons


@pytest.mark.parametrize("temperature", [0, 0.9])
@pytest.mark.parametrize("model", [City, Verdict])
def test_parse_gives_a_parsed_object(client, model, temperature):
    question = ASK_CITY if model is City else [{"role": "user", "content": "Is the sky blue?"}]
    reply = client.chat.completions.parse(model="smollm2", messages=question, response_format=model,
                                          temperature=temperature, max_tokens=150, seed=3)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, model)


def test_json_object_gives_a_json_object(client):
    ask = "Reply with a JSON object with the keys name and age of a cat."
    reply = create(client, [{"role": "user", "content": ask}],
                   response_format={"type": "json_object"}, temperature=0, max_tokens=200)
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_are_valid_and_identical_streamed_or_not(client, tool_choice):
    reply = create(client, ASK_WEATHER, tools=TOOLS, tool_choice=tool_choice, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls]
    assert calls and all(call.id.startswith("call_") and call.type == "function" for call in choice.message.tool_calls)
    for name, arguments in calls:
        ARGUMENTS[name].model_validate_json(arguments)
    if isinstance(tool_choice, dict):
        assert [name for name, _ in calls] == ["get_time"]
    streamed, reasons = streamed_calls(client, ASK_WEATHER, tools=TOOLS, tool_choice=tool_choice, temperature=0)
    assert streamed == calls
    assert reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}


def test_a_client_reading_only_the_first_tool_call_entry_of_each_chunk_gets_the_whole_call(client):
    """instructor and llama-index read tool_calls[0] of each chunk; the openai client's stream helper merges all."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(tools=TOOLS, tool_choice=named, temperature=0, max_tokens=60)
    [call] = create(client, ASK_WEATHER, **kwargs).choices[0].message.tool_calls
    firsts = [chunk.choices[0].delta.tool_calls[0] for chunk in create(client, ASK_WEATHER, stream=True, **kwargs)
              if chunk.choices[0].delta.tool_calls]
    assert firsts[0].function.name == "get_weather"
    assert "".join(delta.function.arguments or "" for delta in firsts) == call.function.arguments
    with client.chat.completions.stream(model="smollm2", messages=ASK_WEATHER, **kwargs) as stream:
        [merged] = stream.get_final_completion().choices[0].message.tool_calls
    assert (merged.function.name, merged.function.arguments) == ("get_weather", call.function.arguments)


def test_without_parallel_calls_required_gives_exactly_one(client):
    reply = create(client, ASK_WEATHER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                   temperature=0.9, seed=5)
    assert len(reply.choices[0].message.tool_calls) == 1


def test_a_conversation_with_a_tool_result_continues(client):
    weather = {"type": "function", "function": {"name": "get_weather"}}
    first = create(client, ASK_WEATHER, tools=TOOLS, tool_choice=weather, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})}]
    reply = create(client, messages, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=40)
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_auto_tool_choice_needs_a_template_that_shows_a_format(client):
    with pytest.raises(openai.APIStatusError, match="tool_choice 'auto'"):
        create(client, ASK_WEATHER, tools=TOOLS)


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_logprobs_agree_with_the_tokens_chosen(client, stream):
    kwargs = dict(temperature=0, logprobs=True, top_logprobs=5, max_tokens=24)
    if stream:
        chunks = list(create(client, ASK_CITY, stream=True, **kwargs))
        content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
        entries = [entry for chunk in chunks if chunk.choices[0].logprobs
                   for entry in chunk.choices[0].logprobs.content]
    else:
        choice = create(client, ASK_CITY, **kwargs).choices[0]
        content, entries = choice.message.content, choice.logprobs.content
    assert "".join(entry.token for entry in entries) == content
    for entry in entries:
        assert bytes(entry.bytes).decode() == entry.token
        tops = [top.logprob for top in entry.top_logprobs]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True)
        assert entry.top_logprobs[0].token == entry.token and entry.logprob == tops[0] <= 0


def test_logit_bias_bans_and_forces_tokens(client, smollm2_tokenizer):
    plain = create(client, ASK_CITY, temperature=0, max_tokens=8).choices[0].message.content
    first = smollm2_tokenizer.encode(plain)[0]
    banned = create(client, ASK_CITY, temperature=0, max_tokens=8, logit_bias={str(first): -100})
    assert smollm2_tokenizer.encode(banned.choices[0].message.content)[0] != first
    forced_token = smollm2_tokenizer.encode(" banana")[0]
    forced = create(client, ASK_CITY, temperature=0, max_tokens=3, logit_bias={str(forced_token): 100})
    assert forced.choices[0].message.content == smollm2_tokenizer.decode([forced_token] * 3)


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_streamed_and_not(client, stream):
    kwargs = dict(n=3, temperature=0.9, seed=7, max_tokens=16, extra_body={"ignore_eos": True})
    one = create(client, ASK_CITY, **{**kwargs, "n": 1})
    if not stream:
        reply = create(client, ASK_CITY, **kwargs)
        assert [choice.index for choice in reply.choices] == [0, 1, 2]
        texts = [choice.message.content for choice in reply.choices]
        assert len(set(texts)) == 3, "seeded choices differ from one another"
        assert texts[0] == one.choices[0].message.content, "choice 0 draws as the request with n=1"
        assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (one.usage.prompt_tokens, 3 * 16)
        again = [choice.message.content for choice in create(client, ASK_CITY, **kwargs).choices]
        assert again == texts, "and reproducible"
        return
    chunks = list(create(client, ASK_CITY, stream=True, stream_options={"include_usage": True}, **kwargs))
    texts, reasons = ["", "", ""], [[], [], []]
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        reasons[choice.index].append(choice.finish_reason)
    assert all(r[-1] in ("stop", "length") and set(r[:-1]) <= {None} for r in reasons)
    reference = [choice.message.content for choice in create(client, ASK_CITY, **kwargs).choices]
    assert texts == reference
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (one.usage.prompt_tokens, 3 * 16)
