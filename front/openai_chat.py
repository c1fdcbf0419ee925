"""chat_completions reply chunks, with the extension keys of docs/chat-extensions.md, -> OpenAI's JSON.

A chunk may name its choice (`index`, 0 when absent), end it (`choice_finish_reason`, or `finish_reason` on the
request's last chunk) and carry `reasoning_content`, `tool_calls` deltas and `logprobs` besides `content`.
ChatReply gathers a request's chunks into the `choices` of a `chat.completion`; stream_choice turns one chunk
into the choice of a `chat.completion.chunk` event.
"""


class ChatReply:
    def __init__(self):
        self._choices: dict[int, dict] = {}
        self.usage: dict | None = None
        self.finish_reason: str | None = None  # the last chunk's

    def add(self, payload: dict) -> None:
        choice = self._choices.setdefault(choice_index(payload), {"content": [], "reasoning": [], "calls": {},
                                                                   "logprobs": None, "finish_reason": None})
        choice["content"].append(payload.get("content") or "")
        choice["reasoning"].append(payload.get("reasoning_content") or "")
        for delta in payload.get("tool_calls") or ():
            add_tool_call_delta(choice["calls"], delta)
        logprobs = payload.get("logprobs")
        if logprobs:
            choice["logprobs"] = choice["logprobs"] or {"content": []}
            choice["logprobs"]["content"] += logprobs.get("content") or []
        choice["finish_reason"] = choice_finish_reason(payload) or choice["finish_reason"]
        self.usage = payload.get("usage") or self.usage
        self.finish_reason = payload.get("finish_reason") or self.finish_reason

    def content(self, index: int = 0) -> str:
        return "".join(self._choices.get(index, {}).get("content", []))

    def choices(self) -> list[dict]:
        """The `choices` of a chat.completion, by index."""
        return [{"index": index, "message": message(choice), "finish_reason": choice["finish_reason"],
                 "logprobs": choice["logprobs"]} for index, choice in sorted(self._choices.items())]


def message(choice: dict) -> dict:
    content, reasoning = "".join(choice["content"]), "".join(choice["reasoning"])
    calls = [call for _, call in sorted(choice["calls"].items())]
    message = {"role": "assistant", "content": content if content or not calls else None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def add_tool_call_delta(calls: dict[int, dict], delta: dict) -> None:
    """Merges an OpenAI tool-call delta: the first of a call brings its id, type and name, later ones arguments."""
    function = delta.get("function") or {}
    call = calls.setdefault(delta.get("index", 0), {"id": None, "type": "function",
                                                     "function": {"name": "", "arguments": ""}})
    call["id"] = delta.get("id") or call["id"]
    call["type"] = delta.get("type") or call["type"]
    call["function"]["name"] += function.get("name") or ""
    call["function"]["arguments"] += function.get("arguments") or ""


def stream_choice(payload: dict, started: set[int]) -> dict:
    """The choice of the chat.completion.chunk for one reply chunk; `started` holds the choices that have
    had their first delta (which carries the role)."""
    index = choice_index(payload)
    delta = {"role": "assistant"} if index not in started else {}
    started.add(index)
    content, reasoning, calls = payload.get("content"), payload.get("reasoning_content"), payload.get("tool_calls")
    delta["content"] = (content or "") if content or not (reasoning or calls) else None
    if reasoning:
        delta["reasoning_content"] = reasoning
    if calls:
        delta["tool_calls"] = calls
    return {"index": index, "delta": delta, "finish_reason": choice_finish_reason(payload),
            "logprobs": payload.get("logprobs")}


def choice_index(payload: dict) -> int:
    index = payload.get("index")
    return index if isinstance(index, int) and not isinstance(index, bool) else 0


def choice_finish_reason(payload: dict) -> str | None:
    return payload.get("choice_finish_reason") or payload.get("finish_reason")
