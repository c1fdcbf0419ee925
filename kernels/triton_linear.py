"""Triton y = x W^T (+ b) for the few rows of a decode step, split along K.

At decode sizes a projection is a read of its weight. cuBLAS tiles such a GEMM by its output only: with a
narrow output that is far fewer programs than the GPU has SMs, and the weight is read well below bandwidth.
Here each output tile's K range is cut into SPLIT_K parts, one program each, enough to fill the GPU. Every
part stores its float32 partial product; the last part of a tile to arrive adds them all in split order
(the result does not depend on arrival order) and stores the tile. With programmatic dependent launch
(kernels/dependent_launch.py), a chain of norms and these GEMMs runs faster than with cuBLAS up to MAX_ROWS
rows. Above that cuBLAS's own tiles fill the GPU and this kernel made decode steps slower, so larger batches
and prefill stay on cuBLAS; so do rows of more than one tile over a weight larger than L2 (an LM head), which
each row tile would read from memory again.
"""
import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.dependent_launch import launch_options, release_next, wait_for_previous
from kernels.split_arrivals import arrival_counters, is_last_arrival, num_sms

MAX_ROWS = 128
MAX_SPLIT_K = 4
TILE_K = 128
NARROW_N = 2048  # outputs this narrow (Qwen3-0.6B's o and down: 1,024) take 16-column tiles, twice the programs
STAGES = 4
NARROW_STAGES = 6  # a 16-column tile's program keeps more copies in flight, where shared memory holds them


@triton.jit
def _linear_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, arrivals_ptr, M, N, K, stride_xm, stride_om,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT_K: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    split = pid % SPLIT_K  # a tile's parts run side by side, so its last arrival waits least
    tile = pid // SPLIT_K
    num_col_tiles = tl.cdiv(N, BLOCK_N)
    rows = (tile // num_col_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (tile % num_col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_len = K // SPLIT_K
    ks = split * k_len + tl.arange(0, BLOCK_K)
    row_mask = rows < M
    col_mask = cols < N
    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]
    w_ptrs = w_ptr + cols[:, None] * K + ks[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    wait_for_previous(USE_PDL)
    for _ in range(0, k_len, BLOCK_K):
        x = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=col_mask[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    release_next(USE_PDL)  # after the loop: faster than at the start at large row counts, slower at small ones
    store_split_tile(acc, out_ptr, bias_ptr, part_ptr, arrivals_ptr, tile, split, rows, cols, row_mask, col_mask,
                     M, N, stride_om, HAS_BIAS, BLOCK_M, BLOCK_N, SPLIT_K)


@triton.jit
def store_split_tile(acc, out_ptr, bias_ptr, part_ptr, arrivals_ptr, tile, split, rows, cols, row_mask, col_mask,
                     M, N, stride_om, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     SPLIT_K: tl.constexpr):
    """Store split `split` of an output tile's float32 sum; the last split of the tile to arrive adds all the
    partial sums in split order and stores the tile (+ bias) in the output's dtype."""
    mask = row_mask[:, None] & col_mask[None, :]
    if SPLIT_K == 1:
        _store_tile(out_ptr, bias_ptr, acc, rows, cols, mask, col_mask, stride_om, HAS_BIAS)
    else:
        part_offsets = rows[:, None] * N + cols[None, :]
        tl.store(part_ptr + split * M * N + part_offsets, acc, mask=mask)
        if is_last_arrival(arrivals_ptr + tile, SPLIT_K):
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for part in range(SPLIT_K):
                acc += tl.load(part_ptr + part * M * N + part_offsets, mask=mask, other=0.0, cache_modifier=".cg")
            _store_tile(out_ptr, bias_ptr, acc, rows, cols, mask, col_mask, stride_om, HAS_BIAS)


@triton.jit
def _store_tile(out_ptr, bias_ptr, acc, rows, cols, mask, col_mask, stride_om, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def split_k_outputs(x: torch.Tensor, n: int, tiles: int, split_k: int) -> tuple[torch.Tensor, ...]:
    """The output [M, n] in x's dtype and, with K split, the float32 parts and the tiles' arrival counters that
    store_split_tile reads (without a split, the output stands in for both)."""
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    part = arrivals = out
    if split_k > 1:
        part = torch.empty((split_k, x.shape[0], n), dtype=torch.float32, device=x.device)
        arrivals = arrival_counters(tiles, x.device)
    return out, part, arrivals


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: tuple) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) with config = (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps,
    num_stages); K must be a multiple of SPLIT_K * BLOCK_K."""
    block_m, block_n, block_k, split_k, num_warps, num_stages = config
    (m, k), n = x.shape, weight.shape[0]
    if k % (split_k * block_k) or x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError(f"triton linear: K={k} must be a multiple of {split_k} x {block_k}, with x's rows and the "
                         "weight contiguous")
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    out, part, arrivals = split_k_outputs(x, n, tiles, split_k)
    _linear_kernel[(tiles * split_k,)](
        x, weight, bias if bias is not None else out, out, part, arrivals, m, n, k, x.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=num_warps, num_stages=num_stages,
        **launch_options(x),
    )
    return out


def choose_config(m: int, n: int, k: int, sms: int, shared_memory: int, l2_bytes: int,
                  element_size: int = 2) -> tuple | None:
    """The kernel's config for an [m, k] x [n, k]^T product, or None for cuBLAS (no rows, m > MAX_ROWS, K not a
    multiple of TILE_K, or rows of several tiles over a weight larger than the l2_bytes of L2, which each row
    tile would read from memory again). Tiles of 16 rows up to 16 rows, else 64; 16 columns for outputs of up to
    NARROW_N (with 2 warps on 16-row tiles, and NARROW_STAGES where a program's shared_memory bytes hold their
    tiles of element_size), else 32; K split in two or four while the programs still fit in one wave. Chosen
    by timing the Qwen3-0.6B projections back to back in CUDA graphs, then end to end (bench/RESULTS.md)."""
    if not 0 < m <= MAX_ROWS or k % TILE_K:
        return None
    block_m = 16 if m <= 16 else 64
    if m > block_m and n * k * element_size > l2_bytes:
        return None
    block_n = 16 if n <= NARROW_N else 32
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split_k = 1
    while split_k < MAX_SPLIT_K and 2 * split_k * tiles <= sms and k % (2 * split_k * TILE_K) == 0:
        split_k *= 2
    num_warps = 2 if block_m == block_n == 16 else 4
    deep = block_n == 16 and (block_m + block_n) * TILE_K * element_size * NARROW_STAGES <= shared_memory
    return block_m, block_n, TILE_K, split_k, num_warps, NARROW_STAGES if deep else STAGES


@functools.cache
def memory_sizes(device: torch.device) -> tuple[int, int]:
    """The shared memory one program may take on the device (an SM's, less the 1 KB the driver reserves) and its
    L2's bytes; no limits for the interpreter on a CPU."""
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        return properties.shared_memory_per_multiprocessor - 1024, properties.L2_cache_size
    return 1 << 30, 1 << 40


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear, through this kernel where choose_config picks it for a 2-D x with contiguous rows."""
    config = None
    if x.dim() == 2 and x.stride(1) == 1 and weight.is_contiguous():
        config = choose_config(x.shape[0], weight.shape[0], x.shape[1], num_sms(x.device), *memory_sizes(x.device),
                               x.element_size())
    return F.linear(x, weight, bias) if config is None else linear(x, weight, bias, config)
