"""When the engine cannot go on (a tensor-parallel rank died), the handler says why on stderr and exits
non-zero a moment later, once the failed requests' error replies are out (docs/protocol.md section 7, failure rules)."""
import os
import threading

import handler.__main__ as handler_main


def test_exit_soon_exits_non_zero_after_the_grace(monkeypatch, capsys):
    exited = threading.Event()
    codes = []
    monkeypatch.setattr(os, "_exit", lambda code: (codes.append(code), exited.set()))
    handler_main.exit_soon("tensor-parallel rank 1 exited (exit code -9): the engine cannot go on")
    assert codes == []  # not at once: the error replies go out first
    assert exited.wait(handler_main.FATAL_EXIT_GRACE_S + 5)
    assert codes == [1]
    assert "rank 1 exited" in capsys.readouterr().err
