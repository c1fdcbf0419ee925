"""The sum over tensor-parallel ranks of the decoder's row-parallel outputs, done by the norm that reads them.

Every attention and MLP block of the decoder ends in a row-parallel projection whose output each rank holds a part
of, and the next thing to read that output is always an RMSNorm (with the residual add, or alone). So the block hands
over a `RankPartial` and the norm sums it: for a decode step's rows, in one kernel that also adds and norms
(kernels/triton_all_reduce_norm.py), each rank's GPU reading the others' rows from their memory; for anything
larger, where a collective's bandwidth pays, or where that path is off or unavailable, through dist.all_reduce
(NCCL, or gloo on the CPU) and then the norm.

The exchange buffers live in torch's symmetric memory, allocated and rendezvoused once per process group. No NVLink
multicast takes part (engine/tensor_parallel.py keeps it off). Which path a sum takes depends only on what every
rank has alike (its rows' count, width and dtype, and the group's set-up, which the ranks agree on when they start),
so the ranks always meet in the same exchange.
"""
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from kernels import add_rms_norm, rms_norm

MAX_ROWS = 128  # a decode step's rows; each is a program that waits on the other ranks, all resident at once
ROW_BYTES = 32 << 10  # a staged row's room: a hidden size of 16,384 in bfloat16
MAX_RANKS = 8  # each rank reads every other's rows: beyond one host's GPUs, NCCL

_exchange = None  # kernels.triton_all_reduce_norm.Exchange, where set_up_exchange() found the path available
# Whether this process has rendezvoused symmetric memory before. torch (pytorch#196082) numbers a process's
# rendezvous and expects every rank to be at the same number: rank 0 outlives its engines, the other ranks are
# started afresh with each, so a second engine's rendezvous would wait for keys its new ranks never write.
_rendezvoused = False
_buffer = None  # this rank's symmetric allocation, kept alive with the mappings of the others'


class RankPartial(NamedTuple):
    """A row-parallel output: each rank holds its own part of the sum the next norm takes."""
    part: Tensor

    def summed(self) -> Tensor:
        """The sum itself, in place of this rank's part."""
        dist.all_reduce(self.part)
        return self.part

    def norm(self, residual: Tensor | None, weight: Tensor, eps: float):
        """rms_norm(sum) or, with a residual, (rms_norm(sum + residual), sum + residual)."""
        if _exchange is not None and self.part.is_cuda and _exchange.fits(self.part):
            from kernels.triton_all_reduce_norm import all_reduce_rms_norm
            return all_reduce_rms_norm(self.part, residual, weight, eps, _exchange)
        x = self.summed()
        return rms_norm(x, weight, eps) if residual is None else add_rms_norm(x, residual, weight, eps)


def unavailable_reason(enabled: bool, backend: str, world_size: int, device: torch.device) -> str | None:
    """Why this rank cannot sum over peer memory (None: it can)."""
    if not enabled:
        return "turned off (HFENDPOINT_P2P_ALL_REDUCE=false)"
    if device.type != "cuda" or backend != "nccl":
        return f"the group runs on {device.type} with {backend}, not on CUDA GPUs with NCCL"
    if world_size > MAX_RANKS:
        return f"{world_size} ranks: sums over peer memory serve at most {MAX_RANKS}"
    blind = [peer for peer in range(world_size)
             if peer != device.index and not torch.cuda.can_device_access_peer(device, peer)]
    if blind:
        return f"GPU {device.index} cannot read the memory of GPU {', '.join(map(str, blind))} (no peer access)"
    return None


def set_up_exchange(enabled: bool, device: torch.device, dtype: torch.dtype) -> str:
    """Sets the sums over peer memory up for the default process group where every rank can take them; every rank
    calls it once, right after joining the group. Returns what the norms' sums take, and why, for the start-up log."""
    global _exchange, _rendezvoused
    _exchange = None
    reason = unavailable_reason(enabled, dist.get_backend(), dist.get_world_size(), device)
    if reason is None and _rendezvoused:
        reason = "an earlier process group of this process rendezvoused symmetric memory (torch counts them per " \
                 "process; this group's new ranks start from zero)"
    if device.type == "cuda":  # peer access and the rendezvous are each rank's own: all ranks take the path or none
        reason = agreed(reason)
        exchange = None
        if reason is None:
            try:
                _rendezvoused = True  # from the first attempt on: a failed one may have counted too
                exchange = mapped_exchange(device, dtype)
            except (RuntimeError, OSError) as exc:
                reason = f"symmetric memory could not be set up: {exc}"
            reason = agreed(reason)
        _exchange = exchange if reason is None else None
    if _exchange is None:
        return f"tensor-parallel sums through {dist.get_backend()} only: {reason}"
    return f"tensor-parallel sums of up to {_exchange.max_rows} rows over peer memory in the norms, " \
           f"{dist.get_backend()} above"


def mapped_exchange(device: torch.device, dtype: torch.dtype):
    """This rank's view of every rank's exchange buffers (kernels/triton_all_reduce_norm.py), its own flags set to
    idle, once every rank has done the same."""
    global _buffer
    from torch.distributed._symmetric_memory import _SymmetricMemory, rendezvous

    from kernels.triton_all_reduce_norm import Exchange
    world, rank = dist.get_world_size(), dist.get_rank()
    max_rows = min_over_ranks(min(MAX_ROWS, torch.cuda.get_device_properties(device).multi_processor_count))
    pitch = ROW_BYTES // dtype.itemsize
    flag_words = 2 * max_rows * world
    group = dist.group.WORLD.group_name
    # allocated directly, not from symmetric memory's pool: freed with this module's reference, its mappings with it
    _buffer = _SymmetricMemory.empty_strided_p2p((max_rows * ROW_BYTES + 4 * flag_words,), (1,), torch.uint8, device,
                                                 group_name=group)
    handle = rendezvous(_buffer, group)
    flags_at = max_rows * ROW_BYTES // 4
    rows = tuple(handle.get_buffer(r, (max_rows, pitch), dtype) for r in range(world))
    flags = tuple(handle.get_buffer(r, (2, max_rows, world), torch.int32, flags_at) for r in range(world))
    flags[rank][0].zero_()  # no arrivals
    flags[rank][1].fill_(1)  # every staged row free
    torch.cuda.synchronize(device)
    dist.barrier()
    return Exchange(rank, rows, flags)


def release_exchange() -> None:
    """Drops the sums over peer memory (before the group is left; the CUDA graphs that replay them must be gone)."""
    global _exchange, _buffer
    _exchange = _buffer = None


def min_over_ranks(value: int) -> int:
    """The smallest of every rank's value (what every rank must size alike: the KV cache's blocks, each rank sizing
    its own from its free memory; the exchange's rows)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def agreed(reason: str | None) -> str | None:
    """This rank's reason, or one naming the others when only they cannot take the path. A collective: every rank
    joins it, those with a reason of their own too."""
    every_rank_can = min_over_ranks(int(reason is None))
    if reason is None and not every_rank_can:
        return "another rank cannot take it"
    return reason
