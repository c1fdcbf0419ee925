"""`python -m handler`: resolve the model, load it, serve the daemon protocol until EOF.

Transport and its arguments are the protocol's (HFENDPOINT_FD, stdio, or a Unix socket path); the model
and engine come from the environment (see handler/model_source.py and engine/config.py).
"""

import os
import sys
import time

import daemon_protocol
from engine import EngineConfig, Worker
from handler.model_source import ModelNotFound, resolve_model
from handler.service import Service
from handler.tokenizer import load_tokenizer

HANDLER_NAMES = ("chat_completions", "tokenize", "embeddings", "models", "stats")


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
        worker = Worker(config)
    except Exception as exc:  # noqa: BLE001 - any load failure ends the process with one clear line
        daemon_protocol.error(f"handler: error: cannot load {model.path}: {type(exc).__name__}: {exc}")
        return 1
    try:
        stats = worker.stats()
        daemon_protocol.error(f"handler: ready in {time.perf_counter() - started:.1f}s: {worker.kind} model, "
                              f"max_model_len {worker.max_model_len}, {stats['num_total_blocks']} KV blocks")
        service = Service(worker, tokenizer, name)
        for handler_name in HANDLER_NAMES:
            daemon_protocol.handler(handler_name)(getattr(service, handler_name))
        daemon_protocol.serve(sys.argv[1] if len(sys.argv) > 1 else None)
        return 0
    finally:
        worker.shutdown()


if __name__ == "__main__":
    sys.exit(main())
