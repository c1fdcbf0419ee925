"""The handler freezes what startup left on the heap before it serves (engine/gc_freeze.py), so that a full garbage
collection while serving scans only the objects serving created, not the libraries and the model."""
import gc
import os
import subprocess
import sys
import weakref

import pytest

# Runs the handler's main with the transport replaced by a report of the collector's state at the moment it
# would start serving.
SERVE_AND_REPORT = """
import gc, sys
import daemon_protocol
import handler.__main__ as handler_main
daemon_protocol.serve = lambda *args, **kwargs: print(gc.get_freeze_count(), len(gc.get_objects()), flush=True)
sys.exit(handler_main.main(["unix-listen:/nonexistent/socket"]))
"""


@pytest.mark.slow  # a handler process loading the packaged model
def test_startup_objects_are_frozen_before_serving(smollm2_path):
    env = {**os.environ, "MODEL_ID": smollm2_path, "HFENDPOINT_DEVICE": "cpu", "HFENDPOINT_MAX_MODEL_LEN": "256"}
    result = subprocess.run([sys.executable, "-c", SERVE_AND_REPORT], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    frozen, collectable = map(int, result.stdout.split())
    assert frozen > 100_000  # torch, transformers and the model
    assert collectable < frozen / 100


class Node:
    def __init__(self):
        self.cycle = self


def test_garbage_made_after_the_early_freeze_is_collected_at_the_end_of_startup():
    """The handler freezes the imports' objects at once (a first freeze_startup_objects); what loading makes after that
    and leaves as cyclic garbage is still collected by the full collection before serving, and the objects frozen
    early stay frozen."""
    from engine.gc_freeze import freeze_startup_objects

    kept = Node()
    try:
        freeze_startup_objects()
        assert not any(obj is kept for obj in gc.get_objects())  # frozen: out of the collector's generations
        garbage = weakref.ref(Node())  # a cycle: only a collection frees it
        assert garbage() is not None
        freeze_startup_objects()
        assert garbage() is None
        # still frozen; not gc.get_freeze_count(), which falls as other frozen objects die by reference count
        assert not any(obj is kept for obj in gc.get_objects())
    finally:
        gc.unfreeze()
