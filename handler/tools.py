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
import re
from dataclasses import dataclass

from handler.chat import RequestError, type_name

NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOOL_CHOICE_MODES = ("none", "auto", "required")
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    template_tools: list[dict] | None  # what the chat template gets as `tools`
    style: str | None                  # the reply's parser (tool_calls.ToolCallParser style); None: plain content
    function_name: str | None = None   # a named tool_choice's function
    schema: dict | None = None         # the JSON schema a grammar enforces
    parallel: bool = True


def parse_tools(data: dict, template_format: str | None) -> ToolPlan:
    tools = parse_tool_list(data.get("tools"))
    parallel = data.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError(f"parallel_tool_calls must be a boolean, got {parallel!r}", param="parallel_tool_calls")
    parallel = parallel is not False
    choice = data.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    named = parse_named_choice(choice) if isinstance(choice, dict) else None
    if named is None and choice not in TOOL_CHOICE_MODES:
        raise RequestError(f"tool_choice must be one of {', '.join(TOOL_CHOICE_MODES)} or "
                           f'{{"type": "function", "function": {{"name": ...}}}}, got {choice!r}', param="tool_choice")
    if choice == "none":
        return ToolPlan(None, None, parallel=parallel)
    if not tools:
        raise RequestError(f"tool_choice {choice!r} needs tools: the request has none", param="tool_choice")
    functions = {tool["function"]["name"]: tool["function"] for tool in tools}
    if named is not None:
        if named not in functions:
            raise RequestError(f"tool_choice names the function {named!r}, which is not among the tools "
                               f"({', '.join(functions)})", param="tool_choice")
        return ToolPlan(tools, "arguments", named, parameters(functions[named]), parallel)
    if choice == "required":
        return ToolPlan(tools, "json_array", None, calls_schema(functions.values(), parallel), parallel)
    if template_format is None:
        raise RequestError("tool_choice 'auto' (the default with tools): this model's chat template shows no "
                           "tool-call format to read the reply in (Hermes <tool_call>, Llama 3 JSON, Mistral "
                           "[TOOL_CALLS]); use tool_choice 'required' or a named function, which work with any model",
                           param="tool_choice")
    return ToolPlan(tools, template_format, parallel=parallel)


def parse_tool_list(tools) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list) or not tools:
        raise RequestError(f"tools must be a non-empty list of tools, got {tools!r:.100}", param="tools")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type_name(tool)
            raise RequestError(f'{where}: only tools of type "function" are supported, got {kind!r}', param="tools")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise RequestError(f"{where}.function must be a map with the function's name and parameters", param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise RequestError(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
                               param="tools")
        if name in names:
            raise RequestError(f"{where}.function.name: {name!r} is defined twice", param="tools")
        names.add(name)
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise RequestError(f"{where}.function.parameters must be a JSON schema object", param="tools")
        for key, kind in (("description", str), ("strict", bool)):
            if function.get(key) is not None and not isinstance(function[key], kind):
                raise RequestError(f"{where}.function.{key} must be a {kind.__name__}", param="tools")
    return tools


def parse_named_choice(choice: dict) -> str:
    function = choice.get("function")
    if choice.get("type") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(f'tool_choice must name a function as {{"type": "function", "function": {{"name": ...}}}}, '
                           f"got {choice!r:.200}", param="tool_choice")
    return function["name"]


def parameters(function: dict) -> dict:
    """A function's parameters schema; one that declares none takes an empty object (OpenAI's reading)."""
    return function.get("parameters") or NO_PARAMETERS


def calls_schema(functions, parallel: bool) -> dict:
    """The JSON schema of a `required` reply: an array of calls, each one of the tools with its arguments."""
    calls = [{"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters(function)},
              "required": ["name", "arguments"], "additionalProperties": False} for function in functions]
    return {"type": "array", "items": {"anyOf": calls}, "minItems": 1, **({} if parallel else {"maxItems": 1})}


def prepare_tool_turns(messages: list[dict]) -> list[dict]:
    """Assistant tool calls with their arguments as objects, and tool results checked for their call id."""
    for i, message in enumerate(messages):
        if message.get("tool_calls") is not None:
            message["tool_calls"] = [tool_call_for_template(call, f"messages[{i}].tool_calls[{j}]")
                                     for j, call in enumerate(assistant_tool_calls(message, f"messages[{i}]"))]
        if message["role"] == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise RequestError(f"messages[{i}].tool_call_id must be the id of the call this tool result answers",
                               param="messages")
    return messages


def assistant_tool_calls(message: dict, where: str) -> list:
    calls = message["tool_calls"]
    if message["role"] != "assistant":
        raise RequestError(f"{where}.tool_calls: only assistant messages carry tool calls", param="messages")
    if not isinstance(calls, list):
        raise RequestError(f"{where}.tool_calls must be a list of tool calls, got {type_name(calls)}", param="messages")
    return calls


def tool_call_for_template(call, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(f'{where} must be {{"id": ..., "type": "function", "function": {{"name": ..., '
                           f'"arguments": ...}}}}', param="messages")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json_object_or_text(arguments)
        except RecursionError:
            raise RequestError(f"{where}.function.arguments nests too deeply to read", param="messages") from None
    elif arguments is not None and not isinstance(arguments, dict):
        raise RequestError(f"{where}.function.arguments must be a JSON string, got {type_name(arguments)}",
                           param="messages")
    return {**call, "type": call.get("type", "function"), "function": {**function, "arguments": arguments or {}}}


def json_object_or_text(arguments: str) -> dict | str:
    """Arguments as the object their JSON holds ({} for blank ones), else the text as sent."""
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments
