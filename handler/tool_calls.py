"""Tool calls in generated text: which format a model writes them in, and a parser that turns the text, as it
streams, into content and OpenAI tool-call deltas.

Formats (`tool_call_format` picks one from the chat template's text, for `tool_choice: "auto"`):
  hermes       Hermes, Qwen2.5, Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated
  llama3_json  Llama 3.1-3.3: `{"name": ..., "parameters": {...}}` as the whole reply, optionally after
               `<|python_tag|>`, several separated by `;`
  mistral      `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer `[TOOL_CALLS]name[ARGS]{...}`
and two that the grammar forces whatever the model (handler/tools.py):
  json_array   `tool_choice: "required"`: `[{"name": ..., "arguments": {...}}, ...]`
  arguments    a named `tool_choice`: the arguments object of that function alone

A call's deltas are OpenAI's: the first carries index, id, type, the name and the argument text read with it
(possibly ""), later ones carry argument fragments that join into the arguments JSON exactly as the model wrote
it. What one feed returns holds at most one delta per call index, as OpenAI streams them: clients that read only
the first entry for an index lose nothing. Text outside calls stays
content; whitespace between content and a call, or after a call, is dropped.
"""
import json
import re
import uuid
from dataclasses import dataclass, field

from handler.text_markers import MarkerScanner

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
# the strings each format needs to see in the text (some tokenizers make them special tokens, which decoding drops)
FORMAT_MARKERS = {"hermes": (HERMES_OPEN, HERMES_CLOSE), "llama3_json": (PYTHON_TAG,),
                  "mistral": (MISTRAL_CALLS, MISTRAL_ARGS)}
WHITESPACE = " \t\r\n"
NAME_KEYS = ("name",)
ARGUMENT_KEYS = ("arguments", "parameters")
LLAMA_CALL_START = '{"name"'


def tool_call_format(chat_template: str | None) -> str | None:
    """The auto tool-call format the chat template teaches its model, or None when it shows none."""
    template = chat_template or ""
    if HERMES_OPEN in template:
        return "hermes"
    if MISTRAL_CALLS in template:
        return "mistral"
    if PYTHON_TAG in template or "ipython" in template:
        return "llama3_json"
    return None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class Parsed:
    """What a piece of generated text adds: content, and tool-call deltas in OpenAI's shape."""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)


@dataclass
class ToolCall:
    name: str
    arguments: str


def parse_tool_calls(text: str, style: str, function_name: str | None = None) -> tuple[str, list[ToolCall]]:
    """Non-streaming: the content and the complete calls in a whole generated text."""
    parser = ToolCallParser(style, function_name)
    first, last = parser.feed(text), parser.finish()
    return first.content + last.content, parser.calls


class JsonValue:
    """Follows one JSON value character by character (strings with escapes, nesting) to say where it ends."""

    def __init__(self):
        self.depth = 0
        self.in_string = self.escaped = self.scalar = self.started = self.done = False

    def take(self, ch: str) -> bool:
        """Whether ch belongs to the value; False when the value (a number, true, false, null) ended before it."""
        if not self.started:
            self.started = True
            self.in_string, self.depth, self.scalar = ch == '"', int(ch in "{["), ch not in '"{['
            return True
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                self.done = self.depth == 0
            return True
        if self.scalar:
            if ch in ",}] \t\r\n":
                self.done = True
                return False
            return True
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            self.done = self.depth == 0
        return True


class CallObject:
    """Reads one `{"name": ..., "arguments": ...}` object character by character. Reports the name once it is
    complete and the arguments' characters as they come (a string holding JSON, as some models write, is
    decoded at its end). `done` once the object closes; `failed` when the text is not such an object."""

    def __init__(self, on_name, on_arguments):
        self.on_name, self.on_arguments = on_name, on_arguments
        self.state = "open"
        self.key, self.key_escaped = "", False
        self.value: JsonValue | None = None
        self.streams_value = False  # the value is the arguments' text itself
        self.value_text: str | None = None  # a name, or arguments given as a string, read whole
        self.done = self.failed = False

    def take(self, ch: str) -> None:
        if self.state == "value":
            self._take_value(ch)
        elif self.state == "key":
            self._take_key(ch)
        elif ch in WHITESPACE:
            return
        elif self.state == "open":
            self._expect(ch, "{", "member")
        elif self.state == "member":
            if ch == "}":
                self.done = True
            elif ch != ",":
                self.key = ""
                self._expect(ch, '"', "key")
        elif self.state == "colon":
            self._expect(ch, ":", "value")
            self.value = JsonValue()

    def _expect(self, ch: str, wanted: str, next_state: str) -> None:
        if ch == wanted:
            self.state = next_state
        else:
            self.failed = True

    def _take_key(self, ch: str) -> None:
        if ch == '"' and not self.key_escaped:
            self.key = json.loads(f'"{self.key}"')
            self.state = "colon"
            return
        self.key += ch
        self.key_escaped = ch == "\\" and not self.key_escaped

    def _take_value(self, ch: str) -> None:
        if not self.value.started:
            if ch in WHITESPACE:
                return
            self.streams_value = self.key in ARGUMENT_KEYS and ch != '"'
            self.value_text = "" if self.key in NAME_KEYS + ARGUMENT_KEYS and not self.streams_value else None
        taken = self.value.take(ch)
        if taken and self.streams_value:
            self.on_arguments(ch)
        elif taken and self.value_text is not None:
            self.value_text += ch
        if self.value.done:
            self.state = "member"
            self._value_read()
            if not taken:
                self.take(ch)

    def _value_read(self) -> None:
        if self.value_text is None:
            return
        try:
            value = json.loads(self.value_text)
        except ValueError:
            self.failed = True
            return
        if isinstance(value, str):
            (self.on_name if self.key in NAME_KEYS else self.on_arguments)(value)


class ToolCallParser:
    """Generated text -> content and tool-call deltas, fed piece by piece (see the module docstring)."""

    def __init__(self, style: str, function_name: str | None = None, max_calls: int | None = None):
        """function_name: the named tool_choice's (style "arguments"). max_calls: the text after that many
        complete calls is not read (`finished` says so)."""
        self.style = style
        self.max_calls = max_calls
        self.calls: list[ToolCall] = []  # every call begun, with its arguments so far
        self.state = {"hermes": "content", "mistral": "content", "llama3_json": "start",
                      "json_array": "array_open", "arguments": "arguments"}[style]
        self._function_name = function_name  # the named tool_choice's
        self._out = Parsed()
        self._held_space = ""  # trailing whitespace of the content: dropped if a call follows
        self._after_call = False  # whitespace that follows a call is dropped too
        self._call: CallObject | None = None
        self._awaiting_name = False  # the call object read so far has no name yet
        self._held_arguments: list[str] = []  # its arguments, until the name comes
        self._value: JsonValue | None = None  # a bare arguments value (mistral's newer form, named tool_choice)
        self._pending_name = ""
        self._start = ""  # llama3_json: the reply's first characters, until they say call or content
        opening = {"hermes": (HERMES_OPEN,), "llama3_json": (PYTHON_TAG,), "mistral": (MISTRAL_CALLS,)}
        self._openings = MarkerScanner(opening.get(style, ()))
        self._close = MarkerScanner((HERMES_CLOSE,))
        self._args_marker = MarkerScanner((MISTRAL_ARGS,))

    @property
    def finished(self) -> bool:
        return self.state == "trailing"

    def feed(self, text: str) -> Parsed:
        while text:
            text = getattr(self, f"_in_{self.state}")(text)
        out, self._out = self._out, Parsed()
        return out

    def finish(self) -> Parsed:
        """The end of the text: held-back content is released (its trailing whitespace only if no call came)."""
        if self.state == "content":
            self._content(self._openings.flush())
        elif self.state == "start":
            self._content(self._start)
        if not self.calls:
            self._out.content += self._held_space
        self._held_space = ""
        out, self._out = self._out, Parsed()
        return out

    # ---- states: each consumes some of the text and returns the rest ----------------------------

    def _in_content(self, text: str) -> str:
        before, marker, after = self._openings.split(text)
        self._content(before)
        if marker is None:
            return ""
        self._held_space = ""
        self.state = {HERMES_OPEN: "hermes_call", PYTHON_TAG: "llama_calls", MISTRAL_CALLS: "mistral_calls"}[marker]
        return after

    def _in_start(self, text: str) -> str:
        """llama3_json: a reply that opens with `{"name"` (whitespace aside) or `<|python_tag|>` is calls."""
        self._start += text
        head = self._start.lstrip(WHITESPACE)
        compact = re.sub(r"\s", "", head)
        if head.startswith(PYTHON_TAG):
            self.state = "llama_calls"
            return head[len(PYTHON_TAG):]
        if compact.startswith(LLAMA_CALL_START):
            self.state = "llama_calls"
            return head
        if head and not (PYTHON_TAG.startswith(head) or LLAMA_CALL_START.startswith(compact)):
            self.state = "content"
            return self._start
        return ""

    def _in_hermes_call(self, text: str) -> str:
        rest = self._read_call(text)
        if self._call is None and not self.finished:
            self.state = "hermes_close"
        return rest

    def _in_hermes_close(self, text: str) -> str:
        _, marker, after = self._close.split(text)  # what comes before it is not content (a malformed call)
        if marker is not None:
            self.state = "content"
        return after

    def _in_llama_calls(self, text: str) -> str:
        """Call objects separated by `;`; anything else ends them and is content."""
        if self._call is None:
            text = text.lstrip(WHITESPACE + ";")
            if not text:
                return ""
            if text[0] != "{":
                self.state = "content"
                return text
        return self._read_call(text)

    def _in_mistral_calls(self, text: str) -> str:
        text = text.lstrip(WHITESPACE)
        if text:
            self.state = "array_open" if text[0] == "[" else "mistral_name"
        return text

    def _in_mistral_name(self, text: str) -> str:
        before, marker, after = self._args_marker.split(text)
        self._pending_name += before
        if marker is not None:
            self._begin_call(self._pending_name.strip())
            self._pending_name = ""
            self._value, self.state = JsonValue(), "mistral_arguments"
        return after

    def _in_mistral_arguments(self, text: str) -> str:
        rest = self._read_value(text)
        if self._value.done:
            self._value, self.state = None, "content"
            self._call_ended()
        return rest

    def _in_arguments(self, text: str) -> str:
        """A named tool_choice: the whole text is the arguments of the one call."""
        if self._value is None:
            text = text.lstrip(WHITESPACE)
            if not text:
                return ""
            self._begin_call(self._function_name)
            self._value = JsonValue()
        rest = self._read_value(text)
        if self._value.done:
            self.state = "trailing"
        return rest

    def _in_array_open(self, text: str) -> str:
        text = text.lstrip(WHITESPACE)
        if not text:
            return ""
        if text[0] != "[":
            self.state = "content"
            return text
        self.state = "array"
        return text[1:]

    def _in_array(self, text: str) -> str:
        """The call objects of a JSON array, up to its `]`; what follows is content."""
        if self._call is None:
            text = text.lstrip(WHITESPACE + ",")
            if not text:
                return ""
            if text[0] != "{":
                self.state = "content" if self.style == "mistral" else "trailing"
                self._after_call = True
                return text[1:] if text[0] == "]" else text
        return self._read_call(text)

    def _in_trailing(self, text: str) -> str:
        """After the forced calls: nothing more belongs to the reply (the grammar allows only whitespace)."""
        return ""

    # ---- pieces ---------------------------------------------------------------------------------

    def _read_call(self, text: str) -> str:
        """Feeds a call object; returns the text after it once it has closed (or failed)."""
        if self._call is None:
            self._call = CallObject(self._name_read, self._arguments_read)
            self._awaiting_name = True
        for i, ch in enumerate(text):
            self._call.take(ch)
            if self._call.done or self._call.failed:
                self._end_call()
                return text[i + 1:]
        return ""

    def _end_call(self) -> None:
        done, self._call = self._call.done, None
        named, self._awaiting_name = not self._awaiting_name, False
        self._held_arguments.clear()  # those of a call object without a name: nothing to report
        if done and named and not self.calls[-1].arguments:
            self._arguments_read("{}")  # a call without arguments
        self._call_ended()

    def _call_ended(self) -> None:
        self._after_call = True
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            self.state = "trailing"

    def _read_value(self, text: str) -> str:
        for i, ch in enumerate(text):
            if not self._value.take(ch):
                return text[i:]
            self._arguments_read(ch)
            if self._value.done:
                return text[i + 1:]
        return ""

    def _name_read(self, name: str) -> None:
        self._begin_call(name)
        self._awaiting_name = False
        held, self._held_arguments = "".join(self._held_arguments), []
        if held:
            self._arguments_read(held)

    def _begin_call(self, name: str) -> None:
        self.calls.append(ToolCall(name, ""))
        self._out.tool_calls.append({"index": len(self.calls) - 1, "id": new_call_id(), "type": "function",
                                     "function": {"name": name, "arguments": ""}})

    def _arguments_read(self, fragment: str) -> None:
        if self._awaiting_name:
            self._held_arguments.append(fragment)
            return
        self.calls[-1].arguments += fragment
        index, deltas = len(self.calls) - 1, self._out.tool_calls
        if deltas and deltas[-1]["index"] == index:  # one delta per call in a feed's output
            deltas[-1]["function"]["arguments"] += fragment
        else:
            deltas.append({"index": index, "function": {"arguments": fragment}})

    def _content(self, text: str) -> None:
        """Content, its trailing whitespace held back (dropped if a call follows); whitespace after a call goes."""
        if self._after_call:
            text = text.lstrip(WHITESPACE)
            if not text:
                return
            self._after_call = False
        body = text.rstrip(WHITESPACE)
        if not body:
            self._held_space += text
            return
        self._out.content += self._held_space + body
        self._held_space = text[len(body):]
