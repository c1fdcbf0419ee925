"""Logging for the handler process: real problems and startup lines, on stderr.

The daemon logs every stderr line at ERROR level, so this is for real problems and startup lines. The
lines go through the `logging` module (logger "daemon_protocol"): a process that configures logging gets
them with its timestamps; one that does not gets the bare message on stderr (logging's last resort).
"""
import logging

log = logging.getLogger("daemon_protocol")


def error(msg: str) -> None:
    """Log `msg` at ERROR level (the daemon relays each stderr line to its log)."""
    log.error(msg)


def is_power_of_ten(count: int) -> bool:
    """1, 10, 100, ...: the counts at which a repeated problem is logged again."""
    while count % 10 == 0:
        count //= 10
    return count == 1


class RepeatedProblems:
    """Problems a peer can repeat at will (junk objects on the stream): each kind logged the first time, then
    only as its count reaches each power of ten, with that count, so a flood of them cannot flood the log."""

    def __init__(self):
        self.counts: dict[str, int] = {}

    def error(self, kind: str, detail: str) -> None:
        count = self.counts[kind] = self.counts.get(kind, 0) + 1
        if is_power_of_ten(count):
            error(f"{kind}: {detail}" + ("" if count == 1 else f" ({count} so far; logged again at each power of ten)"))
