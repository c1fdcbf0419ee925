"""The start-up log: one line per phase of a start (imports, tokenizer, weights, KV pool, warm-up, CUDA graphs,
ready) saying how long it took and how long since the process started, so a slow start says where its seconds
went. The lines go to the "engine.startup" logger (whose name begins each line), which the handler sends to
stderr with its other startup lines; bench/startup.py reads them.
"""
import contextlib
import logging
import os
import time

log = logging.getLogger("engine.startup")
_IMPORTED_AT = time.monotonic()


def process_age() -> float:
    """Seconds since this process started: on Linux from its start time in /proc (the interpreter's own start
    and imports included), elsewhere since this module was imported."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rpartition(")")[2].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat(5), in clock ticks since boot
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic() - _IMPORTED_AT


def note(what: str) -> None:
    """A line for a point of the start (not a phase): `what` and the seconds since the process started."""
    log.info("%s at %.2fs", what, process_age())


def took(name: str, seconds: float, detail: str | None = None) -> None:
    """The line of a phase that took `seconds`: `NAME (DETAIL) took S s, at T s` (T since the process started)."""
    log.info("%s%s took %.2fs, at %.2fs", name, f" ({detail})" if detail else "", seconds, process_age())


@contextlib.contextmanager
def phase(name: str, detail=None):
    """Times the block and writes its line (took()). detail: a callable whose string, read when the block has
    ended, follows the name (sizes, counts)."""
    started = time.perf_counter()
    yield
    took(name, time.perf_counter() - started, detail() if detail else None)


def timed(name: str, function, *args):
    """function(*args), timed as the phase `name` (phase()): for a phase run on a thread of its own."""
    with phase(name):
        return function(*args)
