"""What a chat request asks of its reply beyond text, checked before the engine sees it: `n` choices,
`logprobs`/`top_logprobs`, `logit_bias`, `response_format`, the tools (handler/tools.py), reasoning apart from
the answer (handler/reasoning.py) and `stream_options`. Every problem is a RequestError naming the field.

A grammar (a `response_format` schema, or a forced tool call) constrains the reply from its first token; the
reply is then JSON and is not read for reasoning.
"""
import json
from dataclasses import dataclass, field, replace

import xgrammar

from daemon_protocol import RequestError
from handler.reasoning import starts_in_reasoning, uses_think_tags
from handler.tool_calls import tool_call_format
from handler.tools import ToolPlan, parse_tools
from schema.chat import ChatCompletionRequest, ResponseFormat, Sampling

MAX_TOKEN_ID_DIGITS = 10  # a token id fits 32 bits
JSON_OBJECT_SCHEMA = {"type": "object", "additionalProperties": True}


@dataclass(frozen=True)
class OutputPlan:
    n: int = 1
    logprobs: int | None = None  # alternatives per token (0: the chosen token's logprob only); None: no logprobs
    logit_bias: dict[int, float] | None = None
    schema: str | None = None  # the JSON schema (as JSON text) each choice's reply follows
    schema_field: str | None = None  # the request field it came from: response_format or tools
    grammar: xgrammar.CompiledGrammar | None = None  # the schema's, compiled (handler/service.py)
    tools: ToolPlan = field(default_factory=lambda: ToolPlan(None, None))
    reasoning: bool | None = None  # None: no think tags to read; else whether the reply starts inside a block

    @property
    def sampling(self) -> dict:
        """The SamplingParams fields this plan sets."""
        return {"logprobs": self.logprobs, "logit_bias": self.logit_bias}


def plan_output(request: ChatCompletionRequest, sent_tools: list[dict] | None, model) -> OutputPlan:
    """Everything but reasoning, which needs the rendered prompt (with_prompt). sent_tools: the request's tools
    as sent, for the template. model: handler/chat.py's ChatModel."""
    for legacy, current in (("functions", "tools"), ("function_call", "tool_choice")):
        if getattr(request, legacy) is not None:
            raise RequestError(f"{legacy} is OpenAI's deprecated form of {current}, which this endpoint takes instead",
                               param=legacy)
    check_stream_options(request)
    limits = model.limits
    check_count(request.tools, "tools", limits.max_tools, "HFENDPOINT_MAX_TOOLS")
    tools = parse_tools(request, sent_tools, tool_call_format(model.tokenizer.chat_template))
    schema, where = response_schema(request.response_format), "response_format"
    if tools.schema is not None:
        if schema is not None:
            raise RequestError(f"response_format and tool_choice {request.tool_choice!r} both constrain the reply: "
                               "give one of them", param="response_format")
        schema, where = tools.schema, "tools"
    elif schema is not None and tools.style is not None:
        raise RequestError("response_format: a JSON reply cannot also carry tool calls read from text; use "
                           "tool_choice 'none', 'required' or a named function with it", param="response_format")
    schema_text = None
    if schema is not None:
        if model.grammars is None or not model.grammars.can_constrain:
            raise RequestError(f"{where}: this model cannot constrain its output (it has no end-of-sequence token "
                               "to end a constrained reply with)", param=where)
        schema_text = schema_json(schema, where, limits.max_schema_bytes)
    return OutputPlan(n=check_n(request, limits.max_n), logprobs=parse_logprobs(request, limits.max_top_logprobs),
                      logit_bias=parse_logit_bias(request, model), schema=schema_text,
                      schema_field=where if schema is not None else None, tools=tools)


def schema_json(schema: dict, where: str, max_bytes: int) -> str:
    """The schema as the grammar compiler takes it; one larger than the operator allows is refused."""
    text = json.dumps(schema)
    if len(text) > max_bytes:
        raise RequestError(f"{where}: the JSON schema is {len(text)} bytes, more than this server's {max_bytes} "
                           "(HFENDPOINT_MAX_SCHEMA_BYTES)", param=where)
    return text


def check_count(value: list | dict | None, name: str, limit: int, variable: str) -> None:
    """A list or map field with more entries than the operator allows is refused, naming the field."""
    if value is not None and len(value) > limit:
        raise RequestError(f"{name}: at most {limit} entries ({variable}), got {len(value)}", param=name)


def with_prompt(plan: OutputPlan, chat_template: str | None, prompt: str) -> OutputPlan:
    """The plan with its reasoning state: replies read for think blocks are the free-text ones of think models."""
    if plan.schema is not None or not uses_think_tags(chat_template):
        return plan
    return replace(plan, reasoning=starts_in_reasoning(prompt))


def check_n(request: Sampling, max_n: int) -> int:
    if request.n > max_n:
        raise RequestError(f"n must be between 1 and {max_n} (HFENDPOINT_MAX_N), got {request.n}", param="n")
    return request.n


def parse_logprobs(request: ChatCompletionRequest, max_top: int) -> int | None:
    top = request.top_logprobs
    if top is None:
        return 0 if request.logprobs else None
    if top > max_top:
        raise RequestError(f"top_logprobs must be between 0 and {max_top} (HFENDPOINT_MAX_TOP_LOGPROBS), got {top}",
                           param="top_logprobs")
    if not request.logprobs:
        raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    return top


def parse_logit_bias(request: Sampling, model) -> dict[int, float] | None:
    """The biases by token id (their values checked by the schema); a key that is no token id of the model is
    refused. model: handler/chat.py's ChatModel."""
    biases = request.logit_bias
    if biases is None:
        return None
    check_count(biases, "logit_bias", model.limits.max_logit_bias_entries, "HFENDPOINT_MAX_LOGIT_BIAS_ENTRIES")
    parsed, vocab_size = {}, model.vocab_size or len(model.tokenizer)
    for key, bias in biases.items():
        token = key if isinstance(key, int) and not isinstance(key, bool) else _token_id(key)
        if token is None or not 0 <= token < vocab_size:
            raise RequestError(f"logit_bias: {key!r:.100} is not a token id of this model (0 to {vocab_size - 1})",
                               param="logit_bias")
        parsed[token] = float(bias)
    return parsed or None


def _token_id(key) -> int | None:
    """A key's token id: ASCII digits only (int() also reads other scripts' digits), and few enough of them."""
    digits = key.strip() if isinstance(key, str) else ""
    return int(digits) if digits.isascii() and digits.isdigit() and len(digits) <= MAX_TOKEN_ID_DIGITS else None


def response_schema(response_format: ResponseFormat | None) -> dict | None:
    """The JSON schema a response_format asks the reply to follow; None for plain text. `strict` is accepted
    either way: the schema is always enforced."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return JSON_OBJECT_SCHEMA
    if response_format.json_schema is None:
        raise RequestError('response_format.json_schema must be a map: {"name": ..., "schema": {...}}',
                           param="response_format")
    return response_format.json_schema.schema_


def check_stream_options(request: Sampling) -> None:
    if request.stream_options is not None and not request.stream:
        raise RequestError("stream_options is only allowed with stream: true", param="stream_options")
