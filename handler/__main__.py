"""`python -m handler`: resolve the model, load it, serve the daemon protocol until EOF.

Transport and its arguments are the protocol's (HFENDPOINT_FD, stdio, or a Unix socket path); the model
and engine come from the environment (see handler/model_source.py and engine/config.py).
"""

import argparse
import gc
import importlib
import logging
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import daemon_protocol
from daemon_protocol.transports import TransportError, parse_transport, transport_from_env

HANDLER_NAMES = ("chat_completions", "completions", "score", "tokenize", "embeddings", "models", "stats")
FATAL_EXIT_GRACE_S = 1.0
LOADING_LOG_INTERVAL_S = 10.0
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
STDOUT_LOGGERS = ("handler.access", "handler.engine")  # per-request and periodic lines (handler/logs.py)
OUR_LOGGERS = ("handler", "daemon_protocol", "engine", "models")  # INFO and up; other libraries' WARNING and up

log = logging.getLogger("handler")

DESCRIPTION = """\
The handler process behind an inference endpoint's HTTP daemon: it loads the model given by MODEL_ID
(or the one mounted at HFENDPOINT_REPOSITORY_DIR) and serves chat_completions, tokenize and embeddings
over the daemon protocol. The daemon spawns it with HFENDPOINT_FD set; run it by hand behind our
front: python -m front -- python -m handler

Engine settings come from the environment (HFENDPOINT_MAX_MODEL_LEN, HFENDPOINT_DEVICE, ...): the README's
Configuration table lists them with their defaults."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line, checked before anything loads, with the transport it names or the environment's."""
    parser = argparse.ArgumentParser(prog="python -m handler", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("transport", nargs="?", metavar="TRANSPORT",
                        help="fd:N, stdio, unix-listen:PATH or unix-connect:PATH (default: from HFENDPOINT_FD, "
                             "HFENDPOINT_STDIO=1, HFENDPOINT_UNIX_LISTEN or HFENDPOINT_UNIX_CONNECT)")
    args = parser.parse_args(argv)
    try:
        args.transport_kind = (parse_transport(args.transport) if args.transport else transport_from_env()).kind
    except TransportError as exc:
        parser.error(str(exc))
    return args


def configure_logging(transport_kind: str) -> None:
    """Timestamped lines; startup lines and problems on stderr (the daemon logs them at ERROR), the access
    and engine lines on stdout, which in stdio mode carries the protocol: there they go to stderr too."""
    from handler.library_warnings import library_warnings
    formatter = logging.Formatter(LOG_FORMAT)
    problems = logging.StreamHandler(sys.stderr)
    problems.setFormatter(formatter)
    problems.addFilter(library_warnings.logging_filter(OUR_LOGGERS))  # other libraries: once per kind of warning
    logging.captureWarnings(True)  # Python warnings through that filter too
    logging.basicConfig(level=logging.WARNING, handlers=[problems], force=True)
    for name in OUR_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)
    chatter = logging.StreamHandler(sys.stderr if transport_kind == "stdio" else sys.stdout)
    chatter.setFormatter(formatter)
    for name in STDOUT_LOGGERS:
        logger = logging.getLogger(name)
        logger.addHandler(chatter)
        logger.propagate = False


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    configure_logging(args.transport_kind)
    gc.disable()  # the imports make long-lived objects: collected once after them, not over and over as they run
    try:
        from engine import EngineConfig, startup_log  # imported after the arguments are checked: torch takes seconds
        from engine.gc_freeze import freeze_startup_objects
        from handler.model_source import ModelNotFound, resolve_model
        from handler.settings import HandlerSettings
        freeze_startup_objects()  # the imports' objects, before loading makes more
    finally:
        gc.enable()
    try:
        settings = HandlerSettings.from_env(os.environ)
        model = resolve_model(os.environ)
        config = EngineConfig.from_env(model.path, os.environ)
    except (ModelNotFound, ValueError) as exc:
        log.error(str(exc))  # the one line of a start that cannot begin
        return 2
    startup_log.note("imports done")
    name = settings.model_name or model.name
    loaded = load(name, model.path, config, settings)
    if loaded is None:
        return 1
    worker, tokenizer, parts = loaded
    try:
        from handler.service import Service  # imported by load(), on its thread
        with startup_log.phase("chat service (grammar compilers, encoding threads)"):
            service = Service(worker, tokenizer, name, settings, parts=parts)
        for handler_name in HANDLER_NAMES:
            daemon_protocol.handler(handler_name)(getattr(service, handler_name))
        with startup_log.phase("garbage collection and freeze of what start-up made"):
            freeze_startup_objects()
        startup_log.note("serving")
        daemon_protocol.serve(args.transport, drain_timeout=settings.drain_timeout)
        return 0
    finally:
        worker.shutdown()


def load(name: str, path: str, config, settings):
    """(engine Worker, tokenizer, what the chat service's encoding needs: handler/service.py's EncodingParts), with
    a line every LOADING_LOG_INTERVAL_S while the weights load; None (the reason logged) when loading fails. The
    tokenizer, the chat service's imports and those parts load on a thread meanwhile."""
    from engine import startup_log
    from engine.data_parallel import make_worker
    from handler.tokenizer import load_tokenizer
    log.info(f"loading {name} ({path})")
    started = time.perf_counter()
    done = threading.Event()
    threading.Thread(target=log_loading, args=(name, started, done), name="loading-log", daemon=True).start()
    worker = None
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="loading-beside") as pool:  # see the docstring
            tokenizer = pool.submit(startup_log.timed, "tokenizer", load_tokenizer, path, config.cache_dir)
            service = pool.submit(startup_log.timed, "chat service imports (xgrammar)", importlib.import_module,
                                  "handler.service")
            parts = pool.submit(startup_log.timed, "tokenizer copies and grammars", encoding_parts, service,
                                tokenizer, path, config.cache_dir, settings.limits.max_grammar_bytes)
            worker = make_worker(config, on_fatal=exit_soon)
            with startup_log.phase("wait for the loading thread (tokenizer, its copies, grammars)"):
                tokenizer, parts = tokenizer.result(), parts.result()
    except Exception as exc:  # noqa: BLE001 - any load failure ends the process with one clear line
        if worker:
            worker.shutdown()
        log.error(f"cannot load {path}: {type(exc).__name__}: {exc}")
        return None
    finally:
        done.set()
    blocks = worker.stats()["num_total_blocks"]
    kv_dtype = str(config.kv_cache_torch_dtype).removeprefix("torch.")
    kv_cache = f", {blocks} KV blocks ({blocks * config.block_size} tokens, {kv_dtype})" if blocks else ""
    engines = f", {config.data_parallel_size} data-parallel engines" if config.data_parallel_size > 1 else ""
    log.info(f"ready in {time.perf_counter() - started:.1f}s: {worker.kind} model, weights "
             f"{worker.weight_bytes / 2**30:.2f} GiB{' each' if engines else ''}, max_model_len "
             f"{worker.max_model_len}{kv_cache}{engines}")
    return worker, tokenizer, parts


def encoding_parts(service: Future, tokenizer: Future, path: str, cache_dir: str, max_grammar_bytes: int):
    """The chat service's EncodingParts (the tokenizer's copies, a decoder's grammars), from the service module and
    the tokenizer that the same one-thread pool loaded before."""
    return service.result().EncodingParts.of(tokenizer.result(), decoder_vocabulary(path, cache_dir),
                                             max_grammar_bytes)


def decoder_vocabulary(path: str, cache_dir: str) -> tuple[int, tuple[int, ...]] | None:
    """(vocabulary size, end-of-sequence ids) as a decoder's files give them (its config's text part and its
    generation_config.json), for grammars made before the engine is up; None for an encoder."""
    from transformers import AutoConfig

    from models.model_files import eos_token_ids, model_dir_of
    from models.registry import ENCODERS, architecture_of
    model_dir = model_dir_of(path, cache_dir)
    hf_config = AutoConfig.from_pretrained(model_dir)
    if architecture_of(hf_config) in ENCODERS:
        return None
    text_config = hf_config.get_text_config()
    return text_config.vocab_size, eos_token_ids(text_config, model_dir)


def log_loading(name: str, started: float, done: threading.Event) -> None:
    while not done.wait(LOADING_LOG_INTERVAL_S):
        log.info(f"still loading {name}: {time.perf_counter() - started:.0f}s so far")


def exit_soon(reason: str) -> None:
    """The engine cannot go on (a tensor-parallel rank died). The Worker has failed the requests in flight;
    once their error replies are out, the process exits non-zero so that the daemon restarts or reports it
    (docs/protocol.md section 7, failure rules). os._exit: the engine thread may be stuck in a collective for good."""
    log.error(f"{reason}; exiting")
    threading.Timer(FATAL_EXIT_GRACE_S, os._exit, args=(1,)).start()


if __name__ == "__main__":
    sys.exit(main())
