"""Finding marker strings (`<tool_call>`, `</think>`, `[TOOL_CALLS]`, ...) in text that arrives in pieces.

A marker can be split across two tokens, so the end of each piece that might be the start of a marker is
held back until the next piece says whether it is one.
"""


class MarkerScanner:
    def __init__(self, markers: tuple[str, ...]):
        self.markers = markers
        self._prefixes = frozenset(m[:k] for m in markers for k in range(1, len(m)))  # proper prefixes
        self._longest_prefix = max(map(len, self._prefixes), default=0)
        self.pending = ""  # held back: it may be the start of a marker

    def split(self, text: str) -> tuple[str, str | None, str]:
        """(text before the first marker, that marker, the text after it). With no marker in sight, the end
        that may start one is held back for the next call and (released text, None, "") is returned."""
        text, self.pending = self.pending + text, ""
        found = [(i, marker) for marker in self.markers if (i := text.find(marker)) >= 0]
        if found:
            start, marker = min(found, key=lambda hit: (hit[0], -len(hit[1])))
            return text[:start], marker, text[start + len(marker):]
        held = self._marker_prefix_length(text)
        self.pending = text[len(text) - held:] if held else ""
        return text[:len(text) - held], None, ""

    def flush(self) -> str:
        """The held-back text, once no more text will come."""
        pending, self.pending = self.pending, ""
        return pending

    def _marker_prefix_length(self, text: str) -> int:
        for length in range(min(len(text), self._longest_prefix), 0, -1):
            if text[-length:] in self._prefixes:
                return length
        return 0
