"""Logging for the handler process: stderr only, one line per message.

The daemon logs every stderr line at ERROR level, so this is for real problems and startup lines.
"""
import sys


def error(msg: str) -> None:
    """Write `msg` to stderr at once (the daemon relays each line to its log)."""
    sys.stderr.write(f"{msg}\n")
    sys.stderr.flush()
