"""OpenAI's chat completion request (and the fields legacy completions share with it), as the handler serves it.

A field left out (or null) is None unless a default is given; sampling fields left out take the model's defaults
(generation_config.json) in the handler. A field this server does not know is refused, naming it and the
fields it knows: nothing a client asks for is ignored silently. OpenAI's bookkeeping fields that change nothing
in the reply (user, metadata, store, service_tier, prompt_cache_key, safety_identifier) are accepted.
"""
import sys
from typing import Annotated, Any, Literal

from msgspec import Meta, Struct, field

from daemon_protocol.errors import RequestError

FINITE = sys.float_info.max  # an upper bound that refuses infinity (and NaN, which no bound admits)
ROLES = ("system", "user", "assistant", "tool", "developer")
TOOL_CHOICE_MODES = ("none", "auto", "required")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
MAX_LOGIT_BIAS = 100  # the largest bias, as OpenAI takes
SEED_LIMIT = 2**64  # seeds are unsigned 64-bit (msgspec bounds stop at 64-bit signed: Sampling checks the top)
SEEDS = "an integer in [0, 2**64)"
BIASES = f"a number from -{MAX_LOGIT_BIAS} to {MAX_LOGIT_BIAS}"


def number(description: str, **bounds) -> Any:
    """A finite number within bounds; its error says `description`."""
    finite = {"ge": -FINITE} if "gt" not in bounds else {}
    return Annotated[float, Meta(**{**finite, "le": FINITE, **bounds}, description=description)]


def integer(description: str, **bounds) -> Any:
    return Annotated[int, Meta(**bounds, description=description)]


def described(kind, description: str) -> Any:
    return Annotated[kind, Meta(description=description)]


Boolean = described(bool, "a boolean")
String = described(str, "a string")
Map = described(dict, "a map")
NonEmptyString = Annotated[str, Meta(min_length=1, description="a non-empty string")]
Stop = described(NonEmptyString | list[NonEmptyString], "a non-empty string or a list of non-empty strings")
Temperature = number("a number >= 0", ge=0)
TopP = number("a number in (0, 1]", gt=0, le=1)
TopK = integer("an integer (0 or less: off)")
MaxTokens = integer("an integer >= 1", ge=1)


class StreamOptions(Struct, forbid_unknown_fields=True):
    include_usage: Boolean | None = None


class StreamFields(Struct):
    """What the front reads of a streamed request before forwarding it (the handler reads them again)."""

    stream: Boolean = False
    stream_options: described(StreamOptions, "a map") | None = None


class Sampling(StreamFields):
    """The fields chat and legacy completions share."""

    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: number("a number in [0, 1]", ge=0, le=1) | None = None
    presence_penalty: number("a number in [-2, 2]", ge=-2, le=2) | None = None
    frequency_penalty: number("a number in [-2, 2]", ge=-2, le=2) | None = None
    repetition_penalty: number("a number in (0, 2]", gt=0, le=2) | None = None
    seed: integer(SEEDS, ge=0) | None = None
    ignore_eos: Boolean = False
    max_tokens: MaxTokens | None = None
    n: integer("an integer >= 1", ge=1) = 1
    stop: Stop | None = None
    logit_bias: described(dict, "a map from token id to bias") | None = None  # values: __post_init__
    model: String | None = None
    user: String | None = None
    metadata: Map | None = None
    store: Boolean | None = None
    service_tier: String | None = None
    prompt_cache_key: String | None = None
    safety_identifier: String | None = None

    def __post_init__(self):
        if self.seed is not None and self.seed >= SEED_LIMIT:
            raise RequestError(f"seed must be {SEEDS}, got {self.seed}", param="seed")
        for key, bias in (self.logit_bias or {}).items():  # here: msgspec's errors do not say which key
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not abs(bias) <= MAX_LOGIT_BIAS:
                raise RequestError(f"logit_bias[{key!r:.100}] must be {BIASES}, got {bias!r:.100}", param="logit_bias")

    def stop_strings(self) -> tuple[str, ...]:
        return () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ContentPart(Struct):
    """A text part (OpenAI's "text", the Responses API's "input_text" and "output_text") or an image part, whose
    image_url handler/images.py reads."""

    type: String = "text"
    text: String | None = None
    image_url: Any = None


class FunctionCall(Struct):
    name: String
    arguments: described(str | dict, "a JSON string") | None = None


class ToolCall(Struct):
    function: described(FunctionCall, 'a map: {"name": ..., "arguments": ...}')
    id: String | None = None
    type: String = "function"


class Message(Struct):
    """A message as the chat template reads it (its other keys pass to the template as sent)."""

    role: described(Literal[ROLES], f"one of {', '.join(ROLES)}") | None = None
    content: described(str | list[described(ContentPart, "a map: a text or image_url part")],
                       "a string or a list of text parts") | None = None
    name: String | None = None
    tool_calls: described(list[described(ToolCall, 'a map: {"id": ..., "type": "function", "function": {"name": '
                                                   '..., "arguments": ...}}')],
                          "a list of tool calls") | None = None
    tool_call_id: String | None = None

    @property
    def speaker(self) -> str:
        """The role; a message without one is the user's."""
        return self.role or "user"


class Function(Struct):
    name: Annotated[str, Meta(pattern="^[A-Za-z0-9_-]{1,64}$", description="1-64 letters, digits, '_' or '-'")]
    description: String | None = None
    parameters: described(dict, "a JSON schema object") | None = None
    strict: Boolean | None = None


class Tool(Struct):
    function: described(Function, "a map with the function's name and parameters")
    type: described(Literal["function"], '"function" (the only tools supported)') = "function"


class NamedFunction(Struct):
    name: String


class NamedToolChoice(Struct):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(Struct):
    schema_: described(dict, "a JSON schema object") = field(name="schema")
    name: String | None = None
    description: String | None = None
    strict: Boolean | None = None


class ResponseFormat(Struct):
    type: described(Literal[RESPONSE_FORMATS], f"one of {', '.join(RESPONSE_FORMATS)}")
    json_schema: described(JsonSchemaFormat, 'a map: {"name": ..., "schema": {...}}') | None = None


class ChatCompletionRequest(Sampling, kw_only=True, forbid_unknown_fields=True):
    messages: Annotated[list[described(Message, "a map with role and content")],
                        Meta(min_length=1, description="a non-empty list of messages")]
    max_completion_tokens: MaxTokens | None = None
    logprobs: Boolean = False
    top_logprobs: integer("an integer >= 0", ge=0) | None = None
    tools: Annotated[list[described(Tool, 'a map: {"type": "function", "function": {...}}')],
                     Meta(min_length=1, description="a non-empty list of tools")] | None = None
    tool_choice: described(Literal[TOOL_CHOICE_MODES] | NamedToolChoice,
                           f'one of {", ".join(TOOL_CHOICE_MODES)} or '
                           '{"type": "function", "function": {"name": ...}}') | None = None
    parallel_tool_calls: Boolean = True
    response_format: described(ResponseFormat,
                               f"a map whose type is one of {', '.join(RESPONSE_FORMATS)}") | None = None
    add_generation_prompt: Boolean = True
    chat_template: String | None = None
    chat_template_kwargs: Map | None = None
    functions: Any = None  # OpenAI's deprecated forms of tools and tool_choice: refused by name
    function_call: Any = None
