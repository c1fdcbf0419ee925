"""The engine thread and its thread-safe front door for the asyncio world.

submit(), abort() and embed() only hand work over under a lock and wake the thread; the thread applies
it between steps, runs a step, and delivers every request's new tokens of that step with one
call_soon_threadsafe per event loop. Idle, the thread sleeps on a condition variable.
"""
import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from engine.config import EngineConfig
from engine.embed_queue import EmbedJob, EmbedQueue, finished_jobs, jobs_of
from engine.embedding import Embedder, check_inputs
from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.speculation import NO_SPECULATION
from engine.startup_log import note
from engine.tensor_parallel import load_on_all_ranks

log = logging.getLogger(__name__)
LOST_ENGINE_JOIN_S = 5.0


class RequestOutput(NamedTuple):
    """What a request's delivery carries (a tuple: cheap to make and to pickle, engine/data_parallel.py)."""
    request_id: object
    new_token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"; set only on a request's last item
    error: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    logprobs: list | None = None  # per new token, when the request asks: (its logprob, top ids, their logprobs)
    prompt_logprobs: list | None = None  # on the first output of a request that asks: per prompt token, as logprobs
    #                                      (None for the first token)


@dataclass
class _Request:
    seq: Sequence
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    num_sent: int = 0  # output tokens delivered (a verification step adds several at once)


class Worker:
    def __init__(self, config: EngineConfig, on_fatal: Callable[[str], None] | None = None):
        """on_fatal(reason), called from another thread, says the engine cannot run another step (a
        tensor-parallel rank died): every request in flight has been failed with the reason."""
        self.config = config
        self.on_fatal = on_fatal
        loaded, self.ranks = load_on_all_ranks(config)
        self.kind, self.model_dir, self.weight_bytes = loaded.kind, loaded.model_dir, loaded.weight_bytes
        self.hidden_size = loaded.hf_config.hidden_size
        self.vocab_size = loaded.hf_config.vocab_size
        self.reads_images = loaded.vision is not None  # submit() takes a prompt's images (engine/images.py)
        self.image_token_id = loaded.vision.image_token_id if self.reads_images else None
        if self.kind in ("encoder", "classifier"):  # a classifier's "embeddings" are its logits
            self.core = None
            self.embedder = (Embedder.for_classifier if self.kind == "classifier" else Embedder.for_encoder)(config,
                                                                                                            loaded)
            self.eos_token_ids, self.max_model_len = (), self.embedder.max_model_len
        else:
            self.core = EngineCore(config, loaded, self.ranks)
            self.embedder = self.core.embedder
            self.eos_token_ids, self.max_model_len = self.core.eos_token_ids, self.core.max_model_len
        self.max_embedding_tokens = self.embedder.max_model_len
        self._cond = threading.Condition()
        self._new: list[_Request] = []
        self._aborts: list = []
        self._embed_jobs = EmbedQueue(self.embedder.max_batch_tokens)  # one batch per engine iteration
        self._requests: dict[object, _Request] = {}  # in flight, by request id (engine thread and submit)
        self._stopped = False
        self._lost: str | None = None  # why the engine cannot go on
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()
        if self.ranks:
            self.ranks.watch(self._engine_lost)
        note("engine ready")

    # ---- called from the event loop (any thread) ------------------------------------------------

    def submit(self, request_id, prompt_token_ids: list[int], params: SamplingParams, constraint=None,
               queue: asyncio.Queue | None = None, shares_prompt_with=None, images=(), loop=None) -> asyncio.Queue:
        """Queues a generation request; its outputs arrive on the returned queue (`queue` when given: requests
        may share one, their outputs told apart by request_id). constraint: engine/constraints.py.
        shares_prompt_with: the id of a request in flight with the same prompt, whose prompt blocks this one
        takes from the prefix cache. images: the prompt's (engine/images.py's PromptImage). loop: what the engine
        thread hands each step's outputs to with call_soon_threadsafe (default: the running event loop). Bad input
        -> ValueError."""
        if self.core is None:
            raise ValueError(f"model {self.config.model} is an embedding model: it serves embeddings only")
        with self._cond:
            leader = self._requests.get(shares_prompt_with) if shares_prompt_with is not None else None
        seq = self.core.make_sequence(request_id, prompt_token_ids, params, constraint, leader and leader.seq, images)
        request = _Request(seq, asyncio.Queue() if queue is None else queue, loop or asyncio.get_running_loop())
        with self._cond:
            self._check_running()
            if request_id in self._requests:
                raise ValueError(f"request id {request_id!r} is already in flight")
            self._requests[request_id] = request
            self._new.append(request)
            self._cond.notify()
        return request.queue

    def abort(self, request_id) -> None:
        """Stops a request; its blocks are freed at the next step and its queue gets a final "abort" item."""
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    async def embed(self, token_lists: list[list[int]]) -> list[list[float]]:
        """Pooled, normalised vectors, one batch (shared with concurrent calls) between two generation steps
        (engine/embed_queue.py); cancelled, the call stops at its next batch."""
        check_inputs(token_lists, self.vocab_size, self.max_embedding_tokens)
        loop = asyncio.get_running_loop()
        job = EmbedJob([list(tokens) for tokens in token_lists], loop.create_future(), loop)
        with self._cond:
            self._check_running()
            self._embed_jobs.add(job)
            self._cond.notify()
        return await job.future

    @property
    def unavailable(self) -> str | None:
        """Why the engine takes no more work (a lost tensor-parallel rank, or shutdown), or None."""
        return self._lost or ("the engine has shut down" if self._stopped else None)

    def _check_running(self) -> None:
        if self._lost:
            raise RuntimeError(self._lost)
        if self._stopped:
            raise RuntimeError("the engine has shut down")

    def _engine_lost(self, reason: str) -> None:
        """The tensor-parallel watchdog's report: the engine thread may be stuck in a collective that never
        completes, so requests in flight and embedding calls fail here, and so does every later call."""
        error = f"{reason}: the engine cannot go on"
        log.error(error)
        with self._cond:
            self._lost = error
            requests, self._requests, self._new = list(self._requests.values()), {}, []
            jobs = self._embed_jobs.drain()
            self._cond.notify()
        for request in requests:
            seq = request.seq
            output = RequestOutput(seq.request_id, [], "error", error, seq.num_prompt_tokens, seq.num_output_tokens,
                                   seq.num_cached_tokens)
            _post(request.loop, _put_all, [(request.queue, output)])
        for job in jobs:
            _post(job.loop, _set_future, job.future, None, RuntimeError(error))
        if self.on_fatal:
            self.on_fatal(error)

    def stats(self) -> dict:
        if self.core is None:
            return {"running": 0, "waiting": 0, "num_free_blocks": 0, "num_total_blocks": 0,
                    "prefix_cache_hit_rate": 0.0, "num_preemptions": 0, **NO_SPECULATION}
        return self.core.stats()

    def shutdown(self) -> None:
        """Stops the thread (requests still in flight end with "abort") and the tensor-parallel ranks."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(LOST_ENGINE_JOIN_S if self._lost else None)  # after a lost rank it may never return
        if self.ranks:
            self.ranks.shutdown()

    # ---- the engine thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stopped or self._lost or self._new or self._aborts or self._embed_jobs
                           or (self.core and (self.core.has_work() or self.core.warming_up))):
                    self._cond.wait()
                if self._lost:  # its requests have been failed; no step can complete any more
                    return
                stopping = self._stopped
                if stopping:
                    self._aborts.extend(self._requests)
                new, self._new = self._new, []
                aborts, self._aborts = self._aborts, []
                batch = self._embed_jobs.take_batch()
            try:
                self._iteration(new, aborts, batch)
            except Exception as exc:  # a bug in one iteration fails its requests, not the process
                log.exception("engine iteration failed")
                self._fail_everything(f"{type(exc).__name__}: {exc}")
                for job in jobs_of(batch):  # embedding calls this iteration took and may not have answered
                    _post(job.loop, _set_future, job.future, None, exc)
            if stopping:
                with self._cond:
                    jobs = self._embed_jobs.drain()
                for job in jobs:
                    _post(job.loop, _set_future, job.future, None, RuntimeError("the engine shut down"))
                return

    def _iteration(self, new: list[_Request], aborts: list, batch: list[tuple[EmbedJob, int]]) -> None:
        for request in new:
            self.core.add(request.seq)
        finished = []
        for request_id in aborts:
            request = self._requests.get(request_id)
            if request is not None and not request.seq.is_finished:
                self.core.abort(request.seq)
                finished.append((request.seq, None))
        self._deliver(finished)
        if batch:
            self._run_embed_batch(batch)
        if self.core and self.core.has_work():
            self._deliver(self.core.step())
        elif self.core and self.core.warming_up:  # idle: the next part of the warm-up
            self.core.warm_up_next()

    def _run_embed_batch(self, batch: list[tuple[EmbedJob, int]]) -> None:
        try:
            vectors = self.embedder.embed([job.token_lists[index] for job, index in batch])
        except Exception as exc:  # noqa: BLE001 - reported to the callers
            for job in jobs_of(batch):
                _post(job.loop, _set_future, job.future, None, exc)
            return
        for job in finished_jobs(batch, vectors):
            _post(job.loop, _set_future, job.future, job.vectors, None)

    def _deliver(self, results: list[tuple[Sequence, int | None]]) -> None:
        """Posts one step's outputs with a single call_soon_threadsafe per event loop."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for seq, token_id in results:
            request = self._requests.get(seq.request_id)
            if request is None or (token_id is None and not seq.is_finished):
                continue
            new_token_ids = [] if token_id is None else seq.token_ids[seq.num_prompt_tokens + request.num_sent:]
            logprobs = (seq.logprobs[request.num_sent:] if token_id is not None and seq.params.logprobs is not None
                        else None)
            first = request.num_sent == 0 and bool(new_token_ids)
            request.num_sent += len(new_token_ids)
            output = RequestOutput(seq.request_id, new_token_ids, seq.finish_reason, seq.error, seq.num_prompt_tokens,
                                   seq.num_output_tokens, seq.num_cached_tokens, logprobs,
                                   seq.prompt_logprobs if first else None)
            batches.setdefault(request.loop, []).append((request.queue, output))
            if seq.is_finished:
                with self._cond:
                    self._requests.pop(seq.request_id, None)  # gone already if the engine was lost meanwhile
        for loop, items in batches.items():
            _post(loop, _put_all, items)

    def _fail_everything(self, error: str) -> None:
        seqs = [request.seq for request in list(self._requests.values()) if not request.seq.is_finished]
        for seq in seqs:
            self.core.abort(seq)
            seq.finish("error", error)
        self._deliver([(seq, None) for seq in seqs])


def _post(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # that event loop is closed; nobody is listening
        pass


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, output in items:
        queue.put_nowait(output)


def _set_future(future: asyncio.Future, result, exc: Exception | None) -> None:
    if future.done():  # cancelled by its caller, or already answered before the iteration failed
        return
    if exc is None:
        future.set_result(result)
    else:
        future.set_exception(exc)
