"""What a chat request asks of its reply beyond text, checked before the engine sees it: `n` choices,
`logprobs`/`top_logprobs`, `logit_bias`, `response_format`, the tools (handler/tools.py), reasoning apart from
the answer (handler/reasoning.py) and `stream_options`. Every problem is a RequestError naming the field.

A grammar (a `response_format` schema, or a forced tool call) constrains the reply from its first token; the
reply is then JSON and is not read for reasoning.
"""
import json
from dataclasses import dataclass, field, replace

import xgrammar

from handler.chat import RequestError, integer, type_name
from handler.reasoning import starts_in_reasoning, uses_think_tags
from handler.tool_calls import tool_call_format
from handler.tools import ToolPlan, parse_tools

MAX_LOGIT_BIAS = 100  # the largest bias, as OpenAI takes
MAX_TOKEN_ID_DIGITS = 10  # a token id fits 32 bits
JSON_OBJECT_SCHEMA = {"type": "object", "additionalProperties": True}
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
STREAM_OPTIONS = ("include_usage",)


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


def plan_output(data: dict, model) -> OutputPlan:
    """Everything but reasoning, which needs the rendered prompt (with_prompt)."""
    for legacy, current in (("functions", "tools"), ("function_call", "tool_choice")):
        if data.get(legacy) is not None:
            raise RequestError(f"{legacy} is OpenAI's deprecated form of {current}, which this endpoint takes instead",
                               param=legacy)
    check_stream_options(data)
    check_count(data, "tools", model.limits.max_tools, "HFENDPOINT_MAX_TOOLS")
    tools = parse_tools(data, tool_call_format(model.tokenizer.chat_template))
    schema, where = response_schema(data.get("response_format")), "response_format"
    if tools.schema is not None:
        if schema is not None:
            raise RequestError(f"response_format and tool_choice {data.get('tool_choice')!r} both constrain the reply: "
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
        schema_text = schema_json(schema, where, model.limits.max_schema_bytes)
    limits = model.limits
    return OutputPlan(n=parse_n(data, limits.max_n), logprobs=parse_logprobs(data, limits.max_top_logprobs),
                      logit_bias=parse_logit_bias(data, model), schema=schema_text,
                      schema_field=where if schema is not None else None, tools=tools)


def schema_json(schema: dict, where: str, max_bytes: int) -> str:
    """The schema as the grammar compiler takes it; one larger than the operator allows is refused."""
    text = json.dumps(schema)
    if len(text) > max_bytes:
        raise RequestError(f"{where}: the JSON schema is {len(text)} bytes, more than this server's {max_bytes} "
                           "(HFENDPOINT_MAX_SCHEMA_BYTES)", param=where)
    return text


def check_count(data: dict, name: str, limit: int, variable: str) -> None:
    """A list or map field with more entries than the operator allows is refused, naming the field."""
    value = data.get(name)
    if isinstance(value, (list, dict)) and len(value) > limit:
        raise RequestError(f"{name}: at most {limit} entries ({variable}), got {len(value)}", param=name)


def with_prompt(plan: OutputPlan, chat_template: str | None, prompt: str) -> OutputPlan:
    """The plan with its reasoning state: replies read for think blocks are the free-text ones of think models."""
    if plan.schema is not None or not uses_think_tags(chat_template):
        return plan
    return replace(plan, reasoning=starts_in_reasoning(prompt))


def parse_n(data: dict, max_n: int) -> int:
    if data.get("n") is None:
        return 1
    n = integer(data, "n")
    if not 1 <= n <= max_n:
        raise RequestError(f"n must be between 1 and {max_n} (HFENDPOINT_MAX_N), got {n}", param="n")
    return n


def parse_logprobs(data: dict, max_top: int) -> int | None:
    wanted = data.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise RequestError(f"logprobs must be a boolean, got {wanted!r}", param="logprobs")
    if data.get("top_logprobs") is None:
        return 0 if wanted else None
    top = integer(data, "top_logprobs")
    if not 0 <= top <= max_top:
        raise RequestError(f"top_logprobs must be between 0 and {max_top} (HFENDPOINT_MAX_TOP_LOGPROBS), got {top}",
                           param="top_logprobs")
    if not wanted:
        raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    return top


def parse_logit_bias(data: dict, model) -> dict[int, float] | None:
    biases = data.get("logit_bias")
    if biases is None:
        return None
    if not isinstance(biases, dict):
        raise RequestError(f"logit_bias must be a map from token id to bias, got {type_name(biases)}",
                           param="logit_bias")
    check_count(data, "logit_bias", model.limits.max_logit_bias_entries, "HFENDPOINT_MAX_LOGIT_BIAS_ENTRIES")
    parsed, vocab_size = {}, model.vocab_size or len(model.tokenizer)
    for key, bias in biases.items():
        token = key if isinstance(key, int) and not isinstance(key, bool) else _token_id(key)
        if token is None or not 0 <= token < vocab_size:
            raise RequestError(f"logit_bias: {key!r:.100} is not a token id of this model (0 to {vocab_size - 1})",
                               param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not abs(bias) <= MAX_LOGIT_BIAS:
            raise RequestError(f"logit_bias[{key!r:.100}] must be a number from -{MAX_LOGIT_BIAS} to {MAX_LOGIT_BIAS}, "
                               f"got {bias!r}", param="logit_bias")
        parsed[token] = float(bias)
    return parsed or None


def _token_id(key) -> int | None:
    """A key's token id: ASCII digits only (int() also reads other scripts' digits), and few enough of them."""
    digits = key.strip() if isinstance(key, str) else ""
    return int(digits) if digits.isascii() and digits.isdigit() and len(digits) <= MAX_TOKEN_ID_DIGITS else None


def response_schema(response_format) -> dict | None:
    """The JSON schema a response_format asks the reply to follow; None for plain text. `strict` is accepted
    either way: the schema is always enforced."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind not in RESPONSE_FORMATS:
        raise RequestError(f"response_format must be a map whose type is one of {', '.join(RESPONSE_FORMATS)}, "
                           f"got {response_format!r:.200}", param="response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise RequestError('response_format.json_schema must be a map: {"name": ..., "schema": {...}}',
                           param="response_format")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise RequestError(f"response_format.json_schema.schema must be a JSON schema object, got {type_name(schema)}",
                           param="response_format")
    for key, kind in (("name", str), ("description", str), ("strict", bool)):
        if spec.get(key) is not None and not isinstance(spec[key], kind):
            raise RequestError(f"response_format.json_schema.{key} must be a {kind.__name__}", param="response_format")
    return schema


def check_stream_options(data: dict) -> None:
    options = data.get("stream_options")
    if options is None:
        return
    if not data.get("stream"):
        raise RequestError("stream_options is only allowed with stream: true", param="stream_options")
    if not isinstance(options, dict):
        raise RequestError(f"stream_options must be a map, got {type_name(options)}", param="stream_options")
    for key, value in options.items():
        if key not in STREAM_OPTIONS:
            raise RequestError(f"stream_options.{key} is not supported (only {', '.join(STREAM_OPTIONS)})",
                               param="stream_options")
        if value is not None and not isinstance(value, bool):
            raise RequestError(f"stream_options.{key} must be a boolean, got {value!r}", param="stream_options")
