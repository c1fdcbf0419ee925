"""FP8 projections on Hopper: y = x W^T (+ b) with an e4m3 weight and float32 weight scales, two ways.

- `triton`: our block-scaled GEMM. Each program takes K in tiles of 128 columns; it quantizes its rows of x
  to e4m3 tile by tile as it loads them (one scale per row and tile: the largest magnitude maps to 448), so
  activations never go through memory in FP8 and no launch quantizes them first. Each tile's FP8 product is
  scaled by the row's activation scale and the columns' weight scales and added in float32. Weight scales
  are read per (block of rows, block of columns) as models/fp8.py leaves them: 128 x 128 blocks, per-row
  blocks, or one column for per-channel scales. Up to MAX_DECODE_ROWS rows the output tiles are small and K
  is split across programs as kernels/triton_linear.py does (its store_split_tile finishes a tile).
- `scaled_mm`: x quantized per row by a small Triton kernel, then torch._scaled_mm (cuBLASLt) with one scale
  per token and one per weight row.

bench/fp8_gemm.py compares both with bf16 at decode and prefill sizes; models/fp8.py picks one by its
`method` (EngineConfig.fp8_gemm).
"""
import torch
import triton
import triton.language as tl

from kernels.dependent_launch import launch_options, release_next, wait_for_previous
from kernels.split_arrivals import num_sms
from kernels.triton_linear import memory_sizes, split_k_outputs, store_split_tile

FP8_MAX = 448.0
GROUP_K = 128  # columns of x per activation scale, and the K tile
_FP8_MAX, _GROUP_K = tl.constexpr(FP8_MAX), tl.constexpr(GROUP_K)  # the same, as jit functions may read them
MAX_DECODE_ROWS = 128
PREFILL_STAGE_BYTES = 128 * GROUP_K * 3  # a 128 x 128 tile's stage: 16-bit x rows and e4m3 weight rows
MAX_SPLIT_K = 4


@triton.jit
def _fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, part_ptr, arrivals_ptr, M, N, K, stride_xm, stride_om,
                     stride_sn, scale_cols, k_tiles_per_split, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, SCALE_ROWS: tl.constexpr, SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    split = pid % SPLIT_K
    tile = pid // SPLIT_K
    num_col_tiles = tl.cdiv(N, BLOCK_N)
    rows = (tile // num_col_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (tile % num_col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    ks = tl.arange(0, _GROUP_K)
    k_begin = split * k_tiles_per_split * _GROUP_K
    k_end = tl.minimum(K, k_begin + k_tiles_per_split * _GROUP_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :]
    scale_ptrs = s_ptr + (cols // SCALE_ROWS).to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    wait_for_previous(USE_PDL)
    for k0 in range(k_begin, k_end, _GROUP_K):
        k_mask = (k0 + ks) < K
        x = tl.load(x_ptrs + k0, mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        x_scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / _FP8_MAX
        x_fp8 = tl.math.div_rn(x, x_scale[:, None]).to(tl.float8e4nv)  # IEEE division, as torch divides
        w = tl.load(w_ptrs + k0, mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        w_scale = tl.load(scale_ptrs + k0 // scale_cols, mask=col_mask, other=0.0)
        acc += tl.dot(x_fp8, tl.trans(w)) * x_scale[:, None] * w_scale[None, :]
    release_next(USE_PDL)
    store_split_tile(acc, out_ptr, bias_ptr, part_ptr, arrivals_ptr, tile, split, rows, cols, row_mask, col_mask,
                     M, N, stride_om, HAS_BIAS, SPLIT_K)


@triton.jit
def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, K, stride_xm, stride_om, BLOCK: tl.constexpr,
                          USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    wait_for_previous(USE_PDL)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / _FP8_MAX
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_om + k0 + offs, tl.math.div_rn(x, scale).to(tl.float8e4nv), mask=k0 + offs < K)
    release_next(USE_PDL)
    tl.store(scale_ptr + row, scale)


def choose_config(m: int, n: int, k: int, sms: int, shared_memory: int = 1 << 30) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, SPLIT_K, num_warps, num_stages) for an [m, k] x [n, k]^T product: at decode sizes
    small tiles with K split while the programs fit in one wave (as kernels/triton_linear.py), else 128 x 128
    tiles, in as many stages (up to 3) as a program's shared_memory bytes hold: an L4's or L40S's hold 2."""
    if m > MAX_DECODE_ROWS:
        return 128, 128, 1, 8, 3 if shared_memory >= 3 * PREFILL_STAGE_BYTES else 2
    block_m, block_n = (16 if m <= 16 else 64), 32
    tiles, k_tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n), triton.cdiv(k, GROUP_K)
    split_k = 1
    while split_k < MAX_SPLIT_K and 2 * split_k * tiles <= sms and k_tiles % (2 * split_k) == 0:
        split_k *= 2
    return block_m, block_n, split_k, 4, 4


def triton_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int],
                      bias: torch.Tensor | None = None, config: tuple | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias) with weight_scale [ceil(N / rows), ceil(K / cols)] for block =
    (rows, cols); cols a multiple of 128, or K or more. config: choose_config's tuple (by default its choice)."""
    (m, k), n = x.shape, weight.shape[0]
    rows, cols = block
    if x.stride(1) != 1 or not weight.is_contiguous() or weight_scale.stride(1) != 1:
        raise ValueError("triton_fp8_linear needs x's rows, the weight and the scale rows contiguous")
    if cols % GROUP_K and cols < k:
        raise ValueError(f"triton_fp8_linear: weight scale blocks of {cols} columns do not hold whole {GROUP_K}-"
                         "column tiles")
    block_m, block_n, split_k, num_warps, num_stages = config or choose_config(m, n, k, num_sms(x.device),
                                                                               memory_sizes(x.device)[0])
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    out, part, arrivals = split_k_outputs(x, n, tiles, split_k)
    if m == 0:
        return out
    _fp8_gemm_kernel[(tiles * split_k,)](
        x, weight, weight_scale, bias if bias is not None else out, out, part, arrivals, m, n, k, x.stride(0),
        out.stride(0), weight_scale.stride(0), min(cols, k), triton.cdiv(triton.cdiv(k, GROUP_K), split_k),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, SCALE_ROWS=rows, SPLIT_K=split_k,
        num_warps=num_warps, num_stages=num_stages, **launch_options(x),
    )
    return out


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as e4m3 with one float32 scale per row: (values [M, K], scales [M, 1])."""
    m, k = x.shape
    values = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_kernel[(m,)](x, values, scales, k, x.stride(0), values.stride(0),
                                    BLOCK=min(triton.next_power_of_2(k), 1024), num_warps=4, **launch_options(x))
    return values, scales


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, row_scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias) through torch._scaled_mm: x quantized per row, row_scale [N, 1]. The
    bias is added apart (not every torch build takes one with row-wise scales)."""
    values, scales = quantize_rows(x)
    out = torch._scaled_mm(values, weight.t(), scale_a=scales, scale_b=row_scale.view(1, -1), out_dtype=x.dtype)
    return out if bias is None else out.add_(bias)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None = None, method: str = "triton") -> torch.Tensor:
    """See kernels.fp8_linear."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if method == "scaled_mm":
        out = scaled_mm_linear(x2, weight, weight_scale, bias)
    else:
        out = triton_fp8_linear(x2, weight, weight_scale, block, bias)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], -1)
