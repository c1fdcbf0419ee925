"""The Llama-family decoder: Llama, Qwen2 (bias on q/k/v) and Qwen3 (RMSNorm on each q/k head).

One class serves all three; the differences are read from the transformers config. Q/K/V and gate/up are
fused into single projections (the checkpoint's separate tensors are copied into slices at load time), so a
layer costs few kernel launches. The projections are models/parallel_layers.py's: under tensor parallelism
each rank holds 1/N of the heads and of the MLP's intermediate features; with one rank they are plain layers.
forward() has no host syncs and no branches on tensor values, so the engine can capture it in a CUDA graph.
"""

import math

import torch
from torch import Tensor, nn

from kernels import (
    AttentionMetadata,
    add_rms_norm,
    qkv_paged_attention,
    qkv_prologue,
    rms_norm,
    silu_and_mul,
    varlen_attention,
)
from models.parallel_layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    tp_size,
)

QKV_BIAS_MODEL_TYPES = ("qwen2",)
QK_NORM_MODEL_TYPES = ("qwen3",)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """rms_norm(x); with a residual, the fused (rms_norm(x + residual), x + residual)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


def rope_parameters(config) -> dict:
    """The rope settings as one dict with rope_type and rope_theta (transformers 5 and 4 store them differently)."""
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    return params


def inverse_frequencies(head_dim: int, params: dict) -> Tensor:
    """Rotary inverse frequencies [head_dim / 2], rescaled as the config's rope_type says."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return llama3_inverse_frequencies(inv_freq, params)
    return inv_freq


def llama3_inverse_frequencies(inv_freq: Tensor, params: dict) -> Tensor:
    """Llama 3.1 context extension: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""
    factor = params["factor"]
    low_freq_factor, high_freq_factor = params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    ramped = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_context / low_freq_factor, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= old_context / high_freq_factor) & (wavelen <= old_context / low_freq_factor)
    return torch.where(is_medium, ramped, scaled)


class RotaryEmbedding(nn.Module):
    """Holds cos_sin_cache [max_positions, head_dim] = cat(cos, sin) in float32; one instance shared by all layers."""

    def __init__(self, head_dim: int, max_positions: int, params: dict):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, params)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)


class Attention(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding):
        super().__init__()
        self.head_dim = head_dim_of(config)
        self.scale = self.head_dim**-0.5
        q_size = config.num_attention_heads * self.head_dim
        kv_size = config.num_key_value_heads * self.head_dim
        bias = getattr(config, "attention_bias", False)
        qkv_bias = bias or config.model_type in QKV_BIAS_MODEL_TYPES
        self.qkv_proj = MergedColumnParallelLinear(config.hidden_size, [q_size, kv_size, kv_size], bias=qkv_bias)
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, bias=bias)
        self.split_sizes = self.qkv_proj.output_sizes  # this rank's heads
        self.num_heads, self.num_kv_heads = (size // self.head_dim for size in self.split_sizes[:2])
        has_qk_norm = config.model_type in QK_NORM_MODEL_TYPES
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if has_qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if has_qk_norm else None
        self.rotary_emb = rotary
        self.k_cache: Tensor | None = None
        self.v_cache: Tensor | None = None
        self.k_scale: Tensor | None = None  # an FP8 cache's float32 scales, one per KV head (set_kv_cache)
        self.v_scale: Tensor | None = None

    def forward(self, positions: Tensor, x: Tensor, meta: AttentionMetadata) -> Tensor:
        """q/k norm, rotary and the KV-cache store run as one fused prologue on the qkv projection (in the
        attention kernel itself for a decode step on CUDA)."""
        qkv, cos_sin = self.qkv_proj(x), self.rotary_emb.cos_sin_cache
        norms = (None, None, 0.0) if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        if self.k_cache is not None and meta.block_tables is not None:
            out = qkv_paged_attention(qkv, positions, cos_sin, self.num_heads, self.num_kv_heads, *norms,
                                      self.k_cache, self.v_cache, meta, self.scale,
                                      k_scale=self.k_scale, v_scale=self.v_scale)
        else:
            q, k, v = qkv_prologue(qkv, positions, cos_sin, self.num_heads, self.num_kv_heads, *norms,
                                   self.k_cache, self.v_cache, meta.slot_mapping,
                                   k_scale=self.k_scale, v_scale=self.v_scale)
            out = varlen_attention(q, k, v, meta.cu_seqlens_q, meta.max_seqlen_q, self.scale, causal=True)
        return self.o_proj(out.reshape(x.shape[0], -1))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (supported: 'silu')")
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, positions: Tensor, x: Tensor, residual: Tensor | None, meta: AttentionMetadata
    ) -> tuple[Tensor, Tensor]:
        """Pre-norm block; the residual stream is carried apart so each add fuses into the next norm."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        rotary = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, rope_parameters(config))
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, rotary) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """Decoder with an LM head (tied to the embeddings when the config says so).

    with_lm_head=False builds the bare decoder (checkpoints saved as LlamaModel / Qwen3Model, such as
    embedding models): forward() works, compute_logits() does not.
    """

    # Checkpoint module name -> (our fused module, index of its slice).
    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, with_lm_head: bool = True):
        super().__init__()
        check_supported(config)
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads // tp_size()  # this rank's
        self.head_dim = head_dim_of(config)
        self.model = LlamaModel(config)
        self.tie_word_embeddings = with_lm_head and bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size) if with_lm_head else None
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        """Hidden states [T, H] after the final norm, for the step's tokens packed as meta describes."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: Tensor) -> Tensor | None:
        """Logits [N, V] in the model's dtype for the hidden states of the N tokens that sample (None on
        tensor-parallel ranks other than 0: only rank 0 samples). The sampler reads them in float32 itself: a
        float32 copy of a batch's logits costs more than the sampling that most batches do."""
        if self.lm_head is None:
            raise ValueError("this checkpoint has no LM head (a bare decoder); it can embed but not generate")
        return self.lm_head(hidden)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
        return (self.num_layers, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def set_kv_cache(self, k_caches: list[Tensor | None], v_caches: list[Tensor | None],
                     k_scales: Tensor | None = None, v_scales: Tensor | None = None) -> None:
        """Attach one [num_blocks, block_size, n_kv, D] K and V cache per layer (None: detach it); an FP8 cache
        with its scales, float32 [num_layers, n_kv] for the keys and for the values."""
        if len(k_caches) != self.num_layers or len(v_caches) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} K and V caches, got {len(k_caches)} and {len(v_caches)}")
        for i, (layer, k_cache, v_cache) in enumerate(zip(self.model.layers, k_caches, v_caches)):
            layer.self_attn.k_cache, layer.self_attn.v_cache = k_cache, v_cache
            layer.self_attn.k_scale = None if k_scales is None else k_scales[i]
            layer.self_attn.v_scale = None if v_scales is None else v_scales[i]


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_supported(config) -> None:
    """Refuse configs this module would compute wrongly (rope types and activations are checked where used)."""
    if getattr(config, "use_sliding_window", False):
        raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")
    check_tensor_parallel(config, tp_size())


def check_tensor_parallel(config, size: int) -> None:
    """Each of `size` ranks must get a whole number of query heads, KV heads and MLP features."""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name)
        if value % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide the model's {name}={value}: pick a "
                             f"tensor-parallel size that divides {name}")
