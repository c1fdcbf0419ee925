"""Triton RMSNorm, alone and fused with the residual add; one program per row, float32 accumulation."""
import functools

import torch
import triton
import triton.language as tl

from kernels.dependent_launch import launch_options, release_next, wait_for_previous


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr,
    stride_x, stride_r, stride_o, stride_nr, eps,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    w, r = norm_operands(residual_ptr, weight_ptr, row, offs, mask, stride_r, HAS_RESIDUAL)
    wait_for_previous(USE_PDL)
    release_next(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    norm_row(x, r, w, row, offs, mask, out_ptr, new_residual_ptr, stride_o, stride_nr, eps, HIDDEN, HAS_RESIDUAL)


@triton.jit
def norm_operands(residual_ptr, weight_ptr, row, offs, mask, stride_r, HAS_RESIDUAL: tl.constexpr):
    """(weight, residual row) of a norm, loaded before the kernel waits for the one before it: that kernel writes
    neither (it wrote x), and everything launched earlier has finished (kernels/dependent_launch.py), so these
    reads overlap its tail. Without a residual, the weight stands in for it."""
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    r = w
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
    return w, r


@triton.jit
def norm_row(x, r, w, row, offs, mask, out_ptr, new_residual_ptr, stride_o, stride_nr, eps, HIDDEN: tl.constexpr,
             HAS_RESIDUAL: tl.constexpr):
    """Stores row `row` of rms_norm(x) or, with a residual, of rms_norm(x + residual) and x + residual, x, the
    residual row r and the weight w being in registers."""
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(new_residual_ptr + row * stride_nr + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / HIDDEN + eps)
    y = (xf * rstd).to(x.dtype) * w
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def block_and_warps(hidden: int) -> tuple[int, int]:
    block = triton.next_power_of_2(hidden)
    return block, min(max(block // 256, 1), 16)


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    """t as [rows, hidden] with a contiguous last dimension; 2-D inputs (the model's case) as they are."""
    if t.dim() != 2:
        t = t.reshape(-1, hidden)
    return t if t.stride(-1) == 1 else t.contiguous()


def norm_tensors(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor):
    """(x, residual, out, new_residual) as the kernels' [rows, hidden] tensors; without a residual, x stands in for
    the two residual tensors (not read)."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"norm weight has shape {tuple(weight.shape)}, expected ({hidden},)")
    x2 = _rows(x, hidden)
    if residual is None:
        return x2, x2, torch.empty_like(x2), x2
    return x2, _rows(residual, hidden), torch.empty_like(x2), torch.empty_like(x2)


def _launch(x, residual, weight, eps):
    hidden = x.shape[-1]
    x2, r2, out, new_residual = norm_tensors(x, residual, weight)
    if x2.shape[0]:
        block, num_warps = block_and_warps(hidden)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, new_residual,
            x2.stride(0), r2.stride(0), out.stride(0), new_residual.stride(0), eps,
            HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=num_warps,
            **launch_options(x2),
        )
    if x.dim() == 2:
        return out, new_residual
    return out.view(x.shape), new_residual.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: (x / rms(x)) cast back to x's dtype, times weight."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual) in one pass over memory. The residual is read before the kernel waits
    for the one launched before it (norm_operands): it must come from earlier work, as a decoder's residual stream
    does, never from that kernel."""
    return _launch(x, residual, weight, eps)
