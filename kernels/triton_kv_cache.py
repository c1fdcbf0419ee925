"""Triton kernel writing this step's keys and values into the paged KV cache."""
import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    HEAD_DIM: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < NUM_KV_HEADS * HEAD_DIM
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + dim, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + dim, mask=mask)
    cache_offs = slot * (NUM_KV_HEADS * HEAD_DIM) + offs
    tl.store(k_cache_ptr + cache_offs, k, mask=mask)
    tl.store(v_cache_ptr + cache_offs, v, mask=mask)


def store_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Write k, v [T, n_kv, D] into the caches [num_blocks, block_size, n_kv, D] at slot_mapping [T].

    Slots of -1 are skipped (padding tokens). k and v may be strided views (e.g. slices of a fused qkv
    projection) as long as the last dimension is contiguous; the caches must be contiguous.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("store_kv_cache needs k and v contiguous in head_dim; call .contiguous() first")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kv_cache needs contiguous k_cache and v_cache")
    if k_cache.shape[2:] != (num_kv_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache shape {tuple(k_cache.shape)} does not fit k of shape {tuple(k.shape)}")
    if num_tokens == 0:
        return
    block = triton.next_power_of_2(num_kv_heads * head_dim)
    _store_kv_cache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        HEAD_DIM=head_dim, NUM_KV_HEADS=num_kv_heads, BLOCK=block,
        num_warps=4 if block <= 2048 else 8,
    )
