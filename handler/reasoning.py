"""Reasoning apart from the answer: Qwen3-style `<think>...</think>` goes to `reasoning_content`.

Only for models whose chat template uses the tags. The reply opens a think block with `<think>` as its first
text, or the generation prompt has already opened one (templates that end with `<think>\n`); the block ends at
`</think>`, and the rest is content. Whitespace around the reasoning and at the start of the content goes.
"""
from handler.text_markers import MarkerScanner

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
WHITESPACE = " \t\r\n"


def uses_think_tags(chat_template: str | None) -> bool:
    return THINK_OPEN in (chat_template or "") and THINK_CLOSE in (chat_template or "")


def starts_in_reasoning(prompt: str) -> bool:
    """The prompt leaves a think block open, so the reply begins inside it."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


class ReasoningSplitter:
    """Text fed piece by piece -> (reasoning, content) pieces."""

    def __init__(self, inside: bool):
        self.state = "reasoning" if inside else "start"
        self._start = ""  # the reply's first characters, until they say whether a think block opens
        self._close = MarkerScanner((THINK_CLOSE,))
        self._reasoning_began = False
        self._held_space = ""  # the reasoning's trailing whitespace, dropped at its end
        self._content_began = False

    def feed(self, text: str) -> tuple[str, str]:
        if self.state == "start":
            self._start += text
            head = self._start.lstrip(WHITESPACE)
            if THINK_OPEN.startswith(head):  # empty, or a think tag still arriving
                return "", ""
            self.state = "reasoning" if head.startswith(THINK_OPEN) else "content"
            self._content_began = self.state == "content"  # no reasoning: the reply is content as it came
            text = head[len(THINK_OPEN):] if self.state == "reasoning" else self._start
        if self.state == "content":
            return "", self._content(text)
        before, marker, after = self._close.split(text)
        reasoning = self._reasoning(before)
        if marker is None:
            return reasoning, ""
        self.state = "content"
        return reasoning, self._content(after)

    def finish(self) -> tuple[str, str]:
        if self.state == "start":
            self.state, self._content_began = "content", True
            return "", self._start
        if self.state == "reasoning":
            return self._reasoning(self._close.flush()), ""
        return "", ""

    def _reasoning(self, text: str) -> str:
        if not self._reasoning_began:
            text = text.lstrip(WHITESPACE)
            self._reasoning_began = bool(text)
        body = text.rstrip(WHITESPACE)
        if not body:
            self._held_space += text
            return ""
        released = self._held_space + body
        self._held_space = text[len(body):]
        return released

    def _content(self, text: str) -> str:
        if not self._content_began:
            text = text.lstrip(WHITESPACE)
            self._content_began = bool(text)
        return text
