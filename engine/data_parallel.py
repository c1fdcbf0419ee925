"""Data parallelism on one host: N engines, each with its own GPUs, KV pool and prefix cache, behind one
handler.

Engine 0 is the handler process's own Worker (on GPUs 0 .. TP-1); engines 1..N-1 are spawned processes, each
running a Worker on its own TP GPUs (CUDA_VISIBLE_DEVICES narrowed to them before CUDA starts, so its
tensor-parallel ranks count from its first GPU). DataParallelWorker offers the Worker's interface: each
request goes where engine/router.py says (the longest cached prefix unless markedly busier), the choices of
one completion to the engine of its first, and requests with a constraint (structured outputs, forced tool
calls: xgrammar matchers that live in this process) and embeddings to engine 0.

A spawned engine reads (method, args) messages from its pipe and sends back batches of RequestOutputs as its
engine thread delivers them, and its stats every STATS_INTERVAL_S. One that exits ends its requests with an
error and the handler is told (on_fatal), as a lost tensor-parallel rank does.
"""
import asyncio
import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import threading
import weakref

import torch

from engine.config import EngineConfig
from engine.router import PrefixRouter
from engine.tensor_parallel import SHUTDOWN_GRACE_S, exit_when_orphaned, keep_off_protocol_streams
from engine.worker import RequestOutput, Worker, _post, _put_all

STATS_INTERVAL_S = 0.5
# What the handler reads of a Worker besides its methods: a spawned engine reports them once it is ready.
WORKER_FACTS = ("kind", "model_dir", "hidden_size", "vocab_size", "eos_token_ids", "max_model_len",
                "max_embedding_tokens", "weight_bytes")
SUMMED_STATS = ("running", "waiting", "num_free_blocks", "num_total_blocks", "num_preemptions", "spec_drafted_tokens",
                "spec_accepted_tokens")


def make_worker(config: EngineConfig, on_fatal=None):
    """A Worker, or with data_parallel_size > 1 a DataParallelWorker over that many engines."""
    if config.data_parallel_size == 1:
        return Worker(config, on_fatal)
    return DataParallelWorker(config, on_fatal)


def engine_devices(config: EngineConfig) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES for each engine (None: this process's, for engine 0 and on CPU); ValueError when
    the host has fewer GPUs than data_parallel_size x tensor_parallel_size."""
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
    return [None] + [",".join(gpus[i * tp:(i + 1) * tp]) for i in range(1, size)]


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
        self.remotes = [EngineProcess(one, index, devices[index], self._engine_lost)
                        for index in range(1, config.data_parallel_size)]
        try:
            self.local = Worker(one, on_fatal)
            for remote in self.remotes:
                remote.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        for fact in WORKER_FACTS:
            setattr(self, fact, getattr(self.local, fact))
        self.reads_images = False  # a prompt's images do not travel to the spawned engines: image parts are refused
        if self.kind != "decoder":
            self.shutdown()
            raise ValueError(f"data_parallel_size={config.data_parallel_size}: {config.model} is an embedding model, "
                             "served by one engine; set HFENDPOINT_DATA_PARALLEL_SIZE to 1")
        capacities = [self.local.stats()["num_total_blocks"]] + [r.facts["num_total_blocks"] for r in self.remotes]
        self.router = PrefixRouter(capacities, config.block_size)
        self._engine_of: dict[object, int] = {}  # requests in flight -> engine index
        self._lock = threading.Lock()
        self._lost: str | None = None

    # ---- the Worker's interface ------------------------------------------------------------------------

    def submit(self, request_id, prompt_token_ids: list[int], params, constraint=None,
               queue: asyncio.Queue | None = None, shares_prompt_with=None, images=()) -> asyncio.Queue:
        """Worker.submit's; images are refused (reads_images is False: the handler never sends any)."""
        if images:
            raise ValueError("images are not served with data parallelism (HFENDPOINT_DATA_PARALLEL_SIZE > 1)")
        queue = asyncio.Queue() if queue is None else queue
        with self._lock:
            if self._lost:
                raise RuntimeError(self._lost)
            if request_id in self._engine_of:
                raise ValueError(f"request id {request_id!r} is already in flight")
            if shares_prompt_with in self._engine_of:
                engine = self._engine_of[shares_prompt_with]
            elif constraint is not None or not self.remotes:
                engine = 0
            else:
                engine = self.router.choose(prompt_token_ids)
            tracked = _Finishing(queue, self._finished)
            if engine == 0:
                self.local.submit(request_id, prompt_token_ids, params, constraint, tracked, shares_prompt_with)
            else:
                self.local.core.make_sequence(request_id, prompt_token_ids, params)  # its checks, here (ValueError)
                self.remotes[engine - 1].submit(request_id, prompt_token_ids, params, tracked, shares_prompt_with)
            self._engine_of[request_id] = engine
            self.router.started(engine, prompt_token_ids)
        return queue

    def abort(self, request_id) -> None:
        with self._lock:
            engine = self._engine_of.get(request_id)
        if engine == 0:
            self.local.abort(request_id)
        elif engine is not None:
            self.remotes[engine - 1].abort(request_id)

    def engine_of(self, request_id) -> int | None:
        """The engine serving a request in flight (0: this process's), or None."""
        with self._lock:
            return self._engine_of.get(request_id)

    async def embed(self, token_lists: list[list[int]]) -> list[list[float]]:
        return await self.local.embed(token_lists)

    def stats(self) -> dict:
        """The engines' counts summed (their mean prefix-cache hit rate), and each engine's own in `engines`."""
        engines = [self.local.stats(), *(remote.stats() for remote in self.remotes)]
        total = {key: sum(stats.get(key, 0) for stats in engines) for key in SUMMED_STATS}
        total["prefix_cache_hit_rate"] = sum(s.get("prefix_cache_hit_rate", 0.0) for s in engines) / len(engines)
        return {**total, "engines": engines}

    @property
    def unavailable(self) -> str | None:
        return self._lost or self.local.unavailable

    def shutdown(self) -> None:
        if getattr(self, "local", None) is not None:
            self.local.shutdown()
        for remote in self.remotes:
            remote.shutdown()

    # ---- bookkeeping ---------------------------------------------------------------------------------

    def _finished(self, request_id) -> None:
        with self._lock:
            engine = self._engine_of.pop(request_id, None)
            if engine is not None:
                self.router.finished(engine)

    def _engine_lost(self, reason: str) -> None:
        """A spawned engine exited: its requests have been failed; every later call fails too."""
        with self._lock:
            self._lost = f"{reason}: the engine cannot go on"
        if self.on_fatal:
            self.on_fatal(self._lost)


class EngineProcess:
    """Engine `index` in a spawned process: its Worker's submit and abort over a pipe, and its last stats."""

    def __init__(self, config: EngineConfig, index: int, devices: str | None, on_lost):
        self.index, self.on_lost = index, on_lost
        context = multiprocessing.get_context("spawn")
        self.pipe, theirs = context.Pipe()
        self.process = context.Process(target=run_engine, args=(config, devices, theirs, os.getpid()),
                                       name=f"data-parallel-engine-{index}")  # not daemonic: it may start TP ranks
        self.process.start()
        theirs.close()
        self.facts: dict = {}
        self.last_stats: dict = {}
        self._requests: dict[object, tuple[_Finishing, asyncio.AbstractEventLoop]] = {}
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
        threading.Thread(target=self._read, name=f"data-parallel-engine-{self.index}", daemon=True).start()

    def submit(self, request_id, prompt_token_ids: list[int], params, queue: _Finishing,
               shares_prompt_with=None) -> None:
        with self._lock:
            self._requests[request_id] = (queue, asyncio.get_running_loop())
            self.pipe.send(("submit", (request_id, prompt_token_ids, params, shares_prompt_with)))

    def abort(self, request_id) -> None:
        with self._lock:
            if request_id in self._requests:
                self.pipe.send(("abort", (request_id,)))

    def stats(self) -> dict:
        return self.last_stats

    def shutdown(self) -> None:
        """Stops the engine (a second call does nothing)."""
        self._stopping = True
        self._stop()

    def _read(self) -> None:
        """Outputs to their requests' queues, on their event loops, until the engine's pipe closes."""
        while True:
            try:
                kind, payload = self.pipe.recv()
            except (EOFError, OSError):
                break
            if kind == "stats":
                self.last_stats = payload
                continue
            by_loop: dict[asyncio.AbstractEventLoop, list] = {}
            with self._lock:
                for output in payload:
                    queue, loop = self._requests[output.request_id]
                    if output.finish_reason is not None:
                        del self._requests[output.request_id]
                    by_loop.setdefault(loop, []).append((queue, output))
            for loop, items in by_loop.items():
                _post(loop, _put_all, items)
        if not self._stopping:
            self._fail_in_flight(f"data-parallel engine {self.index} exited (exit code {self.process.exitcode})")

    def _fail_in_flight(self, reason: str) -> None:
        self.on_lost(reason)  # first: no request is taken once those in flight have failed
        with self._lock:
            requests, self._requests = self._requests, {}
        for request_id, (queue, loop) in requests.items():
            _post(loop, _put_all, [(queue, RequestOutput(request_id, [], "error", f"{reason}: the engine cannot go on",
                                                         0, 0, 0))])


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

def run_engine(config: EngineConfig, devices: str | None, pipe, parent_pid: int) -> None:
    """A spawned engine: load the model on its GPUs, report its facts, then serve the parent's requests."""
    threading.Thread(target=exit_when_orphaned, args=(parent_pid,), name="orphan-watchdog", daemon=True).start()
    keep_off_protocol_streams()
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


async def serve(worker: Worker, pipe) -> None:
    """Runs the parent's submit and abort calls on the worker and sends its outputs back, batched."""
    loop = asyncio.get_running_loop()
    outputs: asyncio.Queue = asyncio.Queue()
    stopped = loop.create_future()

    def handle(kind: str, args: tuple) -> None:
        if kind == "submit":
            request_id, prompt, params, shares_prompt_with = args
            try:
                worker.submit(request_id, prompt, params, queue=outputs, shares_prompt_with=shares_prompt_with)
            except (ValueError, RuntimeError) as exc:  # checked by the parent first: only a lost engine
                outputs.put_nowait(RequestOutput(request_id, [], "error", str(exc), len(prompt), 0, 0))
        elif kind == "abort":
            worker.abort(*args)
        elif not stopped.done():
            stopped.set_result(None)

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

    async def send_outputs() -> None:
        while True:
            batch = [await outputs.get()]
            while not outputs.empty():
                batch.append(outputs.get_nowait())
            pipe.send(("outputs", batch))

    async def send_stats() -> None:
        while True:
            await asyncio.sleep(STATS_INTERVAL_S)
            pipe.send(("stats", worker.stats()))

    tasks = [loop.create_task(send_outputs()), loop.create_task(send_stats())]
    await stopped
    for task in tasks:
        task.cancel()
