"""Triton y = x W^T (+ b) for the rows of a decode step, split along K.

At decode sizes a projection is a read of its weight. cuBLAS tiles such a GEMM by its output only: with a
narrow output that is far fewer programs than the GPU has SMs, and the weight is read well below bandwidth.
Here each output tile's K range is cut into SPLIT_K parts, one program each, enough to fill the GPU. Every
part stores its float32 partial product; the last part of a tile to arrive adds them all in split order
(the result does not depend on arrival order) and stores the tile. With programmatic dependent launch
(kernels/dependent_launch.py), a chain of norms and these GEMMs runs faster than with cuBLAS up to MAX_ROWS
rows.

Up to POINTER_ROWS rows the operands are loaded through pointers. Above that, row tiles of 64 take their
operands through tensor descriptors (TMA copies into shared memory on Hopper), with tiles chosen so that every
program of a launch is resident at once; the pointer loads' tiles lost to cuBLAS there (bench/RESULTS.md), so
without descriptors (before Hopper, or turned off: kernels/gpu_features.py) those rows go to cuBLAS.
Prefill stays on cuBLAS; so do rows of more than one tile over a weight larger than L2 (an LM head), which
each row tile would read from memory again.

gated_linear is an MLP's gate and up projections with its activation, act(x W_gate^T) * (x W_up^T): each
program reads a tile of gate rows and the matching up rows and stores the activated product, so a decode step
has no activation launch and no [M, 2I] round trip.
"""
import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels import gpu_features
from kernels.dependent_launch import launch_options, release_next, wait_for_previous
from kernels.split_arrivals import arrival_counters, is_last_arrival, num_sms
from kernels.triton_activation import act_and_mul, gated_activation

MAX_ROWS = 256
POINTER_ROWS = 64
EARLY_RELEASE_ROWS = 16  # up to this many rows a program lets the next kernel launch before its loop, not after
MAX_SPLIT_K = 4
MAX_PROGRAM_K = 2048  # in 16-row tiles, K is split further while a program's run of it is longer
TILE_K = 128
NARROW_N = 2048  # outputs this narrow (Qwen3-0.6B's o and down: 1,024) take 16-column tiles, twice the programs
STAGES = 4
NARROW_STAGES = 6  # a 16-column tile's program keeps more copies in flight, where shared memory holds them
GATED_ACTIVATIONS = ("silu", "gelu_tanh")


@triton.jit
def _linear_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, arrivals_ptr, M, N, K, stride_xm, stride_om,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT_K: tl.constexpr, DOT_PRECISION: tl.constexpr, GATED: tl.constexpr, GELU_TANH: tl.constexpr,
                   EARLY_RELEASE: tl.constexpr, USE_PDL: tl.constexpr):
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
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # gated: the up rows' product (the gate's in acc)
    wait_for_previous(USE_PDL)
    if EARLY_RELEASE:
        release_next(USE_PDL)
    for _ in range(0, k_len, BLOCK_K):
        x = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=col_mask[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        if GATED:
            w = tl.load(w_ptrs + N * K, mask=col_mask[:, None], other=0.0)
            up = tl.dot(x, tl.trans(w), up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if not EARLY_RELEASE:
        release_next(USE_PDL)
    _finish_tile(acc, up, out_ptr, bias_ptr, part_ptr, arrivals_ptr, tile, split, rows, cols, row_mask, col_mask,
                 M, N, stride_om, HAS_BIAS, SPLIT_K, GATED, GELU_TANH)


@triton.jit
def _descriptor_linear_kernel(x_desc, w_desc, bias_ptr, out_ptr, part_ptr, arrivals_ptr, M, N, K, stride_om,
                              HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, STAGES: tl.constexpr,
                              DOT_PRECISION: tl.constexpr, GATED: tl.constexpr, GELU_TANH: tl.constexpr,
                              USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    split = pid % SPLIT_K
    tile = pid // SPLIT_K
    num_row_tiles = tl.cdiv(M, BLOCK_M)
    row0 = (tile % num_row_tiles) * BLOCK_M  # a column tile's row tiles side by side: its weight slice read once
    col0 = (tile // num_row_tiles) * BLOCK_N
    k_len = K // SPLIT_K
    k0 = split * k_len
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    wait_for_previous(USE_PDL)
    for k in tl.range(0, k_len, BLOCK_K, num_stages=STAGES):
        x = x_desc.load([row0, k0 + k])
        acc = tl.dot(x, w_desc.load([col0, k0 + k]).T, acc, input_precision=DOT_PRECISION)
        if GATED:
            up = tl.dot(x, w_desc.load([N + col0, k0 + k]).T, up, input_precision=DOT_PRECISION)
    release_next(USE_PDL)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    _finish_tile(acc, up, out_ptr, bias_ptr, part_ptr, arrivals_ptr, tile, split, rows, cols, rows < M, cols < N,
                 M, N, stride_om, HAS_BIAS, SPLIT_K, GATED, GELU_TANH)


@triton.jit
def _finish_tile(acc, up, out_ptr, bias_ptr, part_ptr, arrivals_ptr, tile, split, rows, cols, row_mask, col_mask,
                 M, N, stride_om, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, GATED: tl.constexpr,
                 GELU_TANH: tl.constexpr):
    """store_split_tile, or for a gated tile the same over the (gate, up) pair (its float32 parts [SPLIT_K, 2, M, N])
    and then act(gate + b_gate) * (up + b_up) stored."""
    if not GATED:
        store_split_tile(acc, out_ptr, bias_ptr, part_ptr, arrivals_ptr, tile, split, rows, cols, row_mask, col_mask,
                         M, N, stride_om, HAS_BIAS, SPLIT_K)
    else:
        mask = row_mask[:, None] & col_mask[None, :]
        offsets = rows[:, None] * N + cols[None, :]
        pair, last = sum_split_tile(tl.join(acc, up), part_ptr, arrivals_ptr, tile, split,
                                    tl.join(offsets, offsets + M * N), tl.join(mask, mask), 2 * M * N, SPLIT_K)
        if last:
            gate, up_sum = tl.split(pair)
            if HAS_BIAS:
                gate += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
                up_sum += tl.load(bias_ptr + N + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            y = act_and_mul(gate, up_sum, GELU_TANH)
            tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_split_tile(acc, out_ptr, bias_ptr, part_ptr, arrivals_ptr, tile, split, rows, cols, row_mask, col_mask,
                     M, N, stride_om, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
    """Store split `split` of an output tile's float32 sum; the last split of the tile to arrive adds all the
    partial sums in split order and stores the tile (+ bias) in the output's dtype."""
    mask = row_mask[:, None] & col_mask[None, :]
    acc, last = sum_split_tile(acc, part_ptr, arrivals_ptr, tile, split, rows[:, None] * N + cols[None, :], mask,
                               M * N, SPLIT_K)
    if last:
        _store_tile(out_ptr, bias_ptr, acc, rows, cols, mask, col_mask, stride_om, HAS_BIAS)


@triton.jit
def sum_split_tile(acc, part_ptr, arrivals_ptr, tile, split, offsets, mask, part_size, SPLIT_K: tl.constexpr):
    """(the tile's sum over its SPLIT_K parts, whether this program holds it): each part stores its acc at
    part_ptr + split * part_size + offsets, and the last of the tile's parts to arrive reads them all back."""
    last = True
    if SPLIT_K > 1:
        tl.store(part_ptr + split * part_size + offsets, acc, mask=mask)
        last = is_last_arrival(arrivals_ptr + tile, SPLIT_K)
        if last:
            acc = tl.zeros(acc.shape, dtype=tl.float32)
            for part in range(SPLIT_K):
                acc += tl.load(part_ptr + part * part_size + offsets, mask=mask, other=0.0, cache_modifier=".cg")
    return acc, last


@triton.jit
def _store_tile(out_ptr, bias_ptr, acc, rows, cols, mask, col_mask, stride_om, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def split_k_outputs(x: torch.Tensor, n: int, tiles: int, split_k: int, parts_per_output: int = 1
                    ) -> tuple[torch.Tensor, ...]:
    """The output [M, n] in x's dtype and, with K split, the float32 parts (parts_per_output of each output's
    per split: 2 for a gated tile's gate and up) and the tiles' arrival counters that store_split_tile reads
    (without a split, the output stands in for both)."""
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    part = arrivals = out
    if split_k > 1:
        part = torch.empty((split_k, parts_per_output, x.shape[0], n), dtype=torch.float32, device=x.device)
        arrivals = arrival_counters(tiles, x.device)
    return out, part, arrivals


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: tuple,
           activation: str | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) with config = (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps,
    num_stages, descriptors); K must be a multiple of SPLIT_K * BLOCK_K, and with descriptors the operands must
    meet descriptors_fit. With activation ("silu" or "gelu_tanh"), weight [2I, K] holds gate rows then up rows
    and the result is act(x W_gate^T + b_gate) * (x W_up^T + b_up) [M, I], BLOCK_N of its columns per tile."""
    block_m, block_n, block_k, split_k, num_warps, num_stages, descriptors = config
    (m, k), n = x.shape, weight.shape[0] // (2 if activation else 1)
    if k % (split_k * block_k) or x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError(f"triton linear: K={k} must be a multiple of {split_k} x {block_k}, with x's rows and the "
                         "weight contiguous")
    if descriptors and not descriptors_fit(x, weight):
        raise ValueError("triton linear: tensor descriptors need 16-byte aligned operands and row strides")
    if activation is not None:
        _check_activation(activation)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    out, part, arrivals = split_k_outputs(x, n, tiles, split_k, 2 if activation else 1)
    common = dict(HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
                  DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", GATED=activation is not None,
                  GELU_TANH=activation == "gelu_tanh", num_warps=num_warps, **launch_options(x))
    bias = bias if bias is not None else out
    if descriptors:
        x_desc = TensorDescriptor.from_tensor(x, [block_m, block_k])
        w_desc = TensorDescriptor.from_tensor(weight, [block_n, block_k])
        _descriptor_linear_kernel[(tiles * split_k,)](x_desc, w_desc, bias, out, part, arrivals, m, n, k,
                                                      out.stride(0), STAGES=num_stages, **common)
    else:
        _linear_kernel[(tiles * split_k,)](x, weight, bias, out, part, arrivals, m, n, k, x.stride(0), out.stride(0),
                                           EARLY_RELEASE=m <= EARLY_RELEASE_ROWS, num_stages=num_stages, **common)
    return out


def descriptors_fit(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether both operands can be read through tensor descriptors: 16-byte aligned starts and row strides."""
    return all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in (x, weight))


def choose_config(m: int, n: int, k: int, sms: int, shared_memory: int, l2_bytes: int,
                  element_size: int = 2, descriptors: bool = True) -> tuple | None:
    """The kernel's config for an [m, k] x [n, k]^T product, or None for cuBLAS (no rows, m > MAX_ROWS, K not a
    multiple of TILE_K, rows of several tiles over a weight larger than the l2_bytes of L2, which each row
    tile would read from memory again, or more than POINTER_ROWS rows without descriptors). Up to POINTER_ROWS
    rows: tiles of 16 rows up to 16 rows, else 64; 16
    columns for outputs of up to NARROW_N (with 2 warps on 16-row tiles, and NARROW_STAGES where a program's
    shared_memory bytes hold their tiles of element_size), else 32; K split in two or four while the programs
    still fit in one wave, or in 16-row tiles while a program's part is longer than MAX_PROGRAM_K. Above,
    _descriptor_config. Chosen by timing the Qwen3-0.6B projections back to back in CUDA graphs, then end to end
    (bench/RESULTS.md)."""
    if not 0 < m <= MAX_ROWS or k % TILE_K:
        return None
    block_m = 16 if m <= 16 else 64
    if m > block_m and n * k * element_size > l2_bytes:
        return None
    if m > POINTER_ROWS:
        return _descriptor_config(m, n, k, sms, shared_memory, element_size) if descriptors else None
    block_n = 16 if n <= NARROW_N else 32
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split_k = _split_k(tiles, k, sms, MAX_PROGRAM_K if block_m == 16 else None)
    num_warps = 2 if block_m == block_n == 16 else 4
    deep = block_n == 16 and (block_m + block_n) * TILE_K * element_size * NARROW_STAGES <= shared_memory
    return block_m, block_n, TILE_K, split_k, num_warps, NARROW_STAGES if deep else STAGES, False


def _descriptor_config(m: int, n: int, k: int, sms: int, shared_memory: int, element_size: int) -> tuple:
    """Row tiles of 64 and the widest column tiles (128, 64 or 32) that still make half as many tiles as SMs;
    K split while the programs fit in one wave. Where they take more than one wave, tiles of K 64 so that all of
    them are resident at once; stages, up to 6, as many as the programs an SM holds leave room for."""
    row_tiles = triton.cdiv(m, 64)
    block_n = 128
    while block_n > 32 and row_tiles * triton.cdiv(n, block_n) < sms // 2:
        block_n //= 2
    tiles = row_tiles * triton.cdiv(n, block_n)
    split_k = _split_k(tiles, k, sms)
    per_sm = triton.cdiv(tiles * split_k, sms)
    block_k = TILE_K if per_sm == 1 else TILE_K // 2
    stages = min(6, shared_memory // (per_sm * (64 + block_n) * block_k * element_size))
    return 64, block_n, block_k, split_k, 4, stages, True


def _split_k(tiles: int, k: int, sms: int, max_program_k: int | None = None) -> int:
    """Parts of K (up to MAX_SPLIT_K, each a multiple of TILE_K) while tiles x parts still fit in one wave, or
    while a part is longer than max_program_k: a one-row program's loop over a long K is a chain of loads that
    more programs, each with a shorter run, overlap."""
    split_k = 1
    while split_k < MAX_SPLIT_K and k % (2 * split_k * TILE_K) == 0 and (
            2 * split_k * tiles <= sms or (max_program_k is not None and k // split_k > max_program_k)):
        split_k *= 2
    return split_k


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
    config = _decode_config(x, weight)
    return F.linear(x, weight, bias) if config is None else linear(x, weight, bias, config)


def gated_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    """act(x W_gate^T + b_gate) * (x W_up^T + b_up) for weight [2I, K] (gate rows, then up rows) and activation
    "silu" or "gelu_tanh": in one launch where choose_config picks this kernel for the [2I, K] product (each
    program then takes half its tile's columns from the gate and half from the up rows), else F.linear and the
    activation kernel."""
    config = _decode_config(x, weight)
    if config is None:
        _check_activation(activation)
        return gated_activation(F.linear(x, weight, bias), activation == "gelu_tanh")
    return linear(x, weight, bias, (config[0], max(16, config[1] // 2), *config[2:]), activation)


def _check_activation(activation: str) -> None:
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(f"triton linear: activation {activation!r} is not one of {', '.join(GATED_ACTIVATIONS)}")


def _decode_config(x: torch.Tensor, weight: torch.Tensor) -> tuple | None:
    """choose_config's pick for a 2-D x with contiguous rows on this device, where its operands suit it, with
    descriptors where the device has them (kernels/gpu_features.py)."""
    if x.dim() != 2 or x.stride(1) != 1 or not weight.is_contiguous():
        return None
    config = choose_config(x.shape[0], weight.shape[0], x.shape[1], num_sms(x.device), *memory_sizes(x.device),
                           x.element_size(), gpu_features.has("descriptors", x))
    return None if config is None or (config[6] and not descriptors_fit(x, weight)) else config
