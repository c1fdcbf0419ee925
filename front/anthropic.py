"""Anthropic's Messages API (`POST /v1/messages`) on the same `chat_completions` handler call as chat completions.

chat_data turns a Messages request into the OpenAI-shaped chat data the handler takes (system prompt, text,
tool_use and tool_result blocks, tools, tool_choice, sampling); MessageEvents turns the reply chunks
(docs/chat-extensions.md) into Anthropic's stream events and, gathered, its `message` object. Failures leave in
Anthropic's error shape (anthropic_errors). docs/anthropic-messages.md says what maps onto what.
"""
import json
import uuid

from aiohttp import web

from daemon_protocol import RequestError
from schema import decode
from schema.anthropic import MessagesRequest

from .handler_connection import HandlerError, HandlerGone

MESSAGES_PATH = "/v1/messages"
SAMPLING_FIELDS = ("temperature", "top_p", "top_k")  # the same names and meaning in the chat request
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # and "tool", a named function
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}  # "stop" is end_turn or stop_sequence
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


# Request: Anthropic's Messages request -> the chat data of the chat_completions handler call
def chat_data(body: dict) -> dict:
    """The chat request for a Messages request; RequestError naming the field for anything it cannot carry. The
    top-level fields are checked by the schema (schema/anthropic.py), with the chat fields' own types."""
    request = decode(body, MessagesRequest)
    tools = chat_tools(request.tools)
    data = {"model": request.model, "max_tokens": request.max_tokens, "stream": request.stream,
            "messages": system_messages(request.system) + chat_messages(request.messages),
            **{key: getattr(request, key) for key in SAMPLING_FIELDS if getattr(request, key) is not None}}
    if tools:
        data["tools"] = tools
    data.update(chat_tool_choice(request.tool_choice, bool(tools)))
    if request.stop_sequences:
        data["stop"] = request.stop_sequences
    return data


def system_messages(system) -> list[dict]:
    if system is None:
        return []
    text = system if isinstance(system, str) else block_text(system, "system", "system")
    return [{"role": "system", "content": text}] if text else []


def block_text(blocks, where: str, param: str) -> str:
    """The text of a list of text blocks, joined by newlines (what a string would say)."""
    if not isinstance(blocks, list):
        raise RequestError(f"{where} must be a string or a list of text blocks", param=param)
    texts = []
    for i, block in enumerate(blocks):
        check_block(block, f"{where}[{i}]", ("text",), param)
        texts.append(block["text"])
    return "\n".join(texts)


def check_block(block, where: str, kinds: tuple[str, ...], param: str) -> str:
    """A content block's type, one of kinds, with the keys that type needs."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in kinds:
        raise RequestError(f"{where}.type must be {' or '.join(map(repr, kinds))} here, got {kind!r:.50}"
                           + (": this server reads text only" if kind in ("image", "document") else ""), param=param)
    needs = {"text": {"text": str}, "thinking": {"thinking": str},
             "tool_use": {"id": str, "name": str, "input": dict}, "tool_result": {"tool_use_id": str}}[kind]
    for key, type_ in needs.items():
        if not isinstance(block.get(key), type_):
            raise RequestError(f"{where}.{key} must be {'an object' if type_ is dict else 'a string'}", param=param)
    return kind


def chat_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of messages", param="messages")
    chat = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise RequestError(f"{where}.role must be 'user' or 'assistant', got {role!r:.50}", param="messages")
        content = message.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        elif not isinstance(content, list):
            raise RequestError(f"{where}.content must be a string or a list of content blocks", param="messages")
        chat += (user_messages if role == "user" else assistant_messages)(content, f"{where}.content")
    if messages[-1]["role"] == "assistant":
        raise RequestError(f"messages[{len(messages) - 1}]: the last message must be the user's; continuing a "
                           "final assistant message (prefill) is not supported", param="messages")
    return chat


def user_messages(blocks: list, where: str) -> list[dict]:
    """A user turn: its tool results, each a `tool` message, then its text as a user message."""
    results, texts = [], []
    for i, block in enumerate(blocks):
        if check_block(block, f"{where}[{i}]", ("text", "tool_result"), "messages") == "text":
            texts.append(block["text"])
        else:
            results.append(tool_message(block, f"{where}[{i}]"))
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts or not results else [])


def tool_message(block: dict, where: str) -> dict:
    content = block.get("content")
    if content is None or isinstance(content, str):
        text = content or ""
    else:
        text = block_text(content, f"{where}.content", "messages")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise RequestError(f"{where}.is_error must be a boolean", param="messages")
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": f"Error: {text}" if is_error else text}


def assistant_messages(blocks: list, where: str) -> list[dict]:
    """An assistant turn: its text, its thinking as reasoning_content, its tool_use blocks as tool calls."""
    texts, thinking, calls = [], [], []
    for i, block in enumerate(blocks):
        kind = check_block(block, f"{where}[{i}]", ("text", "thinking", "tool_use"), "messages")
        if kind == "text":
            texts.append(block["text"])
        elif kind == "thinking":
            thinking.append(block["thinking"])
        else:
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
    message = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return [message]


def chat_tools(tools) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of tools", param="tools")
    chat = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise RequestError(f"{where} must be an object with name and input_schema", param="tools")
        if tool.get("type", "custom") not in ("custom", None):
            raise RequestError(f"{where}.type: {tool['type']!r:.60} is one of Anthropic's server tools, which this "
                               "server does not run; define it as a custom tool with name and input_schema",
                               param="tools")
        if not isinstance(tool.get("name"), str):
            raise RequestError(f"{where}.name must be a string", param="tools")
        if not isinstance(tool.get("input_schema"), dict):
            raise RequestError(f"{where}.input_schema must be a JSON schema object", param="tools")
        if tool.get("description") is not None and not isinstance(tool["description"], str):
            raise RequestError(f"{where}.description must be a string", param="tools")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        chat.append({"type": "function", "function": function})
    return chat


def chat_tool_choice(choice, has_tools: bool) -> dict:
    """tool_choice and parallel_tool_calls of the chat request."""
    if choice is None:
        return {}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in (*TOOL_CHOICES, "tool"):
        raise RequestError(f"tool_choice.type must be one of auto, any, tool, none, got {kind!r:.50}",
                           param="tool_choice")
    if kind == "tool" and not isinstance(choice.get("name"), str):
        raise RequestError('tool_choice.name must name the tool to call with {"type": "tool"}', param="tool_choice")
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError("tool_choice.disable_parallel_tool_use must be a boolean", param="tool_choice")
    if not has_tools:
        if kind in ("auto", "none"):
            return {}
        raise RequestError(f"tool_choice {kind!r} needs tools: the request has none", param="tool_choice")
    named = {"type": "function", "function": {"name": choice.get("name")}}
    return {"tool_choice": named if kind == "tool" else TOOL_CHOICES[kind],
            **({"parallel_tool_calls": False} if parallel else {})}


# Reply: chat reply chunks -> Anthropic's stream events and message
class MessageEvents:
    """One reply's chunks as Anthropic's stream events (start(), then add(chunk) for each), and the message they
    make (message(), once the last chunk is in)."""

    def __init__(self, model: str):
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.blocks: list[dict] = []
        self._inputs: dict[int, str] = {}  # a tool_use block's input JSON as streamed, by block index
        self._open: tuple | None = None  # the open block's ("text"|"thinking",) or ("tool_use", call index)
        self.stop_reason = self.stop_sequence = None
        self.usage = {"input_tokens": 0, "output_tokens": 0}

    def start(self) -> list[dict]:
        return [{"type": "message_start", "message": self._message([])}]

    def add(self, payload: dict) -> list[dict]:
        events = []
        if payload.get("reasoning_content"):
            events += self._delta(("thinking",), {"type": "thinking_delta", "thinking": payload["reasoning_content"]})
        if payload.get("content"):
            events += self._delta(("text",), {"type": "text_delta", "text": payload["content"]})
        for call in payload.get("tool_calls") or ():
            events += self._tool_call_delta(call)
        if payload.get("finish_reason") is not None:
            events += self._finish(payload)
        return events

    def message(self) -> dict:
        content = [{**block, "input": tool_input(self._inputs[i])} if block["type"] == "tool_use" else block
                   for i, block in enumerate(self.blocks)]
        return self._message(content)

    def _message(self, content: list[dict]) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence, "usage": dict(self.usage)}

    def _delta(self, key: tuple, delta: dict) -> list[dict]:
        events = []
        if self._open != key:
            events += self._start_block(key, {"type": "text", "text": ""} if key[0] == "text" else
                                        {"type": "thinking", "thinking": "", "signature": ""})
        block = self.blocks[-1]
        block[key[0]] += delta[key[0]]
        return events + [{"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}]

    def _tool_call_delta(self, call: dict) -> list[dict]:
        function = call.get("function") or {}
        key = ("tool_use", call.get("index", 0))
        events = []
        if "id" in call:
            events += self._start_block(key, {"type": "tool_use", "id": call["id"], "name": function.get("name"),
                                              "input": {}})
            self._inputs[len(self.blocks) - 1] = ""
        arguments = function.get("arguments")
        if arguments and self._open == key:
            self._inputs[len(self.blocks) - 1] += arguments
            events.append({"type": "content_block_delta", "index": len(self.blocks) - 1,
                           "delta": {"type": "input_json_delta", "partial_json": arguments}})
        return events

    def _start_block(self, key: tuple, block: dict) -> list[dict]:
        events = self._close_block()
        self.blocks.append(block)
        self._open = key
        return events + [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}]

    def _close_block(self) -> list[dict]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _finish(self, payload: dict) -> list[dict]:
        reason = payload["finish_reason"]
        self.stop_sequence = payload.get("stop_sequence") if reason == "stop" else None
        self.stop_reason = STOP_REASONS.get(reason, "stop_sequence" if self.stop_sequence else "end_turn")
        usage = payload.get("usage") or {}
        self.usage = {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0)}
        return self._close_block() + [
            {"type": "message_delta", "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
             "usage": dict(self.usage)},
            {"type": "message_stop"}]


def tool_input(arguments: str) -> dict:
    """A tool_use block's input: the call's arguments object ({} when max_tokens cut them before they closed)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


async def stream_events(request: web.Request, chunks, events: MessageEvents) -> web.StreamResponse:
    """The reply as Anthropic's SSE events. The response starts with the first chunk, so that a request the
    handler refuses at once gets a plain HTTP error; a failure after that is an `error` event."""
    response = None
    try:
        try:
            async for payload in chunks:
                new = []
                if response is None:
                    response = web.StreamResponse(headers=SSE_HEADERS)
                    await response.prepare(request)
                    new = events.start()
                await response.write(b"".join(map(sse_event, new + events.add(payload))))
        except (HandlerError, HandlerGone, TimeoutError) as exc:
            if response is None:
                raise
            await response.write(sse_event(error_body(exc.status if isinstance(exc, HandlerError) else 500, str(exc))))
            return response
        await response.write_eof()
        return response
    except ConnectionResetError:  # the client went away
        return response


def sse_event(event: dict) -> bytes:
    return f"event: {event['type']}\ndata: ".encode() + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


# Errors
def error_body(status: int, message: str) -> dict:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


@web.middleware
async def anthropic_errors(request: web.Request, handler):
    """The front's error responses on the Messages route, in Anthropic's shape (the OpenAI-shaped error's message,
    which names the field, and its status)."""
    response = await handler(request)
    if response.status < 400 or not request.path.startswith(MESSAGES_PATH) or not isinstance(response, web.Response):
        return response
    try:
        message = json.loads(response.body)["error"]["message"]
    except (TypeError, ValueError, KeyError):
        message = response.text or response.reason
    return web.json_response(error_body(response.status, message), status=response.status)
