"""Finding marker strings (`<tool_call>`, `</think>`, `[TOOL_CALLS]`, stop strings, ...) in text that arrives
in pieces.

A marker can be split across two tokens, so the end of each piece that might be the start of a marker is
held back until the next piece says whether it is one. How much to hold back is tracked by one
Knuth-Morris-Pratt matcher per marker: its state is the longest end of the text so far that begins the
marker, advanced character by character. Memory is linear in the markers' total length (a marker's failure
table), and each character costs amortized constant time per marker, whatever was held back before.
"""
from array import array


class MarkerScanner:
    def __init__(self, markers: tuple[str, ...]):
        self.markers = markers
        self._failures = [failure_table(marker) for marker in markers]  # machine integers: 8 bytes a character
        self._matched = [0] * len(markers)  # per marker: characters of it that the text so far ends with
        self.pending = ""  # held back: it may be the start of a marker

    def split(self, text: str) -> tuple[str, str | None, str]:
        """(text before the first marker, that marker, the text after it). With no marker in sight, the end
        that may start one is held back for the next call and (released text, None, "") is returned."""
        window, self.pending = self.pending + text, ""
        if self._advance(text):
            self._matched = [0] * len(self.markers)
            found = [(i, marker) for marker in self.markers if (i := window.find(marker)) >= 0]
            start, marker = min(found, key=lambda hit: (hit[0], -len(hit[1])))
            return window[:start], marker, window[start + len(marker):]
        held = max(self._matched, default=0)
        self.pending = window[len(window) - held:] if held else ""
        return window[:len(window) - held], None, ""

    def flush(self) -> str:
        """The held-back text, once no more text will come."""
        pending, self.pending = self.pending, ""
        self._matched = [0] * len(self.markers)
        return pending

    def _advance(self, text: str) -> bool:
        """Moves every marker's matcher over text; True as soon as one marker is complete."""
        for index, (marker, failure) in enumerate(zip(self.markers, self._failures)):
            matched = self._matched[index]
            for character in text:
                while matched and marker[matched] != character:
                    matched = failure[matched - 1]
                if marker[matched] == character:
                    matched += 1
                if matched == len(marker):
                    return True
            self._matched[index] = matched
        return False


def failure_table(marker: str) -> array:
    """KMP's table: entry k is the length of the longest proper prefix of marker[:k + 1] that also ends it."""
    table = array("l", bytes(8 * len(marker)))
    matched = 0
    for k in range(1, len(marker)):
        while matched and marker[k] != marker[matched]:
            matched = table[matched - 1]
        if marker[k] == marker[matched]:
            matched += 1
        table[k] = matched
    return table
