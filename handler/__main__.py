"""`python -m handler`: resolve the model, load it, serve the daemon protocol until EOF.

Transport and its arguments are the protocol's (HFENDPOINT_FD, stdio, or a Unix socket path); the model
and engine come from the environment (see handler/model_source.py and engine/config.py).
"""

import os
import sys
import threading
import time

import daemon_protocol
from engine import EngineConfig, Worker
from handler.model_source import ModelNotFound, resolve_model
from handler.service import Service
from handler.tokenizer import load_tokenizer

HANDLER_NAMES = ("chat_completions", "tokenize", "embeddings", "models", "stats")
FATAL_EXIT_GRACE_S = 1.0


def main() -> int:
    try:
        model = resolve_model()
        config = EngineConfig.from_env(model.path)
    except (ModelNotFound, ValueError) as exc:
        daemon_protocol.error(f"handler: error: {exc}")
        return 2
    name = os.environ.get("HFENDPOINT_MODEL_NAME") or model.name
    daemon_protocol.error(f"handler: loading {name} ({model.path})")
    started = time.perf_counter()
    try:
        tokenizer = load_tokenizer(model.path)
        worker = Worker(config, on_fatal=exit_soon)
    except Exception as exc:  # noqa: BLE001 - any load failure ends the process with one clear line
        daemon_protocol.error(f"handler: error: cannot load {model.path}: {type(exc).__name__}: {exc}")
        return 1
    try:
        blocks = worker.stats()["num_total_blocks"]
        kv_dtype = str(config.kv_cache_torch_dtype).removeprefix("torch.")
        kv_cache = f", {blocks} KV blocks ({blocks * config.block_size} tokens, {kv_dtype})" if blocks else ""
        daemon_protocol.error(f"handler: ready in {time.perf_counter() - started:.1f}s: {worker.kind} model, "
                              f"max_model_len {worker.max_model_len}{kv_cache}")
        service = Service(worker, tokenizer, name)
        for handler_name in HANDLER_NAMES:
            daemon_protocol.handler(handler_name)(getattr(service, handler_name))
        daemon_protocol.serve(sys.argv[1] if len(sys.argv) > 1 else None)
        return 0
    finally:
        worker.shutdown()


def exit_soon(reason: str) -> None:
    """The engine cannot go on (a tensor-parallel rank died). The Worker has failed the requests in flight;
    once their error replies are out, the process exits non-zero so that the daemon restarts or reports it
    (protocol.md, failure rules). os._exit: the engine thread may be stuck in a collective for good."""
    daemon_protocol.error(f"handler: error: {reason}; exiting")
    threading.Timer(FATAL_EXIT_GRACE_S, os._exit, args=(1,)).start()


if __name__ == "__main__":
    sys.exit(main())
