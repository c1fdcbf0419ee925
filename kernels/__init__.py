"""The kernels the models call, each dispatched by device: torch reference on CPU; on CUDA our Triton kernels,
with flash-attn, when it is installed, for attention over the caches it can read (blocks of a multiple of 256
tokens, not FP8, no sinks) in steps without image spans (AttentionMetadata.image_spans). Installing flash-attn
changes nothing for the other caches (the default blocks of 16 among them): their decode steps keep the fused
prologue. When flash-attn is found, the log says which caches it takes.

A KV cache holds the model's dtype or FP8 (torch.float8_e4m3fn, e4m3): an FP8 cache comes with one float32 scale
per KV head for its keys (k_scale [n_kv]) and one for its values (v_scale): the prologue stores x / scale,
attention reads the cached value times its scale (kernels/reference.py's quantize_kv says how it rounds).

The backend for a device type is chosen once and cached; Triton and flash-attn are imported only when a
CUDA tensor first arrives, so the CPU path never imports them. Calls read `tensor.is_cuda` rather than
`tensor.device.type` (which builds a device object per call): every launch on the eager prefill path pays it.
"""

import functools
import logging
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.attention_metadata import AttentionMetadata
from kernels.mxfp4 import Mxfp4Weight
from kernels.reference import GREEDY_TEMPERATURE, dequantize_fp8

BACKEND_FUNCTIONS = (  # each device type's backend has one of each (kernels/reference.py on the CPU)
    "linear",
    "gated_linear",
    "paged_attention",
    "varlen_attention",
    "rms_norm",
    "add_rms_norm",
    "silu_and_mul",
    "gelu_tanh_and_mul",
    "fp8_linear",
    "qkv_prologue",
    "gumbel_argmax",
    "apply_token_bitmask",
    "select_experts",
    "fused_moe",
    "routed_experts",
)
__all__ = ["AttentionMetadata", "FP8_KV_CACHE_DTYPE", "GREEDY_TEMPERATURE", *BACKEND_FUNCTIONS, "check_kv_scales",
           "qkv_paged_attention", "dequantize_fp8", "Mxfp4Weight", "load_backend"]

FLASH_ATTN_BLOCK_MULTIPLE = 256  # flash-attn 2 reads a paged KV cache only in blocks of a multiple of 256 tokens
FP8_KV_CACHE_DTYPE = torch.float8_e4m3fn

logger = logging.getLogger(__name__)


@functools.cache
def _backend(device_type: str) -> SimpleNamespace:
    if device_type != "cuda":
        from kernels import reference

        return SimpleNamespace(**{name: getattr(reference, name) for name in BACKEND_FUNCTIONS}, fused_decode=None)
    from kernels import (
        triton_activation,
        triton_attention,
        triton_fp8_gemm,
        triton_linear,
        triton_moe,
        triton_norm,
        triton_prologue,
        triton_sampling,
    )

    backend = SimpleNamespace(
        linear=triton_linear.decode_linear,
        gated_linear=triton_linear.gated_linear,
        paged_attention=triton_attention.paged_attention,
        varlen_attention=triton_attention.varlen_attention,
        rms_norm=triton_norm.rms_norm,
        add_rms_norm=triton_norm.add_rms_norm,
        silu_and_mul=triton_activation.silu_and_mul,
        gelu_tanh_and_mul=triton_activation.gelu_tanh_and_mul,
        fp8_linear=triton_fp8_gemm.fp8_linear,
        qkv_prologue=triton_prologue.qkv_prologue,
        gumbel_argmax=triton_sampling.gumbel_argmax,
        apply_token_bitmask=triton_sampling.apply_token_bitmask,
        select_experts=triton_moe.select_experts,
        fused_moe=triton_moe.fused_moe,
        routed_experts=triton_moe.routed_experts,
        fused_decode=triton_attention.qkv_decode_attention,
        decodes_apart=triton_attention.decodes_apart,
    )
    try:
        import flash_attn
    except ImportError:
        return backend
    return _with_flash_attn(backend, flash_attn)


def load_backend(device_type: str) -> None:
    """Imports a device type's kernels now rather than at its first launch: on CUDA, Triton and our Triton
    modules (seconds), which start-up imports on a thread of its own while the weights load. A launch on another
    thread meanwhile imports them too, waiting on Python's import locks for the modules this one is importing."""
    _backend(device_type)


def _backend_of(tensor: Tensor) -> SimpleNamespace:
    return _backend("cuda" if tensor.is_cuda else "cpu")


def _flash_attn_reads(k_cache: Tensor, sinks: Tensor | None) -> bool:
    """Whether flash-attn 2 can attend over this cache: blocks of a multiple of its 256 tokens, not FP8 (it has no
    scaled e4m3 cache), no sinks (it has none)."""
    return not (k_cache.shape[1] % FLASH_ATTN_BLOCK_MULTIPLE or sinks is not None
                or k_cache.dtype == FP8_KV_CACHE_DTYPE)


def _with_flash_attn(backend: SimpleNamespace, flash_attn) -> SimpleNamespace:
    """flash-attn for attention over the caches it reads (_flash_attn_reads), our Triton kernels otherwise, the fused
    decode prologue included: flash-attn has no prologue, so only its decode steps launch the prologue apart. A step
    with image spans stays with Triton: flash-attn's masks are causal or none, never an image's both ways. A
    window maps to window_size=(window - 1, 0): the query itself and window - 1 keys before it. flash-attn reads
    keys in tiles that divide its 256-token blocks, so it never reads a block wholly before a query's window (a
    freed one)."""
    triton_paged_attention, triton_varlen_attention = backend.paged_attention, backend.varlen_attention
    triton_decodes_apart = backend.decodes_apart
    logger.info("flash-attn %s found: it attends over KV caches of blocks of a multiple of %d tokens (not FP8, "
                "without sinks); the Triton kernels over the others, decode with its fused prologue",
                getattr(flash_attn, "__version__", "(version unknown)"), FLASH_ATTN_BLOCK_MULTIPLE)

    def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float,
                        window: int, sinks: Tensor | None, k_scale: Tensor | None, v_scale: Tensor | None) -> Tensor:
        if meta.image_spans is not None or not _flash_attn_reads(k_cache, sinks):
            return triton_paged_attention(q, k_cache, v_cache, meta, scale, window, sinks, k_scale, v_scale)
        if meta.is_decode:
            out = flash_attn.flash_attn_with_kvcache(
                q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seq_lens, block_table=meta.block_tables,
                softmax_scale=scale, causal=True, window_size=_flash_window(window),
            )
            return out.squeeze(1)
        cu_seqlens_k = F.pad(meta.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return flash_attn.flash_attn_varlen_func(
            q, k_cache, v_cache, meta.cu_seqlens_q, cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
            softmax_scale=scale, causal=True, block_table=meta.block_tables, window_size=_flash_window(window),
        )

    def varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale, causal, window, sinks):
        if sinks is not None:
            return triton_varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale, causal, window, sinks)
        return flash_attn.flash_attn_varlen_func(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale=scale, causal=causal,
            window_size=_flash_window(window),
        )

    def decodes_apart(qkv, num_heads, k_cache, meta, window=0, sinks=None) -> bool:
        return _flash_attn_reads(k_cache, sinks) or triton_decodes_apart(qkv, num_heads, k_cache, meta, window, sinks)

    return SimpleNamespace(**{**vars(backend), "paged_attention": paged_attention,
                              "varlen_attention": varlen_attention, "decodes_apart": decodes_apart})


def _flash_window(window: int) -> tuple[int, int]:
    """flash-attn's (left, right) reach of a query: (-1, -1) is unlimited (the causal flag bounds the right)."""
    return (window - 1, 0) if window else (-1, -1)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x W^T (+ bias): on CUDA our split-K Triton GEMM at decode sizes, cuBLAS above them."""
    return _backend_of(x).linear(x, weight, bias)


def gated_linear(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str) -> Tensor:
    """An MLP's act(x W_gate^T + b_gate) * (x W_up^T + b_up) for weight [2I, K] (gate rows, then up rows) and
    activation "silu" or "gelu_tanh": on CUDA one Triton launch at decode sizes, the projection then the
    activation above them."""
    return _backend_of(x).gated_linear(x, weight, bias, activation)


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float,
                    window: int = 0, sinks: Tensor | None = None, k_scale: Tensor | None = None,
                    v_scale: Tensor | None = None) -> Tensor:
    """Causal attention of q [T, n_q, D] over the paged cache as meta describes -> [T, n_q, D]; an FP8 cache
    with its k_scale and v_scale (see the module docstring).

    window > 0: a query at position q sees the keys at q - window < p <= q only (transformers' sliding_window);
    the blocks before its window are never read, so they may have been freed. sinks [n_q]: one logit per
    query head that joins the softmax's denominator only (gpt-oss): out = sum_j e^(s_j) v_j / (e^sink +
    sum_j e^(s_j)). Both are per-layer constants: a CUDA graph captures them. meta.image_spans: a query also sees
    the keys of its image, those after it included, within its window (Gemma 3's image tokens)."""
    _check_window_and_sinks(window, sinks, q.shape[1], causal=True)
    check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    return _backend_of(q).paged_attention(q, k_cache, v_cache, meta, scale, window, sinks, k_scale, v_scale)


def varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float, causal: bool,
    window: int = 0, sinks: Tensor | None = None,
) -> Tensor:
    """Attention within each sequence of a packed batch, no cache; window (causal only) and sinks as in
    paged_attention."""
    _check_window_and_sinks(window, sinks, q.shape[1], causal)
    return _backend_of(q).varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale, causal, window, sinks)


def _check_window_and_sinks(window: int, sinks: Tensor | None, num_q_heads: int, causal: bool) -> None:
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an integer >= 0 (0: full attention), got {window!r}")
    if window and not causal:
        raise ValueError("a sliding window needs causal attention (causal=True)")
    if sinks is not None and sinks.shape != (num_q_heads,):
        raise ValueError(f"sinks must hold one logit per query head: shape ({num_q_heads},), got "
                         f"{tuple(sinks.shape)}")


def check_kv_scales(k_cache: Tensor, v_cache: Tensor, k_scale: Tensor | None, v_scale: Tensor | None) -> None:
    """Both caches of one dtype; an FP8 pair with k_scale and v_scale float32 [n_kv] beside it, another without."""
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache and v_cache must have one dtype, got {k_cache.dtype} and {v_cache.dtype}")
    if k_cache.dtype != FP8_KV_CACHE_DTYPE:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale and v_scale belong to an FP8 (float8_e4m3fn) KV cache, not a {k_cache.dtype} "
                             "one")
        return
    num_kv_heads = k_cache.shape[2]
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if (scale is None or scale.shape != (num_kv_heads,) or scale.dtype != torch.float32
                or scale.is_cuda != k_cache.is_cuda):
            got = "none" if scale is None else f"{scale.dtype} {tuple(scale.shape)} on {scale.device}"
            raise ValueError(f"an FP8 KV cache needs {name}: float32 ({num_kv_heads},), one scale per KV head, on "
                             f"the cache's device; got {got}")


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _backend_of(x).rms_norm(x, weight, eps)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return _backend_of(x).add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: Tensor) -> Tensor:
    return _backend_of(x).silu_and_mul(x)


def gelu_tanh_and_mul(x: Tensor) -> Tensor:
    return _backend_of(x).gelu_tanh_and_mul(x)


def fp8_linear(x: Tensor, weight: Tensor, weight_scale: Tensor, block: tuple[int, int], bias: Tensor | None = None,
               method: str = "triton") -> Tensor:
    """x W^T (+ bias) for an e4m3 weight [N, K] with float32 scales [ceil(N / rows), ceil(K / cols)], block =
    (rows, cols). method "triton": our block-scaled GEMM, x quantized per token and 128 columns inside it;
    "scaled_mm": x quantized per token, torch._scaled_mm (a scale per weight row: block (1, K))."""
    return _backend_of(x).fp8_linear(x, weight, weight_scale, block, bias, method)


def qkv_prologue(
    qkv: Tensor, positions: Tensor, cos_sin_cache: Tensor, num_heads: int, num_kv_heads: int,
    q_norm_weight: Tensor | None = None, k_norm_weight: Tensor | None = None, eps: float = 1e-6,
    k_cache: Tensor | None = None, v_cache: Tensor | None = None, slot_mapping: Tensor | None = None,
    return_kv: bool = True, k_scale: Tensor | None = None, v_scale: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Everything between the qkv projection and attention, in one launch on CUDA.

    qkv [T, (n_q + 2 n_kv) D] -> q [T, n_q, D]: per-head RMSNorm of q and k when their weights are given
    (Qwen3), then NeoX rotary. With k_cache, v_cache and slot_mapping, k and v go straight into the paged
    cache (slot -1: skipped; an FP8 cache stores them quantized with k_scale and v_scale). return_kv=True also
    returns k [T, n_kv, D] and v (a view of qkv), unquantized, for attention without a cache; else (q, None,
    None).
    """
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("qkv_prologue needs both q_norm_weight and k_norm_weight, or neither")
    if k_cache is not None:
        check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    return _backend_of(qkv).qkv_prologue(
        qkv, positions, cos_sin_cache, num_heads, num_kv_heads, q_norm_weight, k_norm_weight, eps,
        k_cache, v_cache, slot_mapping, return_kv, k_scale, v_scale,
    )


def qkv_paged_attention(
    qkv: Tensor, positions: Tensor, cos_sin_cache: Tensor, num_heads: int, num_kv_heads: int,
    q_norm_weight: Tensor | None, k_norm_weight: Tensor | None, eps: float, k_cache: Tensor, v_cache: Tensor,
    meta: AttentionMetadata, scale: float, window: int = 0, sinks: Tensor | None = None,
    k_scale: Tensor | None = None, v_scale: Tensor | None = None, rotary_at_lengths: bool = True,
) -> Tensor:
    """qkv_prologue, storing the step's keys and values in the paged cache (quantized into an FP8 one), then
    paged_attention (with its window and sinks): q [T, n_q, D] attended. A decode step on CUDA runs both in the
    decode attention kernel (one launch less per layer; Triton's qkv_decode_attention), unless the Gluon kernel
    (large batches over an FP8 cache: kernels/gluon_decode.py) or flash-attn (_flash_attn_reads) takes its
    attention, or the step's rows read each other's keys (meta.rows_read_each_other: that kernel's programs
    store only their own row's). rotary_at_lengths: the positions are each sequence's length - 1, which that
    kernel reads itself; False (an M-RoPE model's shifted positions): it reads them from `positions`."""
    _check_window_and_sinks(window, sinks, num_heads, causal=True)
    backend = _backend_of(qkv)
    if (meta.is_decode and backend.fused_decode is not None and not meta.rows_read_each_other
            and not backend.decodes_apart(qkv, num_heads, k_cache, meta, window, sinks)):
        check_kv_scales(k_cache, v_cache, k_scale, v_scale)
        return backend.fused_decode(qkv, cos_sin_cache, num_heads, num_kv_heads, q_norm_weight, k_norm_weight, eps,
                                    k_cache, v_cache, meta, scale, window=window, sinks=sinks, k_scale=k_scale,
                                    v_scale=v_scale, positions=None if rotary_at_lengths else positions)
    q, _, _ = qkv_prologue(qkv, positions, cos_sin_cache, num_heads, num_kv_heads, q_norm_weight, k_norm_weight,
                           eps, k_cache, v_cache, meta.slot_mapping, False, k_scale, v_scale)
    return backend.paged_attention(q, k_cache, v_cache, meta, scale, window, sinks, k_scale, v_scale)


def gumbel_argmax(logits: Tensor, temperature: Tensor | None, seeds: Tensor | None) -> Tensor:
    """One token per row of logits [N, V]: argmax(logits / temperature + Gumbel noise), a draw from
    softmax(logits / temperature); argmax(logits) where temperature is below GREEDY_TEMPERATURE, and in every row
    when temperature and seeds are None. The noise of a row is a function of its int64 seed alone (Philox on CUDA,
    a seeded torch generator on CPU)."""
    return _backend_of(logits).gumbel_argmax(logits, temperature, seeds)


def apply_token_bitmask(logits: Tensor, bitmask: Tensor, rows: Tensor) -> None:
    """In place: logits[rows[i], t] = -inf for each token t that bitmask[i] does not allow. bitmask: int32
    [len(rows), ceil(V / 32)], bit t % 32 of word t // 32 set where token t is allowed (xgrammar's layout)."""
    _backend_of(logits).apply_token_bitmask(logits, bitmask, rows)


def select_experts(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """A mixture of experts' routing: per token of router_logits [T, E], the ids [T, k] (int32) of the k largest
    logits in descending order and their weights [T, k] (float32): the softmax over all E experts, or over the k
    chosen when renormalize (Qwen3-MoE's norm_topk_prob; gpt-oss's softmax of its top-k logits)."""
    return _backend_of(router_logits).select_experts(router_logits, top_k, renormalize)


def fused_moe(hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate_up: Tensor | Mxfp4Weight,
              w_down: Tensor | Mxfp4Weight, b_gate_up: Tensor | None = None, b_down: Tensor | None = None,
              activation: str = "silu", swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0) -> Tensor:
    """The routed experts' MLPs: out[t] = sum_j topk_weights[t, j] * expert_e(hidden[t]), e = topk_ids[t, j],
    with expert_e(x) = w_down[e] act(w_gate_up[e] x + b_gate_up[e]) + b_down[e]. w_gate_up [E, 2I, H] holds
    the gate rows then the up rows, w_down [E, H, I]; biases optional. activation: "silu" (silu(gate) * up) or
    "clamped_swiglu" (gpt-oss: gate clamped above at swiglu_limit, up within +-swiglu_limit, then
    (up + 1) * gate * sigmoid(swiglu_alpha * gate)). On CUDA the tokens are sorted by expert on the device
    and each projection is one grouped GEMM launch over all experts (kernels/triton_moe.py). Either weight
    may be MXFP4 (kernels/mxfp4.py): the Triton kernels dequantize its tiles in registers."""
    return _backend_of(hidden).fused_moe(hidden, topk_ids, topk_weights, w_gate_up, w_down, b_gate_up, b_down,
                                         activation, swiglu_alpha, swiglu_limit)


def routed_experts(hidden: Tensor, router_weight: Tensor, router_bias: Tensor | None, top_k: int, renormalize: bool,
                   w_gate_up: Tensor | Mxfp4Weight, w_down: Tensor | Mxfp4Weight, b_gate_up: Tensor | None = None,
                   b_down: Tensor | None = None, activation: str = "silu", swiglu_alpha: float = 1.702,
                   swiglu_limit: float = 7.0) -> Tensor:
    """A whole routed MLP: fused_moe of the experts select_experts picks from the router's logits
    hidden router_weight^T + router_bias. On CUDA a step of a single token (over MXFP4 experts, of a few) takes
    three launches (the router GEMM with its top-k, then the two expert GEMMs, each reading only the k experts of
    each token; kernels/triton_moe.py's routes_directly); larger steps take the router's linear layer,
    select_experts and fused_moe."""
    return _backend_of(hidden).routed_experts(hidden, router_weight, router_bias, top_k, renormalize, w_gate_up,
                                              w_down, b_gate_up, b_down, activation, swiglu_alpha, swiglu_limit)
