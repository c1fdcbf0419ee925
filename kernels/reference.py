"""Torch implementations of the kernels: the CPU path, and the ground truth the Triton kernels are tested against.

Attention and norms compute in float32 and cast back to the input dtype.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.attention_metadata import AttentionMetadata

# A temperature below this draws greedily (vLLM's _SAMPLING_EPS): dividing float32 logits by it would overflow
# them to infinities (1e-40 is a float32 subnormal), and a softmax of infinities is NaN, not the argmax.
GREEDY_TEMPERATURE = 1e-5


def store_kv_cache(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write k, v [T, n_kv, D] into the caches [num_blocks, block_size, n_kv, D] at their slots (-1: skip)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]


def _attend(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool = True, mask: Tensor | None = None) -> Tensor:
    """Attention over [B, L, heads, D] tensors, GQA by head groups; causal aligns the last query with the last key."""
    dtype = q.dtype
    q, k, v = (t.float().transpose(1, 2) for t in (q, k, v))
    if mask is None and causal and q.shape[2] != k.shape[2]:
        q_pos = torch.arange(k.shape[2] - q.shape[2], k.shape[2], device=q.device)
        mask = q_pos[:, None] >= torch.arange(k.shape[2], device=q.device)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2).to(dtype)


def _gather_context(cache: Tensor, block_table: Tensor, length: int) -> Tensor:
    """The first `length` cached tokens of each sequence: block_table [..., n] -> [..., length, n_kv, D]."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    blocks = cache[block_table[..., :num_blocks].clamp(min=0)]
    return blocks.flatten(-4, -3)[..., :length, :, :]


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
    """Causal attention of the step's queries [T, n_q, D] over each sequence's cached keys and values.

    Decode tokens (one query per sequence) are batched together, padding keys to the longest context;
    prefill chunks run one sequence at a time so no [T, T] score matrix spans unrelated sequences.
    """
    out = torch.empty_like(q)
    starts = meta.cu_seqlens_q[:-1].tolist()
    q_lens = meta.cu_seqlens_q.diff().tolist()
    seq_lens = meta.seq_lens.tolist()
    decodes = [b for b, n in enumerate(q_lens) if n == 1]
    if decodes:
        rows = torch.tensor(decodes, device=q.device)
        tokens = meta.cu_seqlens_q[rows].long()
        max_len = max(seq_lens[b] for b in decodes)
        tables = meta.block_tables[rows]
        k = _gather_context(k_cache, tables, max_len)
        v = _gather_context(v_cache, tables, max_len)
        mask = torch.arange(max_len, device=q.device) < meta.seq_lens[rows, None]
        out[tokens] = _attend(q[tokens, None], k, v, scale, mask=mask[:, None, None, :]).squeeze(1)
    for b, (start, n, length) in enumerate(zip(starts, q_lens, seq_lens)):
        if n > 1:
            k = _gather_context(k_cache, meta.block_tables[b], length)
            v = _gather_context(v_cache, meta.block_tables[b], length)
            out[start : start + n] = _attend(q[None, start : start + n], k[None], v[None], scale)[0]
    return out


def varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float, causal: bool
) -> Tensor:
    """Attention within each sequence of a packed batch: q [T, n_q, D], k/v [T, n_kv, D], no cache."""
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            out[start:end] = _attend(q[None, start:end], k[None, start:end], v[None, start:end], scale, causal)[0]
    return out


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return F.linear(x, weight, bias)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [T, H] scaled to unit root-mean-square (in float32), cast back, times weight (as transformers does)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The residual add fused with the next norm: returns (rms_norm(x + residual), x + residual)."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def apply_rotary(q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor) -> tuple[Tensor, Tensor]:
    """Rotary position embedding, NeoX (rotate-half) style; cos_sin_cache [max_pos, D] = cat(cos, sin)."""
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)

    def rotate(x: Tensor) -> Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def silu_and_mul(x: Tensor) -> Tensor:
    """x [T, 2I] -> silu(x[:, :I]) * x[:, I:]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def qkv_prologue(
    qkv: Tensor, positions: Tensor, cos_sin_cache: Tensor, num_heads: int, num_kv_heads: int,
    q_norm_weight: Tensor | None = None, k_norm_weight: Tensor | None = None, eps: float = 1e-6,
    k_cache: Tensor | None = None, v_cache: Tensor | None = None, slot_mapping: Tensor | None = None,
    return_kv: bool = True,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The attention prologue as its separate steps: split qkv, per-head RMSNorm of q and k (when weights are
    given), rotary, and the KV-cache store (when a cache and slot_mapping are given)."""
    num_tokens = qkv.shape[0]
    head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    if q_norm_weight is not None:
        q, k = rms_norm(q, q_norm_weight, eps), rms_norm(k, k_norm_weight, eps)
    q, k = apply_rotary(q, k, positions, cos_sin_cache)
    if k_cache is not None and slot_mapping is not None:
        store_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    return (q, k, v) if return_kv else (q, None, None)


def gumbel_argmax(logits: Tensor, temperature: Tensor, seeds: Tensor) -> Tensor:
    """The draw of kernels/triton_sampling.py, with each row's uniform noise from a torch generator seeded
    with the row's seed: other numbers than Philox, the same distribution."""
    if not len(seeds):
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    uniform = torch.stack([torch.rand(logits.shape[1], generator=torch.Generator().manual_seed(seed))
                           for seed in seeds.tolist()]).to(logits.device)
    gumbel = -torch.log(-torch.log(uniform.clamp_min(1e-12)))
    greedy = temperature < GREEDY_TEMPERATURE
    scaled = logits.float() / torch.where(greedy, 1.0, temperature)[:, None] + gumbel
    return torch.where(greedy[:, None], logits.float(), scaled).argmax(-1)
