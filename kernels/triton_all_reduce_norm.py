"""RMSNorm of a sum over tensor-parallel ranks, fused with the sum and the residual add, for decode-sized rows.

A decode step's all-reduce costs its latency, not its bytes, and a collective's own kernel breaks the chain of
dependent launches (kernels/dependent_launch.py). Here each rank's GPU reads the other ranks' partial rows
straight from their memory (one host, peer access) in the norm's own kernel.

Every rank has mapped every other rank's `Exchange` (the caller allocates them in symmetric memory): MAX_ROWS staged
rows, and two [MAX_ROWS, WORLD] int32 flag arrays, `arrived[row, r]`, set by rank r once its row is staged here too,
and `free[row, r]`, set by rank r once it has read this rank's staged row, which may then be overwritten. One
program per row: it waits until every peer has read its last staged row, stages the new one, tells each peer it
arrived, waits for every peer's arrival, sums the ranks' rows in rank order (every rank gets the same bits), frees
the peers' rows, then adds the residual and norms as kernels/triton_norm.py does. A flag is taken back by its waiter
(1 -> 0), so the exchange replays inside CUDA graphs with nothing to reset. A rank's programs all wait on other
ranks, so all must be resident at once: MAX_ROWS is at most the GPU's multiprocessor count.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.dependent_launch import launch_options, release_next, wait_for_previous
from kernels.triton_norm import block_and_warps, norm_operands, norm_row, norm_tensors


@dataclass(frozen=True)
class Exchange:
    """One rank's view of the group's exchange buffers: `rows[r]` [MAX_ROWS, pitch] and `flags[r]`
    [2, MAX_ROWS, WORLD] int32 (arrived, free) are rank r's, mapped here. Every free flag starts at 1."""
    rank: int
    rows: tuple[torch.Tensor, ...]
    flags: tuple[torch.Tensor, ...]

    @property
    def max_rows(self) -> int:
        return self.rows[0].shape[0]

    def fits(self, x: torch.Tensor) -> bool:
        """Whether x [T, H] can be summed here: rows of the staging dtype, no more of them than MAX_ROWS, no wider."""
        rows = x.reshape(-1, x.shape[-1]).shape[0]
        return x.dtype == self.rows[0].dtype and 0 < rows <= self.max_rows and x.shape[-1] <= self.rows[0].shape[1]


@triton.jit
def _wait_and_take(flag_ptr):
    while tl.atomic_cas(flag_ptr, 1, 0, sem="acquire", scope="sys") != 1:
        pass


@triton.jit
def _all_reduce_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr, rows, flags,
    stride_x, stride_r, stride_o, stride_nr, stride_staged, eps,
    RANK: tl.constexpr, WORLD: tl.constexpr, MAX_ROWS: tl.constexpr,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    w, residual = norm_operands(residual_ptr, weight_ptr, row.to(tl.int64), offs, mask, stride_r, HAS_RESIDUAL)
    wait_for_previous(USE_PDL)
    release_next(USE_PDL)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=mask, other=0.0)
    arrived, free = flags[RANK] + row * WORLD, flags[RANK] + (MAX_ROWS + row) * WORLD
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            _wait_and_take(free + peer)
    tl.store(rows[RANK] + row * stride_staged + offs, x, mask=mask)
    tl.debug_barrier()  # every thread's part of the row is stored before a peer is told it arrived
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            tl.atomic_xchg(flags[peer] + row * WORLD + RANK, 1, sem="release", scope="sys")
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            _wait_and_take(arrived + peer)
    tl.debug_barrier()
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(WORLD):
        if r == RANK:
            total += x.to(tl.float32)
        else:
            total += tl.load(rows[r] + row * stride_staged + offs, mask=mask, other=0.0).to(tl.float32)
    tl.debug_barrier()  # every thread has read the peers' rows before they may be overwritten
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            tl.atomic_xchg(flags[peer] + (MAX_ROWS + row) * WORLD + RANK, 1, sem="release", scope="sys")
    norm_row(total.to(x.dtype), residual, w, row.to(tl.int64), offs, mask, out_ptr, new_residual_ptr, stride_o,
             stride_nr, eps, HIDDEN, HAS_RESIDUAL)  # the sum rounded as a collective hands it over


def all_reduce_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                        exchange: Exchange):
    """rms_norm(sum over ranks of x) or, with a residual, (rms_norm(sum + residual), sum + residual), where every
    rank passes its own x of the same shape (exchange.fits(x)) and gets the same result."""
    hidden = x.shape[-1]
    x2, r2, out, new_residual = norm_tensors(x, residual, weight)
    block, num_warps = block_and_warps(hidden)
    _all_reduce_rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, out, new_residual, exchange.rows, exchange.flags,
        x2.stride(0), r2.stride(0), out.stride(0), new_residual.stride(0), exchange.rows[0].stride(0), eps,
        RANK=exchange.rank, WORLD=len(exchange.rows), MAX_ROWS=exchange.max_rows,
        HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=num_warps, **launch_options(x2),
    )
    out = out.view(x.shape)
    return out if residual is None else (out, new_residual.view(x.shape))
