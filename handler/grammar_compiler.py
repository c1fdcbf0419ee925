"""Grammar compiles in child processes (handler/grammar_worker.py), a few at a time, each within a time budget.

Each child is driven by a daemon thread of its own that takes compile jobs from one queue, so compiles never
occupy the encoding threads that every chat request needs, and at most as many run as there are children.
A compile that outlives its request's budget, or whose request is cancelled, is abandoned by killing its
child (xgrammar cannot be interrupted otherwise); the next job starts a fresh one. Children die with the
handler (at exit, or by the kernel's parent-death signal), so no compile holds up shutdown. The children's
stderr (xgrammar's C++ warnings) goes through handler/library_warnings.py: once per kind.
"""
import asyncio
import atexit
import os
import queue
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from handler.library_warnings import library_warnings

POLL_S = 0.05  # how often a waiting compile looks at its deadline and its request's cancellation
READ_BYTES = 1 << 20
SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where the child imports handler from


class CompileTimeout(Exception):
    """The compile ran past its budget (its child was killed)."""


class CompileRefused(Exception):
    """The library refused the schema, or its grammar allows nothing; the message says why."""


@dataclass
class CompileJob:
    schema: str
    deadline: float
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    cancelled: threading.Event = field(default_factory=threading.Event)


class GrammarCompilerPool:
    def __init__(self, tokenizer_info_json: str, deserialize, processes: int, max_grammar_bytes: int):
        """deserialize(serialized grammar) -> what compile returns (handler/grammar.py: the CompiledGrammar and
        its JSON); runs on the pool's threads. A grammar larger than max_grammar_bytes is refused."""
        self._info = tokenizer_info_json
        self._max_grammar_bytes = max_grammar_bytes
        self._deserialize = deserialize
        self._jobs: queue.SimpleQueue[CompileJob] = queue.SimpleQueue()
        self._children: list[subprocess.Popen] = []
        self._closed = False
        self._lock = threading.Lock()
        atexit.register(self.close)
        for index in range(processes):
            threading.Thread(target=self._serve, name=f"grammar-{index}", daemon=True).start()

    async def compile(self, schema: str, timeout: float):
        """deserialize's result for the grammar of a JSON schema (text). Raises CompileTimeout, CompileRefused; a
        cancelled caller's compile is abandoned."""
        loop = asyncio.get_running_loop()
        job = CompileJob(schema, time.monotonic() + timeout, loop, loop.create_future())
        self._jobs.put(job)
        try:
            return await job.future
        finally:
            job.cancelled.set()  # done, failed or cancelled: a child still at it is no longer wanted

    def close(self) -> None:
        """Kills the children; the pool takes no more jobs (at exit)."""
        with self._lock:
            self._closed = True
            children, self._children = self._children, []
        for child in children:
            child.kill()

    def _serve(self) -> None:
        """One child's loop; a fresh child is started before the next job is taken, so a job never waits for
        one to start."""
        child = self._start_child()
        while child is not None:
            job = self._jobs.get()
            if job.cancelled.is_set():
                continue
            if time.monotonic() >= job.deadline:  # its budget went by in the queue: the child stays
                self._settle(job, CompileTimeout())
                continue
            if child.poll() is not None:  # died between jobs (killed at exit, or for memory)
                child = self._start_child()
                if child is None:
                    self._settle(job, CompileTimeout())
                    return
            try:
                child.stdin.write(job.schema.encode() + b"\n")
                child.stdin.flush()
                reply = self._read_reply(child, job)
            except (OSError, ValueError):  # the child died
                reply = None
            if reply is None:  # out of time, cancelled (abandoned), or the child died compiling it
                died = time.monotonic() < job.deadline and not job.cancelled.is_set()
                self._kill(child)
                self._settle(job, CompileRefused("the grammar compiler died compiling this JSON schema (out of "
                                                 "memory?); simplify it") if died else CompileTimeout())
                child = self._start_child()
                continue
            try:
                result = self._result(reply)
            except CompileRefused as exc:
                result = exc
            self._settle(job, result)

    def _result(self, reply: bytes):
        kind, _, content = reply.decode().rstrip("\n").partition(" ")
        if kind != "grammar":
            raise CompileRefused(content)
        return self._deserialize(content)

    def _read_reply(self, child: subprocess.Popen, job: CompileJob) -> bytes | None:
        """The child's answer line; None when the job ran out of time, was cancelled, or the child died."""
        received = bytearray()
        fd = child.stdout.fileno()
        while not job.cancelled.is_set() and time.monotonic() < job.deadline:
            if not select.select([fd], [], [], POLL_S)[0]:
                continue
            piece = os.read(fd, READ_BYTES)
            if not piece:
                return None
            received += piece
            if received.endswith(b"\n"):
                return bytes(received)
        return None

    def _start_child(self) -> subprocess.Popen | None:
        """A fresh child, given the tokenizer; None once the pool is closed."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [SOURCE_ROOT, os.environ.get("PYTHONPATH")]))}
        with self._lock:
            if self._closed:
                return None
            child = subprocess.Popen([sys.executable, "-m", "handler.grammar_worker", str(self._max_grammar_bytes)],
                                     stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
            self._children.append(child)
        threading.Thread(target=relay_warnings, args=(child.stderr,), name="grammar-stderr", daemon=True).start()
        try:
            child.stdin.write(self._info.encode() + b"\n")
            child.stdin.flush()
        except OSError:  # killed at once (the pool closed meanwhile): the next job finds it dead
            pass
        return child

    def _kill(self, child: subprocess.Popen) -> None:
        child.kill()
        child.wait()
        with self._lock:
            if child in self._children:
                self._children.remove(child)

    @staticmethod
    def _settle(job: CompileJob, result) -> None:
        """Hands the result (or exception) to the waiting request, if it still waits."""
        def settle():
            if job.future.done():  # cancelled
                return
            if isinstance(result, BaseException):
                job.future.set_exception(result)
            else:
                job.future.set_result(result)
        try:
            job.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # its event loop has closed
            pass


def relay_warnings(stderr) -> None:
    """A child's stderr lines, as xgrammar warnings, until it exits."""
    for line in stderr:
        text = line.decode(errors="replace").strip()
        if text:
            library_warnings.log("xgrammar", text)
