"""The handler process's resident memory, for the engine line (handler/logs.py) and the `stats` reply that
the front turns into /metrics."""
import os

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int | None:
    """Resident set size now (Linux /proc); None where it cannot be read."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return None
