"""Startup leaves a heap of long-lived Python objects: imported modules, configs, the model's modules and
parameters, captured graphs. A full garbage collection scans every one of them with the GIL held, which in a
server stalls the engine thread and the event loop at once, so after startup they are frozen: later
collections scan only what serving creates. Only a process of our own does this (the handler, a
tensor-parallel rank): a frozen object that later becomes cyclic garbage is never freed, so an engine built in
somebody else's process (LLM) leaves its heap alone.

Most of those objects are made by the imports (modules, classes, functions). The handler imports with the automatic
collection off (each full collection while imports run scans every object imported so far), then collects and
freezes once right after them and once more at the end of startup: the imports' objects are out of the way of the
collections while the model loads, and the last collection scans only what loading made."""
import gc


def freeze_startup_objects() -> None:
    """Collects what startup left as garbage, then moves every surviving object out of the collector's reach."""
    gc.collect()
    gc.freeze()
