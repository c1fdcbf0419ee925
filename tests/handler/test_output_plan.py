"""The reply features of a chat request: tools in the template, grammars, logprobs, n, logit_bias, and their errors."""
import asyncio
import copy
import dataclasses
import json

import pytest
import xgrammar

from handler.chat import ChatModel, RequestError, parse_chat_request
from handler.grammar import Grammars

MAX_MODEL_LEN = 256
COMPILE_TIMEOUT_S = 60.0
DEEP_LIST = json.loads("[" * 101 + "]" * 101)  # one level more than the default HFENDPOINT_MAX_NESTING_DEPTH
DEEP_ARGUMENTS = "[" * 100_000 + "]" * 100_000  # deeper than Python's recursion limit
HERMES_TEMPLATE = (
    "{% if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for call in m.tool_calls or [] %}<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
    "{% if think %}<think>\n{% else %}<think>\n\n</think>\n\n{% endif %}")
WEATHER = {"type": "function", "function": {"name": "weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "clock"}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def grammars(smollm2_tokenizer):
    return Grammars(smollm2_tokenizer, len(smollm2_tokenizer), (smollm2_tokenizer.eos_token_id,))


@pytest.fixture(scope="module")
def model(smollm2_tokenizer, grammars):
    """SmolLM2: its template shows no tool-call format."""
    return ChatModel(smollm2_tokenizer, MAX_MODEL_LEN, (smollm2_tokenizer.eos_token_id,), {}, len(smollm2_tokenizer),
                     grammars)


@pytest.fixture(scope="module")
def hermes(smollm2_tokenizer, grammars):
    """The same tokenizer with a Hermes-style template that renders tools, tool calls and think blocks."""
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = HERMES_TEMPLATE
    return ChatModel(tokenizer, MAX_MODEL_LEN, (tokenizer.eos_token_id,), {}, len(tokenizer), grammars)


def parse(model, **fields):
    """The parsed request with its grammar compiled, as the service does (handler/service.py)."""
    request = parse_chat_request({"messages": ASK, **fields}, model)
    plan = request.output
    if plan.schema is None:
        return request
    grammar = asyncio.run(model.grammars.compile_json_schema(plan.schema, plan.schema_field, COMPILE_TIMEOUT_S))
    return dataclasses.replace(request, output=dataclasses.replace(plan, grammar=grammar))


def prompt(model, request):
    return model.tokenizer.decode(request.prompt_token_ids)


def accepts(grammar, text):
    matcher = xgrammar.GrammarMatcher(grammar)
    return matcher.accept_string(text) and matcher.is_completed()


def test_auto_renders_the_tools_and_reads_the_templates_format(hermes):
    request = parse(hermes, tools=[WEATHER])
    assert request.output.tools.style == "hermes" and request.output.grammar is None
    assert json.dumps(WEATHER) in prompt(hermes, request), "the template gets the tools as given"
    assert request.output.reasoning is False, "think tags in the template; the prompt closed its think block"


def test_none_leaves_the_tools_out_of_the_prompt(hermes):
    request = parse(hermes, tools=[WEATHER], tool_choice="none")
    assert request.output.tools.style is None and "<tools>" not in prompt(hermes, request)


def test_required_forces_an_array_of_calls_of_the_given_tools(model):
    request = parse(model, tools=[WEATHER, CLOCK], tool_choice="required")
    grammar = request.output.grammar
    assert request.output.tools.style == "json_array"
    assert accepts(grammar, '[{"name": "weather", "arguments": {"city": "Paris"}}, {"name": "clock", "arguments": {}}]')
    assert not accepts(grammar, '[]')
    assert not accepts(grammar, '[{"name": "weather", "arguments": {}}]'), "the tool's own schema holds"
    assert not accepts(grammar, '[{"name": "sun", "arguments": {}}]')
    single = parse(model, tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False).output.grammar
    assert accepts(single, '[{"name": "clock", "arguments": {}}]')
    assert not accepts(single, '[{"name": "clock", "arguments": {}}, {"name": "clock", "arguments": {}}]')


def test_a_named_function_forces_its_arguments_object(model):
    request = parse(model, tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "weather"}})
    assert (request.output.tools.style, request.output.tools.function_name) == ("arguments", "weather")
    assert accepts(request.output.grammar, '{"city": "Paris"}')
    assert not accepts(request.output.grammar, '{"town": "Paris"}')


@pytest.mark.parametrize("response_format, good, bad", [
    ({"type": "json_object"}, '{"any": [1, {"thing": null}]}', '[1]'),
    ({"type": "json_schema", "json_schema": {"name": "n", "strict": True, "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}}},
     '{"n": 3}', '{"n": "3"}'),
])
def test_response_format_compiles_a_grammar(model, response_format, good, bad):
    grammar = parse(model, response_format=response_format).output.grammar
    assert accepts(grammar, good) and not accepts(grammar, bad)
    assert parse(model, response_format={"type": "text"}).output.grammar is None


def test_tool_call_turns_reach_the_template_with_object_arguments(hermes):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    request = parse_chat_request({"messages": messages, "tools": [WEATHER]}, hermes)
    text = prompt(hermes, request)
    assert '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<|im_start|>tool\nsunny<|im_end|>" in text


def test_tool_call_arguments_that_are_not_a_json_object_reach_the_template_as_sent(hermes):
    """A call an earlier reply's max_tokens cut short is history like any other, as OpenAI takes it."""
    cut = '{"city": "Par'
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": cut}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "unknown city"}]
    text = prompt(hermes, parse_chat_request({"messages": messages, "tools": [WEATHER]}, hermes))
    assert "<tool_call>" + json.dumps({"name": "weather", "arguments": cut}) + "</tool_call>" in text


def test_reasoning_when_the_template_uses_think_tags(hermes):
    thinking = parse(hermes, chat_template_kwargs={"think": True})
    assert thinking.output.reasoning is True, "the prompt opened a think block"
    assert parse(hermes).output.reasoning is False, "think tags in the template, the block closed in the prompt"
    forced = parse(hermes, chat_template_kwargs={"think": True}, response_format={"type": "json_object"})
    assert forced.output.reasoning is None, "a grammar-constrained reply is JSON from its first token"


def test_logprobs_n_and_logit_bias_reach_the_sampling_params(model):
    request = parse(model, logprobs=True, top_logprobs=5, n=3, logit_bias={"42": -100, "7": 2.5}, seed=1)
    assert request.output.n == 3
    assert (request.params.logprobs, request.params.logit_bias) == (5, {42: -100.0, 7: 2.5})
    assert parse(model, logprobs=True).params.logprobs == 0
    assert parse(model).params.logprobs is None and parse(model).params.logit_bias is None


BAD = [
    ({"tools": []}, "tools must be a non-empty list"),
    ({"tools": [{"type": "retrieval"}]},
     r'tools\[0\].type must be "function" \(the only tools supported\), got .retrieval.'),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, r"tools\[0\].function.name must be"),
    ({"tools": [CLOCK, CLOCK]}, r"tools\[1\].function.name: 'clock' is defined twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "parameters must be a JSON"),
    ({"tools": [WEATHER]}, "tool_choice 'auto'.*shows no tool-call format"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice must be one of"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "sun"}}}, "'sun', which is not"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function is required"),
    ({"tool_choice": "required"}, "tool_choice 'required' needs tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": "no"}, "parallel_tool_calls must be"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "give one of them"),
    ({"response_format": {"type": "yaml"}},
     "response_format.type must be one of text, json_object, json_schema, got .yaml."),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema must be a map"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema is required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}}, "strict must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}},
     "response_format: xgrammar cannot compile this JSON schema: .*strin"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
      "tool_choice": "required"}, "tools: xgrammar cannot compile"),
    ({"functions": [{"name": "f"}]}, "functions is OpenAI's deprecated form of tools"),
    ({"function_call": "auto"}, "function_call is OpenAI's deprecated form of tool_choice"),
    ({"logprobs": "yes"}, "logprobs must be a boolean"),
    ({"top_logprobs": 3}, "top_logprobs needs logprobs: true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be between 0 and 20"),
    ({"n": 0}, "n must be an integer >= 1, got 0"),
    ({"n": 2.0}, "n must be an integer"),
    ({"logit_bias": [1]}, "logit_bias must be a map"),
    ({"logit_bias": {"x": 1}}, "logit_bias: 'x' is not a token id"),
    ({"logit_bias": {"49152": 1}}, "logit_bias: '49152' is not a token id of this model"),
    ({"logit_bias": {"5": 101}}, r"logit_bias\['5'\] must be a number from -100 to 100"),
    ({"stream_options": {"include_usage": True}}, "stream_options is only allowed with stream: true"),
    ({"stream": True, "stream_options": {"continuous": True}}, "stream_options.continuous is not supported"),
    ({"messages": ASK + [{"role": "tool", "content": "x"}]}, r"messages\[1\].tool_call_id must be"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "only assistant messages carry tool calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": DEEP_ARGUMENTS}}]}]},
     r"messages\[0\].tool_calls\[0\].function.arguments nests too deeply"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f",
                                                                       "arguments": json.dumps({"a": DEEP_LIST})}}]}]},
     "messages nests lists and maps more than 100 levels deep"),
    ({"metadata": {"a": DEEP_LIST}}, "metadata nests lists and maps more than 100 levels deep"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"x": DEEP_LIST}}}]},
     "tools nests lists and maps"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#"}}}},
     "response_format: no JSON value satisfies this schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}}},
     "response_format: no JSON value satisfies this schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools: no JSON value satisfies"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "(a"}}}},
     "response_format: xgrammar cannot compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": [1]}}}},
     "response_format: xgrammar cannot compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"enum": ["x" * 100] * 3000}}}},
     r"response_format: the JSON schema is \d+ bytes, more than this server's 262144"),
    ({"logit_bias": {"5": float("nan")}}, r"logit_bias\['5'\] must be a number"),
    ({"logit_bias": {"5": float("inf")}}, r"logit_bias\['5'\] must be a number"),
    ({"logit_bias": {"1" * 5000: 1}}, "logit_bias: '1111.* is not a token id"),
    ({"logit_bias": {"²": 1}}, "logit_bias: '²' is not a token id"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, r"logit_bias: at most 1024 entries"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(513)]}, "tools: at most 512"),
    ({"stop": "x" * 1025}, "stop: a stop string is at most 1024 characters"),
    ({"stop": ["x"] * 17}, "stop: at most 16 stop strings"),
]


@pytest.mark.parametrize("fields, problem", BAD)
def test_bad_requests_name_the_field(model, fields, problem):
    """Every refusal is a 400 whose `param` is the request field its message starts with."""
    with pytest.raises(RequestError, match=problem) as raised:
        parse(model, **fields)
    assert raised.value.status == 400 and raised.value.param
    assert str(raised.value).startswith(raised.value.param), (raised.value.param, str(raised.value))
