"""Warnings of the libraries the handler runs (xgrammar, transformers, tokenizers), logged once per kind.

A client controls how often a library warns (a schema of thousands of `allOf` makes xgrammar warn once for
each), and the daemon logs every stderr line at ERROR level: so each kind of warning is logged the first time,
then again only as its count reaches each power of ten, with that count. `counts()` has every kind's count.
A warning's kind is its text with numbers, quoted names and the library's "[time] file:line:" prefix dropped.
"""
import logging
import re
import threading

from daemon_protocol.log import is_power_of_ten

LIBRARY_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[21:30:24] /project/cpp/x.cc:4944: " (xgrammar)
KIND_NOISE = re.compile(r"'[^']*'|\"[^\"]*\"|\d+")
MAX_KIND_CHARS = 200
MAX_KINDS = 1000  # distinct kinds remembered; past it every new one counts as "other"

log = logging.getLogger("handler.library")


class LibraryWarnings:
    def __init__(self):
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()  # warnings arrive from encoding threads and the grammar pipes' readers

    def note(self, library: str, message: str) -> int:
        """Counts one warning; returns how many of its kind there have been."""
        kind = f"{library}: {KIND_NOISE.sub('_', LIBRARY_PREFIX.sub('', message.strip()))[:MAX_KIND_CHARS]}"
        with self._lock:
            if kind not in self._counts and len(self._counts) >= MAX_KINDS:
                kind = f"{library}: other"
            count = self._counts[kind] = self._counts.get(kind, 0) + 1
        return count

    def log(self, library: str, message: str) -> None:
        """Logs a warning the first time of its kind, then with its count at each power of ten."""
        count = self.note(library, message)
        if is_power_of_ten(count):
            again = "" if count == 1 else f" (seen {count} times; logged again at each power of ten)"
            log.warning("%s: %s%s", library, LIBRARY_PREFIX.sub("", message.strip())[:MAX_KIND_CHARS * 5], again)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def logging_filter(self, ours: tuple[str, ...]) -> logging.Filter:
        """A filter for the stderr handler: other libraries' records pass once per kind (then counted)."""
        warnings = self

        class OncePerKind(logging.Filter):
            def filter(self, record: logging.LogRecord) -> bool:
                if record.name.split(".")[0] in ours or record.levelno >= logging.ERROR:
                    return True
                count = warnings.note(record.name.split(".")[0], record.getMessage())
                if count > 1 and is_power_of_ten(count):
                    record.msg, record.args = f"{record.getMessage()} (seen {count} times)", ()
                return is_power_of_ten(count)

        return OncePerKind()


library_warnings = LibraryWarnings()  # one per process: the libraries' warnings are the process's
