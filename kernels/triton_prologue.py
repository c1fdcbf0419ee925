"""Triton attention prologue: from the fused qkv projection, per-head q/k RMSNorm (Qwen3), NeoX rotary, and
the KV-cache store (quantized into an FP8 cache: kernels/triton_fp8.py), in one launch.

Separately these are five launches and two copies (the norms need the strided q/k slices contiguous); on a
prefill, where the host issues every launch, that overhead dominates the layer's GPU time.
"""
import torch
import triton
import triton.language as tl

from kernels.dependent_launch import launch_options, release_next, wait_for_previous
from kernels.triton_fp8 import cache_form


@triton.jit
def _normed_rotated_halves(src, heads, mask, norm_ptr, cos, sin, eps,
                           HAS_NORM: tl.constexpr, HALF: tl.constexpr):
    """Heads [HEADS_BLOCK, D] at src as their rotated halves, rounded to the input dtype after each step as
    the torch reference rounds (norm, then weight, then rotary)."""
    dims = tl.arange(0, HALF)[None, :]
    x1 = tl.load(src + heads * (2 * HALF) + dims, mask=mask, other=0.0)
    x2 = tl.load(src + heads * (2 * HALF) + HALF + dims, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if HAS_NORM:
        mean_square = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
        rstd = (1.0 / tl.sqrt(mean_square + eps))[:, None]
        w1 = tl.load(norm_ptr + dims).to(tl.float32)
        w2 = tl.load(norm_ptr + HALF + dims).to(tl.float32)
        x1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    return (x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype)


@triton.jit
def _store_v(row, slot_mapping_ptr, v_cache_ptr, v_scale_ptr, token, NUM_Q_HEADS: tl.constexpr,
             NUM_KV_HEADS: tl.constexpr, KV_HEADS_BLOCK: tl.constexpr, HALF: tl.constexpr, FP8: tl.constexpr):
    kv_size: tl.constexpr = NUM_KV_HEADS * 2 * HALF
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, KV_HEADS_BLOCK * 2 * HALF)
        mask = offs < kv_size
        v = tl.load(row + (NUM_Q_HEADS * 2 * HALF + kv_size) + offs, mask=mask)
        tl.store(v_cache_ptr + slot * kv_size + offs, cache_form(v, v_scale_ptr + offs // (2 * HALF), mask, FP8),
                 mask=mask)


@triton.jit
def _rotate_q(row, q_norm_ptr, q_out_ptr, token, cos, sin, eps, NUM_Q_HEADS: tl.constexpr,
              Q_HEADS_BLOCK: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    dims = tl.arange(0, HALF)[None, :]
    heads = tl.arange(0, Q_HEADS_BLOCK)[:, None]
    mask = heads < NUM_Q_HEADS
    y1, y2 = _normed_rotated_halves(row, heads, mask, q_norm_ptr, cos, sin, eps, HAS_NORM, HALF)
    dst = q_out_ptr + token * (NUM_Q_HEADS * 2 * HALF) + heads * (2 * HALF) + dims
    tl.store(dst, y1, mask=mask)
    tl.store(dst + HALF, y2, mask=mask)


@triton.jit
def _rotate_k(row, k_norm_ptr, k_out_ptr, k_cache_ptr, k_scale_ptr, slot_mapping_ptr, token, cos, sin, eps,
              NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, KV_HEADS_BLOCK: tl.constexpr,
              HALF: tl.constexpr, HAS_NORM: tl.constexpr, STORE: tl.constexpr, RETURN_K: tl.constexpr,
              FP8: tl.constexpr):
    kv_size: tl.constexpr = NUM_KV_HEADS * 2 * HALF
    dims = tl.arange(0, HALF)[None, :]
    heads = tl.arange(0, KV_HEADS_BLOCK)[:, None]
    mask = heads < NUM_KV_HEADS
    y1, y2 = _normed_rotated_halves(row + NUM_Q_HEADS * 2 * HALF, heads, mask, k_norm_ptr, cos, sin, eps,
                                    HAS_NORM, HALF)
    if RETURN_K:
        out = k_out_ptr + token * kv_size + heads * (2 * HALF) + dims
        tl.store(out, y1, mask=mask)
        tl.store(out + HALF, y2, mask=mask)
    if STORE:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            cached = k_cache_ptr + slot * kv_size + heads * (2 * HALF) + dims
            tl.store(cached, cache_form(y1, k_scale_ptr + heads, mask, FP8), mask=mask)
            tl.store(cached + HALF, cache_form(y2, k_scale_ptr + heads, mask, FP8), mask=mask)


@triton.jit
def _prologue_kernel(
    qkv_ptr, positions_ptr, cos_sin_ptr, q_norm_ptr, k_norm_ptr, slot_mapping_ptr,
    q_out_ptr, k_out_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, stride_qkv, stride_cs, eps,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, Q_HEADS_BLOCK: tl.constexpr,
    KV_HEADS_BLOCK: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr, STORE: tl.constexpr,
    RETURN_K: tl.constexpr, FP8: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program (token, part): part 0 rotates the token's q heads, 1 its k heads, 2 copies its v heads.
    Each part is a function of its own: compiled Triton refuses a runtime branch whose two sides bind one
    name to tensors of different shapes."""
    wait_for_previous(USE_PDL)
    release_next(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    row = qkv_ptr + token * stride_qkv
    if part == 2:
        _store_v(row, slot_mapping_ptr, v_cache_ptr, v_scale_ptr, token, NUM_Q_HEADS, NUM_KV_HEADS, KV_HEADS_BLOCK,
                 HALF, FP8)
    else:
        pos = tl.load(positions_ptr + token).to(tl.int64)
        dims = tl.arange(0, HALF)[None, :]
        cos = tl.load(cos_sin_ptr + pos * stride_cs + dims)
        sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + dims)
        if part == 0:
            _rotate_q(row, q_norm_ptr, q_out_ptr, token, cos, sin, eps, NUM_Q_HEADS, Q_HEADS_BLOCK, HALF, HAS_NORM)
        else:
            _rotate_k(row, k_norm_ptr, k_out_ptr, k_cache_ptr, k_scale_ptr, slot_mapping_ptr, token, cos, sin, eps,
                      NUM_Q_HEADS, NUM_KV_HEADS, KV_HEADS_BLOCK, HALF, HAS_NORM, STORE, RETURN_K, FP8)


def qkv_prologue(qkv, positions, cos_sin_cache, num_heads, num_kv_heads, q_norm_weight=None, k_norm_weight=None,
                 eps=1e-6, k_cache=None, v_cache=None, slot_mapping=None, return_kv=True, k_scale=None, v_scale=None):
    """See kernels.qkv_prologue. qkv [T, (n_q + 2 n_kv) D] must be contiguous in its last dimension; an FP8 cache
    (torch.float8_e4m3fn) needs k_scale and v_scale (float32 [n_kv])."""
    num_tokens, width = qkv.shape
    head_dim = width // (num_heads + 2 * num_kv_heads)
    half = head_dim // 2
    if cos_sin_cache.shape[-1] != head_dim:
        raise ValueError(f"cos_sin_cache width {cos_sin_cache.shape[-1]} != head_dim {head_dim}; "
                         "partial rotary is not supported by the Triton kernel")
    if head_dim & (head_dim - 1) or head_dim < 4:
        raise ValueError(f"the Triton prologue kernel needs a power-of-two head_dim, got {head_dim}")
    if qkv.stride(1) != 1 or cos_sin_cache.stride(1) != 1:
        raise ValueError("qkv_prologue needs qkv and cos_sin_cache contiguous in the last dimension")
    store = k_cache is not None and slot_mapping is not None
    if store and (v_cache is None or v_cache.shape != k_cache.shape
                  or k_cache.shape[2:] != (num_kv_heads, head_dim)):
        raise ValueError(f"qkv_prologue needs k_cache and v_cache of shape [blocks, block_size, {num_kv_heads}, "
                         f"{head_dim}], got {None if k_cache is None else tuple(k_cache.shape)} and "
                         f"{None if v_cache is None else tuple(v_cache.shape)}")
    if store and not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("qkv_prologue needs contiguous k_cache and v_cache")
    fp8 = store and k_cache.dtype == torch.float8_e4m3fn
    q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device) if return_kv else None
    if num_tokens:
        _prologue_kernel[(num_tokens, 3 if store else 2)](
            qkv, positions, cos_sin_cache,
            q_norm_weight if q_norm_weight is not None else qkv, k_norm_weight if k_norm_weight is not None else qkv,
            slot_mapping if store else positions, q, k if return_kv else q,
            k_cache if store else q, v_cache if store else q, k_scale if fp8 else q, v_scale if fp8 else q,
            qkv.stride(0), cos_sin_cache.stride(0), eps,
            NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, Q_HEADS_BLOCK=triton.next_power_of_2(num_heads),
            KV_HEADS_BLOCK=triton.next_power_of_2(num_kv_heads), HALF=half, HAS_NORM=q_norm_weight is not None,
            STORE=store, RETURN_K=return_kv, FP8=fp8, num_warps=4, **launch_options(qkv),
        )
    if not return_kv:
        return q, None, None
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    return q, k, v
