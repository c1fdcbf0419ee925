"""Data parallelism on one host: N engines, each with its own GPUs, KV pool and prefix cache, behind one
handler.

Every engine runs in a spawned process of its own, engine i on GPUs i x TP .. (i + 1) x TP - 1
(CUDA_VISIBLE_DEVICES narrowed to them before CUDA starts, so its tensor-parallel ranks count from its first GPU):
the handler's process keeps no engine, so its GIL serves only its event loop (routing, detokenizing, framing) and
the engines' pipe readers, never an engine's step. DataParallelWorker offers the Worker's interface: each request
goes where engine/router.py says (the longest cached prefix unless markedly busier), the choices of one completion
to the engine of its first, and embeddings to engine 0. A request's constraint travels with it (it must pickle:
handler/grammar.py's GrammarConstraint goes as its grammar's JSON and is rebuilt there; that JSON and the tokenizer
info every grammar needs cross each engine's pipe once while the engine keeps them, engine/sent_once.py); the
handler's copy, which
the engine never sees, replays the request's tokens when the request fails, so that it knows whether a token broke
it as the engine's copy does.

A spawned engine reads (method, args) messages from its pipe and sends back, from its engine thread, one message
per step with the outputs of every request of that step (as plain tuples, the cheapest to pickle: PipeOutputs),
its embeddings, and its stats every STATS_INTERVAL_S. One that exits ends its requests (and embedding calls) with an
error and the handler is told (on_fatal), as a lost tensor-parallel rank does.
"""
import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import weakref

import torch

from engine.config import EngineConfig
from engine.engine_core import check_prompt
from engine.images import check_step_budget, image_runs
from engine.router import PrefixRouter
from engine.sent_once import PipePickler
from engine.tensor_parallel import SHUTDOWN_GRACE_S, exit_when_orphaned, keep_off_protocol_streams
from engine.worker import RequestOutput, Worker, _post, _put_all, _set_future

log = logging.getLogger(__name__)
STATS_INTERVAL_S = 0.5
ENGINE_LOGGERS = ("engine", "models")  # INFO and up in an engine's process; other libraries' WARNING and up
# What the handler reads of a Worker besides its methods: each engine reports them once it is ready.
WORKER_FACTS = ("kind", "model_dir", "hidden_size", "vocab_size", "eos_token_ids", "max_model_len",
                "max_embedding_tokens", "weight_bytes", "reads_images", "image_token_id")
SUMMED_STATS = ("running", "waiting", "num_free_blocks", "num_total_blocks", "num_preemptions", "spec_drafted_tokens",
                "spec_accepted_tokens")


def make_worker(config: EngineConfig, on_fatal=None):
    """A Worker, or with data_parallel_size > 1 a DataParallelWorker over that many engines."""
    if config.data_parallel_size == 1:
        return Worker(config, on_fatal)
    return DataParallelWorker(config, on_fatal)


def engine_devices(config: EngineConfig) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES for each engine (None on CPU); ValueError when the host has fewer GPUs than
    data_parallel_size x tensor_parallel_size."""
    size, tp = config.data_parallel_size, config.tensor_parallel_size
    if config.torch_device.type != "cuda":
        return [None] * size
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = [g.strip() for g in visible.split(",")] if visible else [str(i) for i in range(torch.cuda.device_count())]
    if len(gpus) < size * tp:
        raise ValueError(f"data_parallel_size={size} x tensor_parallel_size={tp} needs {size * tp} GPUs but "
                         f"{len(gpus)} are visible: lower HFENDPOINT_DATA_PARALLEL_SIZE or make more GPUs visible")
    if config.device not in ("auto", "cuda"):
        raise ValueError(f"device={config.device!r}: with data_parallel_size > 1 engine i runs on GPUs i x "
                         "tensor_parallel_size onwards; set HFENDPOINT_DEVICE to auto or cuda")
    return [",".join(gpus[i * tp:(i + 1) * tp]) for i in range(size)]


class _Finishing:
    """A request's output queue that tells the router when the request ends (put_nowait on the event loop)."""

    __slots__ = ("queue", "on_finish")

    def __init__(self, queue: asyncio.Queue, on_finish):
        self.queue, self.on_finish = queue, on_finish

    def put_nowait(self, output: RequestOutput) -> None:
        if output.finish_reason is not None:
            self.on_finish(output.request_id)
        self.queue.put_nowait(output)


class DataParallelWorker:
    def __init__(self, config: EngineConfig, on_fatal=None):
        devices = engine_devices(config)
        one = dataclasses.replace(config, data_parallel_size=1)
        self.config, self.on_fatal = config, on_fatal
        self._lost: str | None = None
        self._stopped = False
        self.engines: list[EngineProcess] = []
        try:
            for index in range(config.data_parallel_size):  # all started before any is waited for: they load at once
                self.engines.append(EngineProcess(one, index, devices[index], self._engine_lost))
            for engine in self.engines:
                engine.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        for fact in WORKER_FACTS:
            setattr(self, fact, self.engines[0].facts[fact])
        if self.kind != "decoder":
            self.shutdown()
            raise ValueError(f"data_parallel_size={config.data_parallel_size}: {config.model} is an embedding model, "
                             "served by one engine; set HFENDPOINT_DATA_PARALLEL_SIZE to 1")
        self.router = PrefixRouter([engine.facts["num_total_blocks"] for engine in self.engines], config.block_size)
        self._engine_of: dict[object, int] = {}  # requests in flight -> engine index
        self._lock = threading.Lock()

    # ---- the Worker's interface ------------------------------------------------------------------------

    def submit(self, request_id, prompt_token_ids: list[int], params, constraint=None,
               queue: asyncio.Queue | None = None, shares_prompt_with=None, images=()) -> asyncio.Queue:
        """Worker.submit's. The checks a client's prompt can fail are made here, so that they raise as the
        Worker's do; the images travel with the request and are encoded in its engine."""
        check_prompt(prompt_token_ids, self.max_model_len, self.vocab_size)
        if images and self.reads_images:
            runs = image_runs(prompt_token_ids, self.image_token_id)
            check_step_budget([end - start for start, end in runs], self.config.max_num_batched_tokens)
        queue = asyncio.Queue() if queue is None else queue
        with self._lock:
            if self.unavailable:
                raise RuntimeError(self.unavailable)
            if request_id in self._engine_of:
                raise ValueError(f"request id {request_id!r} is already in flight")
            if shares_prompt_with in self._engine_of:
                engine = self._engine_of[shares_prompt_with]
            else:
                engine = self.router.choose(prompt_token_ids)
            self.engines[engine].submit(request_id, prompt_token_ids, params, constraint,
                                        _Finishing(queue, self._finished), shares_prompt_with, images)
            self._engine_of[request_id] = engine
            self.router.started(engine, prompt_token_ids)
        return queue

    def abort(self, request_id) -> None:
        with self._lock:
            engine = self._engine_of.get(request_id)
        if engine is not None:
            self.engines[engine].abort(request_id)

    def engine_of(self, request_id) -> int | None:
        """The engine serving a request in flight, or None."""
        with self._lock:
            return self._engine_of.get(request_id)

    async def embed(self, token_lists: list[list[int]]) -> list[list[float]]:
        if self.unavailable:
            raise RuntimeError(self.unavailable)
        return await self.engines[0].embed(token_lists)

    def stats(self) -> dict:
        """The engines' counts summed (their mean prefix-cache hit rate), and each engine's own in `engines`."""
        engines = [engine.stats() for engine in self.engines]
        total = {key: sum(stats.get(key, 0) for stats in engines) for key in SUMMED_STATS}
        total["prefix_cache_hit_rate"] = sum(s.get("prefix_cache_hit_rate", 0.0) for s in engines) / len(engines)
        return {**total, "engines": engines}

    @property
    def unavailable(self) -> str | None:
        """Why the engines take no more work (one was lost, or they shut down), or None."""
        return self._lost or ("the engine has shut down" if self._stopped else None)

    def shutdown(self) -> None:
        self._stopped = True
        for engine in self.engines:
            engine.shutdown()

    # ---- bookkeeping ---------------------------------------------------------------------------------

    def _finished(self, request_id) -> None:
        with self._lock:
            engine = self._engine_of.pop(request_id, None)
            if engine is not None:
                self.router.finished(engine)

    def _engine_lost(self, reason: str) -> None:
        """An engine exited: its requests have been failed; every later call fails too."""
        with self._lock:
            self._lost = f"{reason}: the engine cannot go on"
        if self.on_fatal:
            self.on_fatal(self._lost)


@dataclasses.dataclass
class _InFlight:
    """A request an engine process serves, as the handler tracks it."""
    queue: _Finishing
    loop: asyncio.AbstractEventLoop
    constraint: object = None  # the handler's copy, which replays the request's tokens if the request fails
    token_ids: list[int] | None = None  # the request's tokens so far, kept only when it has a constraint


class EngineProcess:
    """Engine `index` in a spawned process: its Worker's submit, abort and embed over a pipe, and its last stats."""

    def __init__(self, config: EngineConfig, index: int, devices: str | None, on_lost):
        self.index, self.on_lost = index, on_lost
        context = multiprocessing.get_context("spawn")
        self.pipe, theirs = context.Pipe()
        self._pickler = PipePickler()
        self.process = context.Process(target=run_engine, args=(config, index, devices, theirs, os.getpid()),
                                       name=f"data-parallel-engine-{index}")  # not daemonic: it may start TP ranks
        self.process.start()
        theirs.close()
        self.facts: dict = {}
        self.last_stats: dict = {}
        self._requests: dict[object, _InFlight] = {}
        self._embeddings: dict[int, tuple[asyncio.Future, asyncio.AbstractEventLoop]] = {}
        self._call_ids = itertools.count()
        self._lock = threading.Lock()
        self._stopping = False
        # at interpreter exit too: multiprocessing would otherwise wait forever for the (non-daemonic) engine
        self._stop = weakref.finalize(self, stop_engine, self.process, self.pipe, self._lock)

    def wait_ready(self) -> None:
        """Returns once the engine has loaded; raises with its error otherwise."""
        ready = multiprocessing.connection.wait([self.pipe, self.process.sentinel])
        if self.pipe not in ready:
            raise RuntimeError(f"data-parallel engine {self.index} exited (exit code {self.process.exitcode}) "
                               "while loading the model")
        kind, payload = self.pipe.recv()
        if kind == "error":
            raise RuntimeError(f"data-parallel engine {self.index} could not load the model: {payload}")
        self.facts = payload
        self.last_stats = payload["stats"]
        log.info(f"data-parallel engine {self.index} ready (pid {self.process.pid})")
        threading.Thread(target=self._read, name=f"data-parallel-engine-{self.index}", daemon=True).start()

    def submit(self, request_id, prompt_token_ids: list[int], params, constraint, queue: _Finishing,
               shares_prompt_with=None, images=()) -> None:
        request = _InFlight(queue, asyncio.get_running_loop(), constraint, [] if constraint is not None else None)
        with self._lock:
            self._requests[request_id] = request
            self._send("submit", (request_id, prompt_token_ids, params, constraint, shares_prompt_with, images))

    def abort(self, request_id) -> None:
        with self._lock:
            if request_id in self._requests:
                self._send("abort", (request_id,))

    async def embed(self, token_lists: list[list[int]]) -> list[list[float]]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            call_id = next(self._call_ids)
            self._embeddings[call_id] = (future, loop)
            self._send("embed", (call_id, token_lists))
        try:
            return await future
        finally:
            with self._lock:
                self._embeddings.pop(call_id, None)

    def stats(self) -> dict:
        return self.last_stats

    def shutdown(self) -> None:
        """Stops the engine (a second call does nothing)."""
        self._stopping = True
        self._stop()

    def _send(self, kind: str, args: tuple) -> None:
        """Under the lock; an engine that has gone is reported by the reader, which fails the request."""
        try:
            self.pipe.send_bytes(self._pickler.dumps((kind, args)))
        except OSError:
            pass

    def _read(self) -> None:
        """The engine's messages, until its pipe closes: outputs to their requests' queues on their event loops."""
        while True:
            try:
                kind, payload = self.pipe.recv()
            except (EOFError, OSError):
                break
            if kind == "outputs":
                self._deliver(payload)
            elif kind == "stats":
                self.last_stats = payload
            elif kind == "embedded":
                self._answer_embedding(*payload)
        if not self._stopping:
            self._fail_in_flight(f"data-parallel engine {self.index} exited (exit code {self.process.exitcode})")

    def _deliver(self, fields: list[tuple]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for values in fields:
                output = RequestOutput._make(values)
                request = self._requests.get(output.request_id)
                if request is None:  # failed here already (the engine was lost meanwhile)
                    continue
                if output.finish_reason is not None:
                    del self._requests[output.request_id]
                if request.constraint is not None:
                    follow_constraint(request, output)
                by_loop.setdefault(request.loop, []).append((request.queue, output))
        for loop, items in by_loop.items():
            _post(loop, _put_all, items)

    def _answer_embedding(self, call_id: int, vectors, error: tuple[str, str] | None) -> None:
        with self._lock:
            future, loop = self._embeddings.get(call_id, (None, None))
        if future is not None:
            _post(loop, _set_future, future, vectors, None if error is None else embedding_error(*error))

    def _fail_in_flight(self, reason: str) -> None:
        self.on_lost(reason)  # first: no request is taken once those in flight have failed
        error = f"{reason}: the engine cannot go on"
        with self._lock:
            requests, self._requests = self._requests, {}
            embeddings = list(self._embeddings.values())
        for request_id, request in requests.items():
            _post(request.loop, _put_all, [(request.queue, RequestOutput(request_id, [], "error", error, 0, 0, 0))])
        for future, loop in embeddings:
            _post(loop, _set_future, future, None, RuntimeError(error))


def follow_constraint(request: _InFlight, output: RequestOutput) -> None:
    """Keeps a constrained request's tokens; when it fails, its handler-side constraint accepts them as the engine's
    copy did, so that it too has met the token that broke it, if one did (the engine's copy accepted every token
    before that one, and a request that fails took no stop token)."""
    request.token_ids += output.new_token_ids
    if output.finish_reason == "error":
        for token_id in request.token_ids:
            if not request.constraint.accept_token(token_id):
                break


def embedding_error(kind: str, message: str) -> Exception:
    """The engine's exception, as ValueError (bad input) or RuntimeError."""
    return ValueError(message) if kind == "ValueError" else RuntimeError(message)


def stop_engine(process, pipe, lock: threading.Lock) -> None:
    try:
        with lock:
            pipe.send(("stop", ()))
    except OSError:
        pass
    process.join(SHUTDOWN_GRACE_S)
    if process.is_alive():
        process.kill()
        process.join()


# ---- the spawned engine --------------------------------------------------------------------------------

def run_engine(config: EngineConfig, index: int, devices: str | None, pipe, parent_pid: int) -> None:
    """A spawned engine: load the model on its GPUs, report its facts, then serve the parent's requests."""
    threading.Thread(target=exit_when_orphaned, args=(parent_pid,), name="orphan-watchdog", daemon=True).start()
    keep_off_protocol_streams()
    log_as_engine(index)
    if devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = devices
    try:
        worker = Worker(config)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        pipe.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    pipe.send(("ready", {**{fact: getattr(worker, fact) for fact in WORKER_FACTS}, "stats": worker.stats(),
                         "num_total_blocks": worker.stats()["num_total_blocks"]}))
    try:
        asyncio.run(serve(worker, pipe))
    finally:
        worker.shutdown()
    os._exit(0)


def log_as_engine(index: int) -> None:
    """The engine's lines (its start-up phases, its problems) on stderr, which it shares with the handler, each
    naming the engine."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s %(name)s (data-parallel engine "
                                                      f"{index}): %(message)s")
    for name in ENGINE_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)


class PipeOutputs:
    """An engine process's outputs queue and the loop they are posted through, both at once: the engine thread's
    call_soon_threadsafe runs the delivery there and then (PipeOutputs gathers what it puts) and sends the step's
    outputs down the pipe as one message; no event loop stands between the step and the pipe. The lock orders
    every send on the pipe. A full pipe (the handler behind) holds the engine thread until the handler reads."""

    def __init__(self, pipe, lock: threading.Lock):
        self.pipe, self.lock = pipe, lock
        self.gathered: list[tuple] = []

    def put_nowait(self, output: RequestOutput) -> None:
        self.gathered.append(tuple(output))

    def call_soon_threadsafe(self, callback, *args) -> None:
        with self.lock:
            callback(*args)
            gathered, self.gathered = self.gathered, []
            if gathered:
                self._send("outputs", gathered)

    def send(self, kind: str, payload) -> None:
        with self.lock:
            self._send(kind, payload)

    def _send(self, kind: str, payload) -> None:
        try:
            self.pipe.send((kind, payload))
        except OSError:  # the handler has gone: nobody to tell (the orphan watchdog ends this process)
            pass


async def serve(worker: Worker, pipe) -> None:
    """Runs the parent's submit, abort and embed calls on the worker; its outputs go back from its engine thread
    (PipeOutputs), its embeddings and stats from here."""
    loop = asyncio.get_running_loop()
    outputs = PipeOutputs(pipe, threading.Lock())
    stopped = loop.create_future()
    embeddings: set[asyncio.Task] = set()

    def handle(kind: str, args: tuple) -> None:
        if kind == "submit":
            request_id, prompt, params, constraint, shares_prompt_with, images = args
            try:
                worker.submit(request_id, prompt, params, constraint, outputs, shares_prompt_with, images,
                              loop=outputs)
            except (ValueError, RuntimeError) as exc:  # the parent checked what a client sends: ours to fix
                failed = RequestOutput(request_id, [], "error", str(exc), len(prompt), 0, 0)
                outputs.call_soon_threadsafe(_put_all, [(outputs, failed)])
        elif kind == "abort":
            worker.abort(*args)
        elif kind == "embed":
            task = loop.create_task(embed(*args))
            embeddings.add(task)
            task.add_done_callback(embeddings.discard)
        elif not stopped.done():
            stopped.set_result(None)

    async def embed(call_id: int, token_lists: list[list[int]]) -> None:
        try:
            outputs.send("embedded", (call_id, await worker.embed(token_lists), None))
        except Exception as exc:  # noqa: BLE001 - the caller's to raise
            outputs.send("embedded", (call_id, None, (type(exc).__name__, str(exc))))

    def read() -> None:
        while True:
            try:
                kind, args = pipe.recv()
            except (EOFError, OSError):
                kind, args = "stop", ()
            _post(loop, handle, kind, args)
            if kind == "stop":
                return

    threading.Thread(target=read, name="engine-pipe", daemon=True).start()

    async def send_stats() -> None:
        while True:
            await asyncio.sleep(STATS_INTERVAL_S)
            outputs.send("stats", worker.stats())

    stats = loop.create_task(send_stats())
    await stopped
    for task in [stats, *embeddings]:
        task.cancel()
