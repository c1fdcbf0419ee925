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
