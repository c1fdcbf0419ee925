"""`completions` reply chunks (docs/completions.md) -> OpenAI's legacy `text_completion` JSON.

A chunk names its choice (`index`), adds `text` and, with `logprobs`, the legacy logprobs object's lists for the
tokens it adds; it ends its choice with `choice_finish_reason`, or, the request's last chunk, `finish_reason`
with `usage`. CompletionReply gathers a request's chunks into the `choices` of a `text_completion`;
stream_choice turns one chunk into the choice of a streamed `text_completion` event.
"""
from .openai_chat import choice_finish_reason, choice_index

LOGPROB_LISTS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


class CompletionReply:
    def __init__(self):
        self._choices: dict[int, dict] = {}
        self.usage: dict | None = None

    def add(self, payload: dict) -> None:
        choice = self._choices.setdefault(choice_index(payload), {"text": [], "logprobs": None,
                                                                   "finish_reason": None})
        choice["text"].append(payload.get("text") or "")
        logprobs = payload.get("logprobs")
        if isinstance(logprobs, dict):
            choice["logprobs"] = choice["logprobs"] or {key: [] for key in LOGPROB_LISTS}
            for key in LOGPROB_LISTS:
                choice["logprobs"][key] += logprobs.get(key) or []
        choice["finish_reason"] = choice_finish_reason(payload) or choice["finish_reason"]
        self.usage = payload.get("usage") or self.usage

    def choices(self) -> list[dict]:
        """The `choices` of a text_completion, by index."""
        return [{"index": index, "text": "".join(choice["text"]), "logprobs": choice["logprobs"],
                 "finish_reason": choice["finish_reason"]} for index, choice in sorted(self._choices.items())]


def stream_choice(payload: dict) -> dict:
    return {"index": choice_index(payload), "text": payload.get("text") or "", "logprobs": payload.get("logprobs"),
            "finish_reason": choice_finish_reason(payload)}
