"""The tools of a chat request: `tools`, `tool_choice`, `parallel_tool_calls`, and tool calls in the messages.

- `"auto"` (the default with tools): the tools go to the chat template, and the reply is parsed in the tool-call
  format the template teaches (handler/tool_calls.py). A template that teaches none cannot be served "auto": the
  request is refused (as vLLM refuses auto tool choice without a parser) rather than returning calls as text.
  With `parallel_tool_calls: false` the reply ends after its first call.
- `"required"` and a named function: the tools go to the template too, and a grammar forces the calls whatever
  the model and template: "required" an array of `{"name": <a tool>, "arguments": <its parameters>}` (one item
  at most without parallel calls), a named function that function's arguments object alone.
- `"none"`: the tools are left out of the prompt (as vLLM's --exclude-tools-when-tool-choice-none), so the
  model is not prompted to call one; the reply is plain content.

Assistant turns that carry `tool_calls` have their arguments (a JSON string in OpenAI's API) turned into
objects for the template, as vLLM does; arguments that are not a JSON object (a call that an earlier reply's
max_tokens cut short) reach the template as the string they were sent as, as OpenAI accepts them. `role: "tool"`
turns need their `tool_call_id`.
"""
import json
from dataclasses import dataclass

from daemon_protocol import RequestError
from schema.chat import ChatCompletionRequest, Function, Message, NamedToolChoice

NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    template_tools: list[dict] | None  # what the chat template gets as `tools`
    style: str | None                  # the reply's parser (tool_calls.ToolCallParser style); None: plain content
    function_name: str | None = None   # a named tool_choice's function
    schema: dict | None = None         # the JSON schema a grammar enforces
    parallel: bool = True


def parse_tools(request: ChatCompletionRequest, sent_tools: list[dict] | None, template_format: str | None) -> ToolPlan:
    """sent_tools: the request's tools as sent (the template reads every key of them)."""
    functions = tool_functions(request)
    parallel = request.parallel_tool_calls
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if functions else "none"
    if choice == "none":
        return ToolPlan(None, None, parallel=parallel)
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    if not functions:
        raise RequestError(f"tool_choice {named or choice!r} needs tools: the request has none", param="tool_choice")
    if named is not None:
        if named not in functions:
            raise RequestError(f"tool_choice names the function {named!r}, which is not among the tools "
                               f"({', '.join(functions)})", param="tool_choice")
        return ToolPlan(sent_tools, "arguments", named, parameters(functions[named]), parallel)
    if choice == "required":
        return ToolPlan(sent_tools, "json_array", None, calls_schema(functions.values(), parallel), parallel)
    if template_format is None:
        raise RequestError("tool_choice 'auto' (the default with tools): this model's chat template shows no "
                           "tool-call format to read the reply in (Hermes <tool_call>, Llama 3 JSON, Mistral "
                           "[TOOL_CALLS]); use tool_choice 'required' or a named function, which work with any model",
                           param="tool_choice")
    return ToolPlan(sent_tools, template_format, parallel=parallel)


def tool_functions(request: ChatCompletionRequest) -> dict[str, Function]:
    """The tools' functions by name; a name defined twice is refused."""
    functions = {}
    for i, tool in enumerate(request.tools or ()):
        name = tool.function.name
        if name in functions:
            raise RequestError(f"tools[{i}].function.name: {name!r} is defined twice", param="tools")
        functions[name] = tool.function
    return functions


def parameters(function: Function) -> dict:
    """A function's parameters schema; one that declares none takes an empty object (OpenAI's reading)."""
    return function.parameters or NO_PARAMETERS


def calls_schema(functions, parallel: bool) -> dict:
    """The JSON schema of a `required` reply: an array of calls, each one of the tools with its arguments."""
    calls = [{"type": "object", "properties": {"name": {"const": function.name}, "arguments": parameters(function)},
              "required": ["name", "arguments"], "additionalProperties": False} for function in functions]
    return {"type": "array", "items": {"anyOf": calls}, "minItems": 1, **({} if parallel else {"maxItems": 1})}


def prepare_tool_turns(messages: list[dict], checked: list[Message]) -> list[dict]:
    """Assistant tool calls with their arguments as objects, and tool results checked for their call id.
    messages: the template's copies of the request's messages; checked: the same, decoded (schema/chat.py)."""
    for i, (message, typed) in enumerate(zip(messages, checked)):
        if typed.tool_calls is not None:
            if typed.speaker != "assistant":
                raise RequestError(f"messages[{i}].tool_calls: only assistant messages carry tool calls",
                                   param="messages")
            message["tool_calls"] = [tool_call_for_template(call, f"messages[{i}].tool_calls[{j}]")
                                     for j, call in enumerate(message["tool_calls"])]
        if typed.speaker == "tool" and typed.tool_call_id is None:
            raise RequestError(f"messages[{i}].tool_call_id must be the id of the call this tool result answers",
                               param="messages")
    return messages


def tool_call_for_template(call: dict, where: str) -> dict:
    """A call as sent (its types checked by the schema), its arguments read from their JSON string."""
    function = call["function"]
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json_object_or_text(arguments)
        except RecursionError:
            raise RequestError(f"{where}.function.arguments nests too deeply to read", param="messages") from None
    return {**call, "type": call.get("type") or "function", "function": {**function, "arguments": arguments or {}}}


def json_object_or_text(arguments: str) -> dict | str:
    """Arguments as the object their JSON holds ({} for blank ones), else the text as sent."""
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments
