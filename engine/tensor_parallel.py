"""Tensor parallelism over the GPUs of one host.

Rank 0 is this process: it schedules, owns the block manager and samples. Ranks 1..N-1 are spawned
processes, each holding 1/N of every layer (models/parallel_layers.py) on GPU r and running the same
ModelRunner code. Rank 0's runner is given the TensorParallelRanks and sends each call that every rank must
make (ModelRunner.collective) to the others: a method name and small host arguments (a staged step's sizes
and numpy arrays, or token lists to embed), pickled once and written to one pipe per rank. The collectives
inside the forward (NCCL on CUDA, gloo on CPU, and the norms' sums over peer memory, models/all_reduce.py) keep
the ranks in step; each rank captures its own CUDA graphs, the sums inside them.

A rank exits when rank 0 tells it to, when its pipe reaches end-of-file (rank 0 is gone) or, should it be
stuck inside a collective, when a watchdog thread sees that its parent has died. Rank 0 watches the ranks
in turn: one that exits early leaves every later collective waiting for it, so the engine is told.
"""
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from transformers import AutoConfig

from engine.config import EngineConfig
from engine.gc_freeze import freeze_startup_objects
from engine.model_runner import ModelRunner
from engine.startup_log import note, phase, timed
from kernels import gpu_features, load_backend
from models.all_reduce import release_exchange, set_up_exchange
from models.llama import check_tensor_parallel
from models.registry import ENCODERS, LoadedModel, architecture_of, load_model

# NVLink multicast (NVLS) stays off, in NCCL and in anything built on symmetric memory.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SHUTDOWN_GRACE_S = 10.0
LOADING_SWITCH_INTERVAL_S = 0.0005  # sys.setswitchinterval while the weights load (quick_gil_handoffs)
PARENT_POLL_S = 0.2


def check_config(config: EngineConfig) -> None:
    """Clear errors for a tensor-parallel size this model or host cannot run, and for what the device cannot run,
    before anything starts."""
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel engine is already running in this process: shut it down first")
    if config.tensor_parallel_size > 1:
        check_ranks(config, config.tensor_parallel_size)
    config.check_device()


def check_ranks(config: EngineConfig, size: int) -> None:
    if config.model.endswith(".gguf"):
        raise ValueError(f"tensor_parallel_size={size}: GGUF models run on one device only; use "
                         "tensor_parallel_size=1 or the model's safetensors checkpoint")
    hf_config = AutoConfig.from_pretrained(config.model)
    if architecture_of(hf_config) in ENCODERS:
        raise ValueError(f"tensor_parallel_size={size}: encoder (embedding) models run on one device only; "
                         "use tensor_parallel_size=1")
    if config.torch_device.type == "cuda" and size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs but {torch.cuda.device_count()} are "
                         "visible: lower HFENDPOINT_TENSOR_PARALLEL_SIZE or make more GPUs visible "
                         "(CUDA_VISIBLE_DEVICES)")
    check_tensor_parallel(hf_config, size)


def load_on_all_ranks(config: EngineConfig) -> tuple[LoadedModel, "TensorParallelRanks | None"]:
    """Rank 0's part of the model, loaded while the other ranks (started here; None for one rank) load
    theirs, and on a GPU while a thread imports the kernels (Triton's compiler among them) that the first forward
    would import otherwise. EngineCore hands the ranks to its runner, whose start-up runs in step with theirs."""
    with phase("device checks"):  # on a GPU the first CUDA call, which starts the driver: its own line
        check_config(config)
    gpu_features.configure(config.disabled_gpu_features)
    ranks = TensorParallelRanks(config) if config.tensor_parallel_size > 1 else None
    device = ranks.device if ranks else config.torch_device
    try:
        with quick_gil_handoffs(), ThreadPoolExecutor(1, thread_name_prefix="kernel-imports") as pool:
            kernel_imports = None
            if device.type == "cuda":
                kernel_imports = pool.submit(timed, "kernel imports", load_backend, "cuda")
                with phase("CUDA context"):  # made by the first CUDA call: its own line, apart from the weights'
                    torch.cuda.synchronize(device)
            with phase("weights", lambda: weights_size(loaded.model)):
                loaded = load_model(config.model, config.torch_dtype, device, config.cache_dir, config.max_model_len,
                                    config.fp8_gemm)
            if kernel_imports:
                kernel_imports.result()
        if ranks:
            ranks.wait_loaded()
    except BaseException:
        if ranks:
            ranks.shutdown()
        raise
    return loaded, ranks


@contextlib.contextmanager
def quick_gil_handoffs():
    """A short interpreter switch interval while the weights load: other start-up threads (the tokenizer, the kernel
    imports, the handler's chat service parts) run Python for seconds meanwhile, and while one does, a loading
    thread that released the GIL for a copy waits a whole switch interval to get it back, after every copy."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(min(previous, LOADING_SWITCH_INTERVAL_S))
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def weights_size(model) -> str:
    """The model's parameters in GiB and where they live, for the start-up log."""
    size = sum(param.numel() * param.element_size() for param in model.parameters())
    return f"{size / 2**30:.2f} GiB on {next(model.parameters()).device}"


class TensorParallelRanks:
    def __init__(self, config: EngineConfig):
        os.environ.update(NO_MULTICAST)  # the spawned ranks inherit it
        store = dist.TCPStore("127.0.0.1", 0, config.tensor_parallel_size, is_master=True, wait_for_workers=False)
        context = multiprocessing.get_context("spawn")
        self.processes, self.pipes = [], []
        for rank in range(1, config.tensor_parallel_size):
            ours, theirs = context.Pipe()
            process = context.Process(target=run_rank, args=(config, rank, store.port, theirs, os.getpid()),
                                      name=f"tensor-parallel-rank-{rank}", daemon=True)
            process.start()
            theirs.close()
            self.processes.append(process)
            self.pipes.append(ours)
        self.graphs: list[dict] = []  # rank 0's runner's captured graphs, released before leaving the group
        self.stopping = threading.Event()  # set once shutdown has begun: ranks exiting then are expected
        self._stop = weakref.finalize(self, stop_ranks, self.processes, self.pipes, self.graphs, self.stopping)
        try:
            self.device = init_group(config, 0, store)
        except BaseException:
            self.shutdown()
            raise

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def wait_loaded(self) -> None:
        """Returns once every rank has loaded its part of the model; raises with a rank's error otherwise."""
        waiting = {pipe: rank for rank, pipe in enumerate(self.pipes, start=1)}
        sentinels = {process.sentinel: rank for rank, process in enumerate(self.processes, start=1)}
        while waiting:
            for ready in multiprocessing.connection.wait([*waiting, *sentinels]):
                if ready in sentinels:
                    rank = sentinels[ready]
                    raise RuntimeError(f"tensor-parallel rank {rank} exited (exit code "
                                       f"{self.processes[rank - 1].exitcode}) while loading the model")
                error = ready.recv()
                if error is not None:
                    raise RuntimeError(f"tensor-parallel rank {waiting[ready]} could not load the model: {error}")
                del waiting[ready]

    def release_at_shutdown(self, graphs: dict) -> None:
        """Rank 0's captured CUDA graphs, cleared before shutdown leaves the process group (see leave_group)."""
        self.graphs.append(graphs)

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """Calls on_lost(reason) from a watchdog thread if a rank exits before shutdown."""
        threading.Thread(target=self._watch, args=(on_lost,), name="tensor-parallel-watchdog", daemon=True).start()

    def _watch(self, on_lost: Callable[[str], None]) -> None:
        sentinels = {process.sentinel: rank for rank, process in enumerate(self.processes, start=1)}
        rank = sentinels[multiprocessing.connection.wait(list(sentinels))[0]]
        if not self.stopping.is_set():
            process = self.processes[rank - 1]
            process.join(PARENT_POLL_S)  # the sentinel can fire a moment before the exit code is there
            on_lost(f"tensor-parallel rank {rank} exited (exit code {process.exitcode})")

    def send_call(self, method: str, args: tuple) -> None:
        """Has every other rank call its runner's `method` with `args`, as rank 0's runner is about to."""
        payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, pipe in enumerate(self.pipes, start=1):
            try:
                pipe.send_bytes(payload)
            except OSError:
                raise RuntimeError(f"tensor-parallel rank {rank} is gone (exit code "
                                   f"{self.processes[rank - 1].exitcode}); restart the engine") from None

    def shutdown(self) -> None:
        """Stops the ranks (a second call does nothing)."""
        self._stop()


def init_group(config: EngineConfig, rank: int, store: dist.Store) -> torch.device:
    """Joins the default process group as `rank`; returns the rank's device (GPU r on CUDA)."""
    on_cuda = config.torch_device.type == "cuda"
    device = torch.device("cuda", rank) if on_cuda else torch.device("cpu")
    if on_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_cuda else "gloo", store=store, rank=rank,
                            world_size=config.tensor_parallel_size, device_id=device if on_cuda else None)
    sums = set_up_exchange(config.p2p_all_reduce, device, config.torch_dtype)
    if rank == 0:
        note(sums)
    return device


def stop_ranks(processes: list, pipes: list, graphs: list[dict], stopping: threading.Event) -> None:
    stopping.set()
    for pipe in pipes:
        try:
            pipe.send_bytes(pickle.dumps((None, ())))
        except OSError:
            pass
    leave_group(graphs)
    deadline = time.monotonic() + SHUTDOWN_GRACE_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():  # stuck in a collective rank 0 will never join
            process.kill()
            process.join()
    for pipe in pipes:
        pipe.close()


def leave_group(graphs: list[dict]) -> None:
    """Releases rank 0's CUDA graphs, then aborts its process group (the other ranks exit without teardown,
    so nothing waits for them). A captured NCCL collective holds a reference on its communicator until its
    graph is destroyed, and NCCL's destroy and abort both wait for those references: with the graphs alive,
    shutdown hangs forever."""
    for captured in graphs:
        captured.clear()
    if dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        release_exchange()  # this rank's exchange buffers, with its mappings of the other ranks'
        getattr(dist.distributed_c10d, "_abort_process_group", dist.destroy_process_group)()


# ---- the other ranks ---------------------------------------------------------------------------------

def run_rank(config: EngineConfig, rank: int, port: int, pipe, parent_pid: int) -> None:
    """A spawned rank: load its part of the model, build the runner, then run rank 0's calls until told to
    stop or orphaned."""
    threading.Thread(target=exit_when_orphaned, args=(parent_pid,), name="orphan-watchdog", daemon=True).start()
    keep_off_protocol_streams()
    os.environ.update(NO_MULTICAST)
    store = dist.TCPStore("127.0.0.1", port, config.tensor_parallel_size, is_master=False)
    device = init_group(config, rank, store)
    gpu_features.configure(config.disabled_gpu_features)
    try:
        loaded = load_model(config.model, config.torch_dtype, device, config.cache_dir, config.max_model_len,
                            config.fp8_gemm)
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which raises it
        pipe.send(f"{type(exc).__name__}: {exc}")
        return
    pipe.send(None)
    runner = ModelRunner(config, loaded)
    freeze_startup_objects()
    while True:
        try:
            method, args = pickle.loads(pipe.recv_bytes())
        except EOFError:  # rank 0 is gone
            os._exit(0)
        if method is None:
            break
        with torch.inference_mode():
            getattr(runner, method)(*args)
    os._exit(0)  # no group teardown (rank 0 aborts its side) and no interpreter teardown (a second or more)


def keep_off_protocol_streams() -> None:
    """The handler may speak the daemon protocol over its stdin/stdout, which a rank inherits: it reads
    nothing from stdin and writes what it prints to stderr."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)


def exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os._exit(0)
