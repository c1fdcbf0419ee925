"""The kernels the models call, each dispatched by device: torch reference on CPU; on CUDA flash-attn
for attention when it is installed (and the block size suits it), else our Triton kernels.

The backend for a device type is chosen once and cached; Triton and flash-attn are imported only when a
CUDA tensor first arrives, so the CPU path never imports them.
"""

import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.attention_metadata import AttentionMetadata

__all__ = [
    "AttentionMetadata",
    "store_kv_cache",
    "paged_attention",
    "varlen_attention",
    "rms_norm",
    "add_rms_norm",
    "apply_rotary",
    "silu_and_mul",
]

FLASH_ATTN_BLOCK_MULTIPLE = 256  # flash-attn 2 reads a paged KV cache only in blocks of a multiple of 256 tokens


@functools.cache
def _backend(device_type: str) -> SimpleNamespace:
    if device_type != "cuda":
        from kernels import reference

        return SimpleNamespace(**{name: getattr(reference, name) for name in __all__[1:]})
    from kernels import triton_activation, triton_attention, triton_kv_cache, triton_norm, triton_rotary

    backend = SimpleNamespace(
        store_kv_cache=triton_kv_cache.store_kv_cache,
        paged_attention=triton_attention.paged_attention,
        varlen_attention=triton_attention.varlen_attention,
        rms_norm=triton_norm.rms_norm,
        add_rms_norm=triton_norm.add_rms_norm,
        apply_rotary=triton_rotary.apply_rotary,
        silu_and_mul=triton_activation.silu_and_mul,
    )
    try:
        import flash_attn
    except ImportError:
        return backend
    return _with_flash_attn(backend, flash_attn)


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

    return SimpleNamespace(
        **{**vars(backend), "paged_attention": paged_attention, "varlen_attention": varlen_attention}
    )


def store_kv_cache(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    _backend(k.device.type).store_kv_cache(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
    return _backend(q.device.type).paged_attention(q, k_cache, v_cache, meta, scale)


def varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float, causal: bool
) -> Tensor:
    return _backend(q.device.type).varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale, causal)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _backend(x.device.type).rms_norm(x, weight, eps)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return _backend(x.device.type).add_rms_norm(x, residual, weight, eps)


def apply_rotary(q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor) -> tuple[Tensor, Tensor]:
    return _backend(q.device.type).apply_rotary(q, k, positions, cos_sin_cache)


def silu_and_mul(x: Tensor) -> Tensor:
    return _backend(x.device.type).silu_and_mul(x)
