"""Torch implementations of the kernels: the CPU path, and the ground truth the Triton kernels are tested against.

Attention and norms compute in float32 and cast back to the input dtype. An FP8 KV cache (torch.float8_e4m3fn)
holds each key and value divided by its KV head's scale (k_scale, v_scale: float32 [n_kv]); attention reads
them multiplied back.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.attention_metadata import AttentionMetadata
from kernels.mxfp4 import Mxfp4Weight, dequantize_mxfp4

# A temperature below this draws greedily (vLLM's _SAMPLING_EPS): dividing float32 logits by it would overflow
# them to infinities (1e-40 is a float32 subnormal), and a softmax of infinities is NaN, not the argmax.
GREEDY_TEMPERATURE = 1e-5

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value


def store_kv_cache(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                   k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> None:
    """Write k, v [T, n_kv, D] into the caches [num_blocks, block_size, n_kv, D] at their slots (-1: skip); an
    FP8 cache gets them quantized with k_scale and v_scale (see quantize_kv)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k, v = k[keep], v[keep]
    if k_cache.dtype == FP8:
        k, v = quantize_kv(k, k_scale), quantize_kv(v, v_scale)
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v


def quantize_kv(x: Tensor, scale: Tensor) -> Tensor:
    """x [T, n_kv, D] as an FP8 cache stores it: divided by its head's scale [n_kv] in float32, saturated to
    +-448 and rounded to the nearest e4m3 value (ties to even); kernels/triton_fp8.py encodes the same bits."""
    return (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _dequantized(cached: Tensor, scale: Tensor | None) -> Tensor:
    """Keys or values [..., n_kv, D] read from a cache: an FP8 cache's multiplied by their heads' scales."""
    return cached.float() * scale[:, None] if cached.dtype == FP8 else cached


def _visible(q_pos: Tensor, k_pos: Tensor, window: int, spans: Tensor | None = None) -> Tensor:
    """[..., Lq, Lk] bool from query positions [..., Lq] and key positions [..., Lk]: a query at q sees the key at
    p when p <= q and, with a window, q - window < p (the last `window` positions, its own included). spans
    [..., Lq, 2]: each query also sees the keys start <= p < end of its span, within the window (transformers'
    Gemma 3 image tokens: (causal or same image) and window)."""
    q_pos, k_pos = q_pos[..., :, None], k_pos[..., None, :]
    visible = k_pos <= q_pos
    if spans is not None:
        visible = visible | ((k_pos >= spans[..., :1]) & (k_pos < spans[..., 1:]))
    return visible & (k_pos > q_pos - window) if window else visible


def _attend(q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Tensor | None, sinks: Tensor | None) -> Tensor:
    """Attention over [B, L, heads, D] tensors, GQA by head groups; mask [B, Lq, Lk] (True: visible) or None.

    sinks [n_q]: one logit per query head that joins each softmax's denominator and nothing else (gpt-oss)."""
    dtype = q.dtype
    q, k, v = (t.float().transpose(1, 2) for t in (q, k, v))
    mask = None if mask is None else mask[:, None]
    if sinks is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    else:
        out = _attend_with_sinks(q, k, v, scale, mask, sinks)
    return out.transpose(1, 2).to(dtype)


def _attend_with_sinks(q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Tensor | None, sinks: Tensor) -> Tensor:
    """softmax over [scores, sink] with the sink's column dropped: q [B, n_q, Lq, D], k/v [B, n_kv, Lk, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    peak = torch.maximum(scores.amax(-1, keepdim=True), sink)
    weights = torch.exp(scores - peak)
    return (weights @ v) / (weights.sum(-1, keepdim=True) + torch.exp(sink - peak))


def _gather_blocks(cache: Tensor, tables: Tensor, first_blocks: Tensor, ends: Tensor, num_blocks: int
                   ) -> tuple[Tensor, Tensor]:
    """Blocks first_blocks[b] .. first_blocks[b] + num_blocks - 1 of each row b of tables [B, n], a row whose
    context (ends[b] keys) ends sooner repeating its last block: the keys (or values) [B, num_blocks *
    block_size, n_kv, D] and their positions [B, num_blocks * block_size] (repeats have positions past the
    context, for the caller's mask to hide). Only the blocks that hold a row's keys from first_blocks on are
    read: those before the window may have been freed, and table padding is no block at all."""
    block_size = cache.shape[1]
    columns = first_blocks[:, None].long() + torch.arange(num_blocks, device=cache.device)
    last = (ends.long() - 1).clamp(min=0)[:, None] // block_size
    ids = tables.gather(1, torch.minimum(columns, last)).clamp(min=0)
    positions = (columns[..., None] * block_size + torch.arange(block_size, device=cache.device)).flatten(1)
    return cache[ids].flatten(1, 2), positions


def _first_blocks(first_query_pos: Tensor, window: int, block_size: int) -> Tensor:
    """The block of the earliest key a query at first_query_pos (or later) can see."""
    if not window:
        return torch.zeros_like(first_query_pos)
    return (first_query_pos - window + 1).clamp(min=0) // block_size


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float,
                    window: int = 0, sinks: Tensor | None = None, k_scale: Tensor | None = None,
                    v_scale: Tensor | None = None) -> Tensor:
    """Causal attention of the step's queries [T, n_q, D] over each sequence's cached keys and values; with a
    window, a query at position q sees keys q - window < p <= q only (blocks before them are never read). An
    FP8 cache's keys and values are read times k_scale and v_scale. meta.image_spans widens what prefill queries
    see (a one-token chunk's span ends at its own position, so causal covers it).

    Decode tokens (one query per sequence) are batched together, padding keys to the longest context;
    prefill chunks run one sequence at a time so no [T, T] score matrix spans unrelated sequences.
    """
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    starts = meta.cu_seqlens_q[:-1].tolist()
    q_lens = meta.cu_seqlens_q.diff().tolist()
    seq_lens = meta.seq_lens.tolist()
    decodes = [b for b, n in enumerate(q_lens) if n == 1]
    if decodes:
        rows = torch.tensor(decodes, device=q.device)
        tokens = meta.cu_seqlens_q[rows].long()
        q_pos = meta.seq_lens[rows].long() - 1
        first = _first_blocks(q_pos, window, block_size)
        num_blocks = int((-(-(q_pos + 1) // block_size) - first).max())
        tables = meta.block_tables[rows]
        k, k_pos = _gather_blocks(k_cache, tables, first, q_pos + 1, num_blocks)
        v, _ = _gather_blocks(v_cache, tables, first, q_pos + 1, num_blocks)
        k, v = _dequantized(k, k_scale), _dequantized(v, v_scale)
        mask = _visible(q_pos[:, None], k_pos, window)
        out[tokens] = _attend(q[tokens, None], k, v, scale, mask, sinks).squeeze(1)
    for b, (start, n, length) in enumerate(zip(starts, q_lens, seq_lens)):
        if n > 1:
            q_pos = torch.arange(length - n, length, device=q.device)
            first = _first_blocks(q_pos[:1], window, block_size)
            table = meta.block_tables[b : b + 1]
            num_blocks = -(-length // block_size) - int(first)
            k, k_pos = _gather_blocks(k_cache, table, first, meta.seq_lens[b : b + 1], num_blocks)
            v, _ = _gather_blocks(v_cache, table, first, meta.seq_lens[b : b + 1], num_blocks)
            k, v = _dequantized(k, k_scale), _dequantized(v, v_scale)
            spans = None if meta.image_spans is None else meta.image_spans[start : start + n]
            mask = _visible(q_pos, k_pos[0], window, spans)[None]
            out[start : start + n] = _attend(q[None, start : start + n], k, v, scale, mask, sinks)[0]
    return out


def varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float, causal: bool,
    window: int = 0, sinks: Tensor | None = None,
) -> Tensor:
    """Attention within each sequence of a packed batch: q [T, n_q, D], k/v [T, n_kv, D], no cache; window and
    sinks as in paged_attention (the window applies to causal attention only)."""
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            positions = torch.arange(end - start, device=q.device)
            mask = _visible(positions, positions, window)[None] if causal else None
            out[start:end] = _attend(q[None, start:end], k[None, start:end], v[None, start:end], scale, mask,
                                     sinks)[0]
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


def gated_linear(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str) -> Tensor:
    """act(x W_gate^T + b_gate) * (x W_up^T + b_up): the projection, then silu_and_mul or gelu_tanh_and_mul."""
    return (silu_and_mul if activation == "silu" else gelu_tanh_and_mul)(F.linear(x, weight, bias))


def select_experts(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """The k largest router logits per token (ids int32, descending) and their softmax probabilities in float32,
    over all experts or, when renormalize, over the k chosen."""
    weights, ids = torch.softmax(router_logits.float(), dim=-1).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids.to(torch.int32), weights


def routed_experts(hidden: Tensor, router_weight: Tensor, router_bias: Tensor | None, top_k: int, renormalize: bool,
                   w_gate_up: Tensor | Mxfp4Weight, w_down: Tensor | Mxfp4Weight, b_gate_up: Tensor | None = None,
                   b_down: Tensor | None = None, activation: str = "silu", swiglu_alpha: float = 1.702,
                   swiglu_limit: float = 7.0) -> Tensor:
    """The router's linear layer, select_experts on its logits, then fused_moe."""
    topk_ids, topk_weights = select_experts(linear(hidden, router_weight, router_bias), top_k, renormalize)
    return fused_moe(hidden, topk_ids, topk_weights, w_gate_up, w_down, b_gate_up, b_down, activation, swiglu_alpha,
                     swiglu_limit)


def expert_activation(gate_up: Tensor, activation: str, swiglu_alpha: float, swiglu_limit: float) -> Tensor:
    """[..., 2I] (gate | up) -> [..., I]: silu(gate) * up, or gpt-oss's clamped SwiGLU: with gate clamped above
    at limit and up to +-limit, (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
    return (up + 1) * gate * torch.sigmoid(swiglu_alpha * gate)


def fused_moe(hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate_up: Tensor | Mxfp4Weight,
              w_down: Tensor | Mxfp4Weight, b_gate_up: Tensor | None = None, b_down: Tensor | None = None,
              activation: str = "silu", swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0) -> Tensor:
    """The routed experts as a plain loop over experts: each token's k expert outputs weighted and summed in
    float32. w_gate_up [E, 2I, H] (gate rows, then up rows), w_down [E, H, I], biases [E, 2I] and [E, H]; an
    MXFP4 weight is dequantized to hidden's dtype one routed expert at a time."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in range(w_gate_up.shape[0]):
        tokens, slots = torch.where(topk_ids == expert)
        if not len(tokens):
            continue
        gate_up = F.linear(hidden[tokens], _expert_weight(w_gate_up, expert, hidden.dtype),
                           None if b_gate_up is None else b_gate_up[expert])
        y = expert_activation(gate_up, activation, swiglu_alpha, swiglu_limit)
        y = F.linear(y, _expert_weight(w_down, expert, hidden.dtype), None if b_down is None else b_down[expert])
        out.index_add_(0, tokens, y.float() * topk_weights[tokens, slots, None].float())
    return out.to(hidden.dtype)


def _expert_weight(weight: Tensor | Mxfp4Weight, expert: int, dtype: torch.dtype) -> Tensor:
    if isinstance(weight, Mxfp4Weight):
        return dequantize_mxfp4(weight.blocks[expert], weight.scales[expert], dtype)
    return weight[expert]


def gelu_tanh_and_mul(x: Tensor) -> Tensor:
    """x [T, 2I] -> gelu(x[:, :I], tanh approximation) * x[:, I:] (Gemma's gated MLP)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


FP8_GROUP_K = 128  # activation columns sharing a scale in the Triton FP8 GEMM


def dequantize_fp8(weight: Tensor, scale: Tensor, block: tuple[int, int], dtype: torch.dtype) -> Tensor:
    """e4m3 weight [N, K] times its scales [ceil(N / rows), ceil(K / cols)], block = (rows, cols), in dtype
    (the product is taken in float32)."""
    rows, cols = block
    full = scale.float().repeat_interleave(rows, dim=0)[:weight.shape[0]]
    full = full.repeat_interleave(cols, dim=1)[:, :weight.shape[1]]
    return (weight.float() * full).to(dtype)


def quantize_fp8(x: Tensor, block: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """x [N, K] as e4m3 with one float32 scale per block of (rows, cols), the block's largest magnitude mapped
    to e4m3's largest: (values [N, K], scales [ceil(N / rows), ceil(K / cols)]). Activations are quantized
    per token with (1, group) blocks; checkpoints' weights per 128 x 128 block."""
    rows, cols = block
    n, k = x.shape
    padded = F.pad(x.float(), (0, -k % cols, 0, -n % rows))
    blocks = padded.view(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)
    scales = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    values = (blocks / scales[:, None, :, None]).to(FP8).view(padded.shape)[:n, :k]
    return values.contiguous(), scales


def fp8_linear(x: Tensor, weight: Tensor, weight_scale: Tensor, block: tuple[int, int],
               bias: Tensor | None = None, method: str = "triton") -> Tensor:
    """x W^T (+ bias) as the FP8 GEMMs compute it: x quantized to e4m3 per token (per 128 columns for the
    Triton kernel, per whole row for torch._scaled_mm), times the block-scaled e4m3 weight, in float32."""
    group = FP8_GROUP_K if method == "triton" else x.shape[1]
    values, scales = quantize_fp8(x, (1, group))
    out = dequantize_fp8(values, scales, (1, group), torch.float32) @ dequantize_fp8(
        weight, weight_scale, block, torch.float32).T
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def qkv_prologue(
    qkv: Tensor, positions: Tensor, cos_sin_cache: Tensor, num_heads: int, num_kv_heads: int,
    q_norm_weight: Tensor | None = None, k_norm_weight: Tensor | None = None, eps: float = 1e-6,
    k_cache: Tensor | None = None, v_cache: Tensor | None = None, slot_mapping: Tensor | None = None,
    return_kv: bool = True, k_scale: Tensor | None = None, v_scale: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The attention prologue as its separate steps: split qkv, per-head RMSNorm of q and k (when weights are
    given), rotary, and the KV-cache store (when a cache and slot_mapping are given; quantized with k_scale and
    v_scale into an FP8 cache)."""
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
        store_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return (q, k, v) if return_kv else (q, None, None)


def gumbel_argmax(logits: Tensor, temperature: Tensor | None, seeds: Tensor | None) -> Tensor:
    """The draw of kernels/triton_sampling.py, with each row's uniform noise from a torch generator seeded
    with the row's seed: other numbers than Philox, the same distribution."""
    if temperature is None:
        return logits.argmax(-1)
    if not len(seeds):
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    uniform = torch.stack([torch.rand(logits.shape[1], generator=torch.Generator().manual_seed(seed))
                           for seed in seeds.tolist()]).to(logits.device)
    gumbel = -torch.log(-torch.log(uniform.clamp_min(1e-12)))
    greedy = temperature < GREEDY_TEMPERATURE
    scaled = logits.float() / torch.where(greedy, 1.0, temperature)[:, None] + gumbel
    return torch.where(greedy[:, None], logits.float(), scaled).argmax(-1)


def apply_token_bitmask(logits: Tensor, bitmask: Tensor, rows: Tensor) -> None:
    """In place: logits[rows[i], t] = -inf where bit t % 32 of bitmask[i, t // 32] is clear (xgrammar's layout:
    int32 words, a set bit allows its token)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :logits.shape[1]]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
