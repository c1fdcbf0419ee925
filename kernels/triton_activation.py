"""Triton gated activations for MLPs: act(gate) * up, with SiLU (Llama, Qwen, Phi-3) or tanh-approximated
GELU (Gemma)."""
import torch
import triton
import triton.language as tl

from kernels.dependent_launch import launch_options, release_next, wait_for_previous

SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # a jit function reads only constexpr globals


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr,
                        GELU_TANH: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous(USE_PDL)
    release_next(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    y = act_and_mul(gate, up, GELU_TANH)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def act_and_mul(gate, up, GELU_TANH: tl.constexpr):
    """act(gate) * up for float32 tensors: SiLU, or GELU's tanh approximation."""
    if GELU_TANH:
        inner = SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        tanh = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)  # saturates to +-1 where exp overflows or vanishes
        y = 0.5 * gate * (1.0 + tanh) * up
    else:
        y = gate / (1.0 + tl.exp(-gate)) * up
    return y


def gated_activation(x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    """x [..., 2I] -> act(x[..., :I]) * x[..., I:], computed in float32: SiLU, or with gelu_tanh GELU's tanh
    approximation."""
    if x.shape[-1] % 2:
        raise ValueError(f"a gated activation needs an even last dimension, got {x.shape[-1]}")
    inter = x.shape[-1] // 2
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(inter), 1024)
    if x2.shape[0]:
        _act_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out, x2.stride(0), out.stride(0), INTER=inter, BLOCK=block, GELU_TANH=gelu_tanh, num_warps=4,
            **launch_options(x2))
    return out if x.dim() == 2 else out.view(*x.shape[:-1], inter)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] -> silu(x[..., :I]) * x[..., I:], computed in float32."""
    return gated_activation(x, gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] -> gelu(x[..., :I], tanh approximation) * x[..., I:], computed in float32."""
    return gated_activation(x, gelu_tanh=True)
