"""The attention prologue's rotary embedding and KV-cache store as separate Triton launches: what the fused
prologue (kernels/triton_prologue.py) replaced, kept as the baseline bench/fusion_speed.py times it against.
The engine does not use them."""
import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, token, stride_st, stride_sh, stride_dt, stride_dh, cos, sin,
                  NUM_HEADS: tl.constexpr, HEADS_BLOCK: tl.constexpr, HALF: tl.constexpr):
    heads = tl.arange(0, HEADS_BLOCK)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    mask = heads < NUM_HEADS
    src = src_ptr + token * stride_st + heads * stride_sh + dims
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = dst_ptr + token * stride_dt + heads * stride_dh + dims
    tl.store(dst, (x1 * cos - x2 * sin).to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, positions_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    Q_HEADS_BLOCK: tl.constexpr, KV_HEADS_BLOCK: tl.constexpr, HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_sin_ptr + pos * stride_cs + dims)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + dims)
    _rotate_heads(q_ptr, q_out_ptr, token, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin,
                  NUM_Q_HEADS, Q_HEADS_BLOCK, HALF)
    _rotate_heads(k_ptr, k_out_ptr, token, stride_kt, stride_kh, stride_kot, stride_koh, cos, sin,
                  NUM_KV_HEADS, KV_HEADS_BLOCK, HALF)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor):
    """Rotate q [T, n_q, D] and k [T, n_kv, D] by their positions; returns new contiguous (q, k).

    cos_sin_cache [max_pos, D] float32 holds cat(cos, sin), each D/2 wide (rotary over the whole head).
    q and k may be strided views (slices of a fused qkv projection) with a contiguous last dimension.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if cos_sin_cache.shape[-1] != head_dim:
        raise ValueError(f"cos_sin_cache width {cos_sin_cache.shape[-1]} != head_dim {head_dim}; "
                         "partial rotary is not supported by the Triton kernel")
    if head_dim & (head_dim - 1) or head_dim < 4:
        raise ValueError(f"the Triton rotary kernel needs a power-of-two head_dim, got {head_dim}")
    if q.stride(2) != 1 or k.stride(2) != 1 or cos_sin_cache.stride(1) != 1:
        raise ValueError("apply_rotary needs q, k and cos_sin_cache contiguous in the last dimension")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            q, k, q_out, k_out, positions, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin_cache.stride(0),
            NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads,
            Q_HEADS_BLOCK=triton.next_power_of_2(num_q_heads),
            KV_HEADS_BLOCK=triton.next_power_of_2(num_kv_heads), HALF=head_dim // 2,
            num_warps=4,
        )
    return q_out, k_out


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
