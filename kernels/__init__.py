"""The kernels the models call, each dispatched by device: torch reference on CPU; on CUDA flash-attn
for attention when it is installed (and the block size suits it), else our Triton kernels.

The backend for a device type is chosen once and cached; Triton and flash-attn are imported only when a
CUDA tensor first arrives, so the CPU path never imports them. Calls read `tensor.is_cuda` rather than
`tensor.device.type` (which builds a device object per call): every launch on the eager prefill path pays it.
"""

import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.attention_metadata import AttentionMetadata
from kernels.reference import GREEDY_TEMPERATURE

BACKEND_FUNCTIONS = (  # each device type's backend has one of each (kernels/reference.py on the CPU)
    "linear",
    "paged_attention",
    "varlen_attention",
    "rms_norm",
    "add_rms_norm",
    "silu_and_mul",
    "qkv_prologue",
    "gumbel_argmax",
)
__all__ = ["AttentionMetadata", "GREEDY_TEMPERATURE", *BACKEND_FUNCTIONS, "qkv_paged_attention"]

FLASH_ATTN_BLOCK_MULTIPLE = 256  # flash-attn 2 reads a paged KV cache only in blocks of a multiple of 256 tokens


@functools.cache
def _backend(device_type: str) -> SimpleNamespace:
    if device_type != "cuda":
        from kernels import reference

        return SimpleNamespace(**{name: getattr(reference, name) for name in BACKEND_FUNCTIONS}, fused_decode=None)
    from kernels import (
        triton_activation,
        triton_attention,
        triton_linear,
        triton_norm,
        triton_prologue,
        triton_sampling,
    )

    backend = SimpleNamespace(
        linear=triton_linear.decode_linear,
        paged_attention=triton_attention.paged_attention,
        varlen_attention=triton_attention.varlen_attention,
        rms_norm=triton_norm.rms_norm,
        add_rms_norm=triton_norm.add_rms_norm,
        silu_and_mul=triton_activation.silu_and_mul,
        qkv_prologue=triton_prologue.qkv_prologue,
        gumbel_argmax=triton_sampling.gumbel_argmax,
        fused_decode=triton_attention.qkv_decode_attention,
    )
    try:
        import flash_attn
    except ImportError:
        return backend
    return _with_flash_attn(backend, flash_attn)


def _backend_of(tensor: Tensor) -> SimpleNamespace:
    return _backend("cuda" if tensor.is_cuda else "cpu")


def _with_flash_attn(backend: SimpleNamespace, flash_attn) -> SimpleNamespace:
    triton_paged_attention = backend.paged_attention

    def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
        if k_cache.shape[1] % FLASH_ATTN_BLOCK_MULTIPLE:
            return triton_paged_attention(q, k_cache, v_cache, meta, scale)
        if meta.is_decode:
            out = flash_attn.flash_attn_with_kvcache(
                q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seq_lens,
                block_table=meta.block_tables, softmax_scale=scale, causal=True,
            )
            return out.squeeze(1)
        cu_seqlens_k = F.pad(meta.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return flash_attn.flash_attn_varlen_func(
            q, k_cache, v_cache, meta.cu_seqlens_q, cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
            softmax_scale=scale, causal=True, block_table=meta.block_tables,
        )

    def varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale, causal):
        return flash_attn.flash_attn_varlen_func(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale=scale, causal=causal
        )

    return SimpleNamespace(**{**vars(backend), "paged_attention": paged_attention,
                              "varlen_attention": varlen_attention, "fused_decode": None})


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x W^T (+ bias): on CUDA our split-K Triton GEMM at decode sizes, cuBLAS above them."""
    return _backend_of(x).linear(x, weight, bias)


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
    return _backend_of(q).paged_attention(q, k_cache, v_cache, meta, scale)


def varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float, causal: bool
) -> Tensor:
    return _backend_of(q).varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale, causal)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _backend_of(x).rms_norm(x, weight, eps)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return _backend_of(x).add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: Tensor) -> Tensor:
    return _backend_of(x).silu_and_mul(x)


def qkv_prologue(
    qkv: Tensor, positions: Tensor, cos_sin_cache: Tensor, num_heads: int, num_kv_heads: int,
    q_norm_weight: Tensor | None = None, k_norm_weight: Tensor | None = None, eps: float = 1e-6,
    k_cache: Tensor | None = None, v_cache: Tensor | None = None, slot_mapping: Tensor | None = None,
    return_kv: bool = True,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Everything between the qkv projection and attention, in one launch on CUDA.

    qkv [T, (n_q + 2 n_kv) D] -> q [T, n_q, D]: per-head RMSNorm of q and k when their weights are given
    (Qwen3), then NeoX rotary. With k_cache, v_cache and slot_mapping, k and v go straight into the paged
    cache (slot -1: skipped). return_kv=True also returns k [T, n_kv, D] and v (a view of qkv) for attention
    without a cache; else (q, None, None).
    """
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("qkv_prologue needs both q_norm_weight and k_norm_weight, or neither")
    return _backend_of(qkv).qkv_prologue(
        qkv, positions, cos_sin_cache, num_heads, num_kv_heads, q_norm_weight, k_norm_weight, eps,
        k_cache, v_cache, slot_mapping, return_kv,
    )


def qkv_paged_attention(
    qkv: Tensor, positions: Tensor, cos_sin_cache: Tensor, num_heads: int, num_kv_heads: int,
    q_norm_weight: Tensor | None, k_norm_weight: Tensor | None, eps: float, k_cache: Tensor, v_cache: Tensor,
    meta: AttentionMetadata, scale: float,
) -> Tensor:
    """qkv_prologue, storing the step's keys and values in the paged cache, then paged_attention: q [T, n_q, D]
    attended. A decode step on CUDA without flash-attn runs both in the decode attention kernel (one launch
    less per layer; Triton's qkv_decode_attention)."""
    backend = _backend_of(qkv)
    if meta.is_decode and backend.fused_decode is not None:
        return backend.fused_decode(qkv, cos_sin_cache, num_heads, num_kv_heads, q_norm_weight, k_norm_weight, eps,
                                    k_cache, v_cache, meta, scale)
    q, _, _ = qkv_prologue(qkv, positions, cos_sin_cache, num_heads, num_kv_heads, q_norm_weight, k_norm_weight,
                           eps, k_cache, v_cache, meta.slot_mapping, return_kv=False)
    return backend.paged_attention(q, k_cache, v_cache, meta, scale)


def gumbel_argmax(logits: Tensor, temperature: Tensor, seeds: Tensor) -> Tensor:
    """One token per row of logits [N, V]: argmax(logits / temperature + Gumbel noise), a draw from
    softmax(logits / temperature); argmax(logits) where temperature is below GREEDY_TEMPERATURE. The noise of a row is a function
    of its int64 seed alone (Philox on CUDA, a seeded torch generator on CPU)."""
    return _backend_of(logits).gumbel_argmax(logits, temperature, seeds)
