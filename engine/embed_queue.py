"""Embedding calls waiting for the engine thread, handed out one batch per engine step.

A call's inputs are embedded longest first in batches within the token budget; the engine thread runs one
batch between two generation steps, so that a call of many batches shares the engine with the requests
being generated instead of holding it until its last batch. Batches take inputs from the calls in arrival
order, several small calls in one batch. A call whose caller has gone (its future cancelled) is dropped at
its next batch.
"""
import asyncio
from dataclasses import dataclass, field

from torch import Tensor


@dataclass
class EmbedJob:
    token_lists: list[list[int]]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    order: list[int] = field(init=False)  # input indices, longest first; the first `taken` are in batches
    vectors: list = field(init=False)  # per input, once embedded
    taken: int = 0
    embedded: int = 0

    def __post_init__(self):
        self.order = sorted(range(len(self.token_lists)), key=lambda i: -len(self.token_lists[i]))
        self.vectors = [None] * len(self.token_lists)


class EmbedQueue:
    def __init__(self, max_batch_tokens: int):
        self.max_batch_tokens = max_batch_tokens
        self._jobs: list[EmbedJob] = []

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def add(self, job: EmbedJob) -> None:
        self._jobs.append(job)

    def drain(self) -> list[EmbedJob]:
        """Every call still waiting for a batch, taken out (to be failed)."""
        jobs, self._jobs = self._jobs, []
        return jobs

    def take_batch(self) -> list[tuple[EmbedJob, int]]:
        """The next batch's inputs as (call, input index), within the token budget (always at least one input
        while a call waits); calls whose caller has gone are dropped first."""
        self._jobs = [job for job in self._jobs if not job.future.done()]
        batch, tokens = [], 0
        for job in self._jobs:
            while job.taken < len(job.order):
                index = job.order[job.taken]
                length = len(job.token_lists[index])
                if batch and tokens + length > self.max_batch_tokens:
                    self._jobs = [job for job in self._jobs if job.taken < len(job.order)]
                    return batch
                batch.append((job, index))
                tokens += length
                job.taken += 1
        self._jobs = [job for job in self._jobs if job.taken < len(job.order)]
        return batch


def finished_jobs(batch: list[tuple[EmbedJob, int]], vectors: Tensor) -> list[EmbedJob]:
    """Stores a batch's vectors with their calls; returns the calls that now have every vector."""
    finished = []
    for (job, index), vector in zip(batch, vectors.tolist()):
        job.vectors[index] = vector
        job.embedded += 1
        if job.embedded == len(job.token_lists):
            finished.append(job)
    return finished


def jobs_of(batch: list[tuple[EmbedJob, int]]) -> list[EmbedJob]:
    return list({id(job): job for job, _ in batch}.values())
