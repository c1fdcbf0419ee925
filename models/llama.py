"""The decoder: one class for every family we serve, driven by the transformers config.

A family is a set of switches, each read from the config (tables below), and a mapping of its checkpoint
names (models/loader.py):
- Llama; Mistral (a sliding window); Qwen2 (bias on q/k/v) and Qwen3 (RMSNorm on each q/k head), whose
  use_sliding_window windows their upper layers.
- Phi-3 / Phi-4: q|k|v and gate|up fused in the checkpoint (loaded as they are), rotary over part of each
  head and LongRoPE (models/rotary.py).
- Gemma 3 text: (1 + w) RMSNorms, norms after attention and the MLP as well as before, q/k norms, the
  attention scale from query_pre_attn_scalar, embeddings times sqrt(hidden), tanh-GELU, local and global
  layers with rope settings of their own, tied embeddings; final logit soft-capping where a config sets it.
- Qwen2.5-VL text: Qwen2 with M-RoPE (models/rotary.py's mrope_rows): a prefill step with images passes
  rope_positions [3, T], three position streams per token, and the rotary reads a row per token; every other
  step passes shifted 1D positions (a request's text after its images continues from its last position + 1),
  which the fused decode kernel then reads rather than each sequence's length - 1.
- Qwen3-MoE: Qwen3 with a routed MLP (models/moe.py) on the layers is_moe_layer names, dense elsewhere.
- gpt-oss: routed MLPs (biased router and experts, clamped SwiGLU, MXFP4 experts kept packed),
  attention sinks, alternating sliding and full layers, biases on q/k/v/o, YaRN rope.
- FP8 checkpoints of the dense families (models/fp8.py): the projections hold e4m3 weights and their scales.

Q/K/V and gate/up are fused into single projections (a checkpoint's separate tensors are copied into slices
at load time), so a layer costs few kernel launches. The projections are models/parallel_layers.py's: under
tensor parallelism each rank holds 1/N of the heads and of the MLP's intermediate features; with one rank
they are plain layers. forward() has no host syncs and no branches on tensor values, so the engine can
capture it in a CUDA graph.
"""

import functools
from collections.abc import Callable

import torch
from torch import Tensor, nn

from kernels import (
    AttentionMetadata,
    add_rms_norm,
    qkv_paged_attention,
    qkv_prologue,
    rms_norm,
    varlen_attention,
)
from models.all_reduce import RankPartial
from models.fp8 import Fp8Format, fp8_format
from models.moe import MoeMLP, check_moe_tensor_parallel, is_moe_layer
from models.parallel_layers import (
    GateUpParallelLinear,
    MergedColumnParallelLinear,
    ParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    check_dtype,
    check_shape,
    copy_part,
    read,
    tp_rank,
    tp_size,
)
from models.rotary import HeadLayout, RotaryEmbedding, head_layout, place_head_rows, rope_parameters, rotary_dim

QKV_BIAS_MODEL_TYPES = ("qwen2", "qwen2_5_vl_text")
SINK_MODEL_TYPES = ("gpt_oss",)  # a learned logit per query head in each softmax's denominator
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe", "gemma3_text")
ONE_PLUS_WEIGHT_NORM_MODEL_TYPES = ("gemma3_text",)  # RMSNorm scales by (1 + w): the weight loads as 1 + w
POST_BLOCK_NORM_MODEL_TYPES = ("gemma3_text",)  # norms after attention and the MLP too (sandwich)
SCALED_EMBEDDING_MODEL_TYPES = ("gemma3_text",)  # embeddings times sqrt(hidden_size)
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # config's hidden_act: kernels.gated_linear's
LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' config.layer_types we compute


def _offset_weight_loader(offset: float, param: Tensor, loaded) -> None:
    """The checkpoint's w as the effective norm weight offset + w, added in float32 and rounded once."""
    check_shape(loaded, tuple(param.shape))
    check_dtype(param.data, loaded)
    param.data.copy_(read(loaded).float() + offset)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        if offset:
            self.weight.weight_loader = functools.partial(_offset_weight_loader, offset)
        self.eps = eps

    def forward(self, x: Tensor | RankPartial, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """rms_norm(x); with a residual, the fused (rms_norm(x + residual), x + residual). A block's output that each
        tensor-parallel rank holds a part of is summed here too."""
        if isinstance(x, RankPartial):
            return x.norm(residual, self.weight, self.eps)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


def _load_heads(param: Tensor, loaded) -> None:
    """A value per query head (attention sinks): this rank's heads, split as q's are."""
    copy_part(param.data, loaded, 0, tp_rank(), tp_size())


def norm_offset(config) -> float:
    return 1.0 if config.model_type in ONE_PLUS_WEIGHT_NORM_MODEL_TYPES else 0.0


class Attention(nn.Module):
    """window: the layer's sliding window (0: full attention). sinks: None, or one learned logit per query head of
    this rank that joins the softmax's denominator (gpt-oss; a family with sinks sets it and loads it split by
    heads like q)."""

    def __init__(self, config, rotary: RotaryEmbedding, layout: HeadLayout, quant: Fp8Format | None,
                 window: int = 0):
        super().__init__()
        self.window = window
        self.sinks: nn.Parameter | None = None
        head_dim = layout.head_dim
        self.layout, self.head_dim = layout, layout.padded
        self.scale = (getattr(config, "query_pre_attn_scalar", None) or head_dim) ** -0.5
        q_size = config.num_attention_heads * head_dim
        kv_size = config.num_key_value_heads * head_dim
        bias = getattr(config, "attention_bias", False)
        qkv_bias = bias or config.model_type in QKV_BIAS_MODEL_TYPES
        self.qkv_proj = MergedColumnParallelLinear(config.hidden_size, [q_size, kv_size, kv_size], bias=qkv_bias,
                                                   quant=quant)
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, bias=bias, quant=quant)
        self.num_heads, self.num_kv_heads = (size // head_dim for size in self.qkv_proj.output_sizes[:2])
        if config.model_type in SINK_MODEL_TYPES:
            self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
            self.sinks.weight_loader = _load_heads
        has_qk_norm = config.model_type in QK_NORM_MODEL_TYPES
        offset = norm_offset(config)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, offset) if has_qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, offset) if has_qk_norm else None
        self.rotary_emb = rotary
        self.rotary_at_lengths = rotary.streams is None  # M-RoPE positions are shifted: not seq_lens - 1
        self.k_cache: Tensor | None = None
        self.v_cache: Tensor | None = None
        self.k_scale: Tensor | None = None  # an FP8 cache's float32 scales, one per KV head (set_kv_cache)
        self.v_scale: Tensor | None = None

    def forward(self, positions: Tensor, x: Tensor, meta: AttentionMetadata,
                rope_positions: Tensor | None = None) -> Tensor:
        """q/k norm, rotary and the KV-cache store run as one fused prologue on the qkv projection (in the
        attention kernel itself for a decode step on CUDA). rope_positions: M-RoPE's [3, T] streams, whose
        cos|sin rows the prologue then reads at `positions` (the rows' own indices)."""
        qkv, cos_sin = self.qkv_proj(x), self.rotary_emb.cos_sin_cache
        if rope_positions is not None:
            cos_sin = self.rotary_emb.mrope_rows(rope_positions)
        norms = (None, None, 0.0) if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        if self.k_cache is not None and meta.block_tables is not None:
            out = qkv_paged_attention(qkv, positions, cos_sin, self.num_heads, self.num_kv_heads, *norms,
                                      self.k_cache, self.v_cache, meta, self.scale, self.window, self.sinks,
                                      k_scale=self.k_scale, v_scale=self.v_scale,
                                      rotary_at_lengths=self.rotary_at_lengths)
        else:
            q, k, v = qkv_prologue(qkv, positions, cos_sin, self.num_heads, self.num_kv_heads, *norms,
                                   self.k_cache, self.v_cache, meta.slot_mapping,
                                   k_scale=self.k_scale, v_scale=self.v_scale)
            out = varlen_attention(q, k, v, meta.cu_seqlens_q, meta.max_seqlen_q, self.scale, causal=True,
                                   window=self.window, sinks=self.sinks)
        return self.o_proj(out.reshape(x.shape[0], -1))

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """Lay the checkpoint's heads out as the kernels' (models/rotary.py): q and k rows (with their biases,
        FP8 scales and q/k norm weights) moved and padded, v rows and o_proj's columns padded with zeros."""
        if self.layout.is_identity:
            return
        qk, v = self.layout.qk_source, self.layout.v_source
        sources = [(self.num_heads, qk), (self.num_kv_heads, qk), (self.num_kv_heads, v)]
        proj = self.qkv_proj
        proj.weight.data = _placed(proj.weight.data, proj.output_sizes, sources)
        if proj.bias is not None:
            proj.bias.data = _placed(proj.bias.data, proj.output_sizes, sources)
        if proj.weight_scale is not None:
            proj.weight_scale.data = _placed(proj.weight_scale.data, proj.output_sizes, sources, fill=1.0)
        proj.output_sizes = [heads * self.head_dim for heads, _ in sources]
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.weight.data = norm.weight.data[qk.to(norm.weight.device)]
        if self.layout.padded != self.layout.head_dim:
            if self.o_proj.weight_scale is not None:
                self.o_proj.dequantize_weight()  # its K groups cannot take zero columns between them
            weight = self.o_proj.weight
            weight.data = place_head_rows(weight.data.T, self.num_heads, v).T.contiguous()


def _placed(rows: Tensor, sizes: list[int], sources: list[tuple[int, Tensor]], fill: float = 0.0) -> Tensor:
    parts = rows.split(sizes)
    return torch.cat([place_head_rows(part, heads, source, fill) for part, (heads, source) in zip(parts, sources)])


class MLP(nn.Module):
    def __init__(self, config, quant: Fp8Format | None):
        super().__init__()
        activation = getattr(config, "hidden_activation", None) or config.hidden_act
        if activation not in ACTIVATIONS:
            raise ValueError(f"hidden_act {activation!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = GateUpParallelLinear(config.hidden_size, config.intermediate_size, ACTIVATIONS[activation],
                                                 bias=bias, quant=quant)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias, quant=quant)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.gate_up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding, layout: HeadLayout, quant: Fp8Format | None,
                 window: int = 0, routed: bool = False):
        super().__init__()
        eps, offset = config.rms_norm_eps, norm_offset(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, offset)
        self.self_attn = Attention(config, rotary, layout, quant, window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, offset)
        self.mlp = MoeMLP(config) if routed else MLP(config, quant)
        self.post_block_norms = config.model_type in POST_BLOCK_NORM_MODEL_TYPES
        if self.post_block_norms:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset)

    def forward(
        self, positions: Tensor, x: Tensor, residual: Tensor | None, meta: AttentionMetadata,
        rope_positions: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """The residual stream is carried apart so each add fuses into the next norm: the layer returns its
        last block's output and the stream before it, added by the next layer's first norm (or the final one).
        Pre-norm blocks norm only their input; with post_block_norms (Gemma) each block's output is normed too
        (post_attention_layernorm after attention, then pre_feedforward_layernorm before the MLP)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta, rope_positions)
        if self.post_block_norms:
            x = self.post_attention_layernorm(x)
            x, residual = self.pre_feedforward_layernorm(x, residual)
            return self.post_feedforward_layernorm(self.mlp(x)), residual
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config, layout: HeadLayout, max_model_len: int, quant: Fp8Format | None):
        super().__init__()
        types = layer_types(config)
        rotaries = {kind: RotaryEmbedding(layout, max_model_len, rope_parameters(config, kind), max_model_len)
                    for kind in dict.fromkeys(types)}
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = None
        if config.model_type in SCALED_EMBEDDING_MODEL_TYPES:  # rounded to the model's dtype, as transformers does
            self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=torch.get_default_dtype()).item()
        self.layers = nn.ModuleList(DecoderLayer(config, rotaries[kind], layout, quant, window, is_moe_layer(config, i))
                                    for i, (kind, window) in enumerate(zip(types, layer_windows(config))))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, norm_offset(config))
        self.aux_layers: tuple[int, ...] = ()  # layers whose input aux_sink receives (set_aux_sink)
        self.aux_sink: Callable[[Tensor, Tensor], None] | None = None

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata,
                image_embeds: tuple[Tensor, Tensor] | None = None, rope_positions: Tensor | None = None) -> Tensor:
        x, residual = self.embed_tokens(input_ids), None
        if rope_positions is not None:  # each token's rotary row is its own (Attention.forward)
            positions = torch.arange(len(input_ids), device=input_ids.device)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if image_embeds is not None:  # (rows, their embeddings): an image's soft tokens, not scaled
            rows, embeds = image_embeds
            x = x.index_put((rows,), embeds.to(x.dtype))
        capture = self.aux_sink is not None and meta.slot_mapping is not None  # a step that fills the KV cache
        captured = {}
        for i, layer in enumerate(self.layers):
            if capture and i in self.aux_layers:
                captured[i] = x if residual is None else x + residual
            x, residual = layer(positions, x, residual, meta, rope_positions)
        if capture:
            self.aux_sink(torch.cat([captured[i] for i in self.aux_layers], dim=-1), meta.slot_mapping)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """Decoder with an LM head (tied to the embeddings when the config says so).

    hf_config: the checkpoint's config (a multimodal one's text_config is the decoder's; its quantization_config
    the weights'). with_lm_head=False builds the bare decoder (checkpoints saved as LlamaModel / Qwen3Model, such
    as embedding models): forward() works, compute_logits() does not. max_model_len: the longest sequence the
    engine runs (rotary tables cover it; LongRoPE picks its factors by it); the config's
    max_position_embeddings by default. fp8_gemm: the GEMM FP8 checkpoints run on Hopper (models/fp8.py).
    """

    # Checkpoint module name -> (our fused module, index of its slice).
    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, hf_config, with_lm_head: bool = True, max_model_len: int | None = None,
                 fp8_gemm: str = "scaled_mm"):
        super().__init__()
        config = hf_config.get_text_config()
        quant = fp8_format(hf_config, fp8_gemm)
        check_supported(hf_config)
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads // tp_size()  # this rank's
        layout = layout_of(config)
        self.head_dim = layout.padded
        self.kv_window = kv_window(layer_windows(config))
        max_model_len = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        self.model = LlamaModel(config, layout, max_model_len, quant)
        self.uses_mrope = self.model.layers[0].self_attn.rotary_emb.streams is not None  # M-RoPE: 3 position streams
        self.tie_word_embeddings = with_lm_head and bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size) if with_lm_head else None
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        if quant:
            self._keep_ignored_unquantized(quant)

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata,
                image_embeds: tuple[Tensor, Tensor] | None = None, rope_positions: Tensor | None = None) -> Tensor:
        """Hidden states [T, H] after the final norm, for the step's tokens packed as meta describes.
        image_embeds: (rows [R], embeddings [R, H]) that replace the token embeddings of those rows (the soft
        tokens of images, models/gemma3_vision.py, models/qwen2_5_vision.py). rope_positions: an M-RoPE model's
        [3, T] position streams, in place of positions (engine/mrope.py)."""
        return self.model(input_ids, positions, meta, image_embeds, rope_positions)

    def set_aux_sink(self, layers: tuple[int, ...], sink: Callable[[Tensor, Tensor], None] | None) -> None:
        """Hands the residual stream entering each of `layers` (concatenated in that order, [T, len(layers) H])
        and the step's KV-cache slots to sink(states, slot_mapping) at every forward that fills the cache (an
        EAGLE-3 draft head's inputs, engine/eagle3_drafter.py); None stops it."""
        self.model.aux_layers, self.model.aux_sink = tuple(layers), sink

    def compute_logits(self, hidden: Tensor) -> Tensor | None:
        """Logits [N, V] in the model's dtype for the hidden states of the N tokens that sample (None on
        tensor-parallel ranks other than 0: only rank 0 samples), soft-capped as cap * tanh(logits / cap) when
        the config sets final_logit_softcapping. The sampler reads them in float32 itself: a float32 copy of a
        batch's logits costs more than the sampling that most batches do."""
        if self.lm_head is None:
            raise ValueError("this checkpoint has no LM head (a bare decoder); it can embed but not generate")
        logits = self.lm_head(hidden)
        if self.final_logit_softcapping and logits is not None:
            logits = torch.tanh(logits / self.final_logit_softcapping) * self.final_logit_softcapping
        return logits

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

    def _keep_ignored_unquantized(self, quant: Fp8Format) -> None:
        """Projections the FP8 checkpoint lists as not converted (by their checkpoint names) keep its dtype."""
        parts = {}
        for name, (fused, index) in self.packed_modules.items():
            parts.setdefault(fused, {})[index] = name
        for path, module in self.named_modules():
            if not isinstance(module, ParallelLinear):
                continue
            parent, _, leaf = path.rpartition(".")
            names = [path] + [f"{parent}.{part}" for part in parts.get(leaf, {}).values()]
            ignored = {name for name in names[1:] if quant.is_ignored(name)}
            if quant.is_ignored(path) or (ignored and len(ignored) == len(names) - 1):
                module.keep_unquantized()
            elif ignored:
                raise ValueError(f"the FP8 checkpoint leaves {sorted(ignored)} unquantized but not the rest of "
                                 f"{path}, which we run as one projection: this mix is not supported")


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layout_of(config) -> HeadLayout:
    head_dim = head_dim_of(config)
    return head_layout(head_dim, rotary_dim(head_dim, rope_parameters(config, "full_attention")))


def layer_types(config) -> list[str]:
    """Each layer's kind ("full_attention", "sliding_attention"): what picks its rope settings (Gemma 3's
    differ) and its window."""
    types = getattr(config, "layer_types", None)
    if types is None:
        return ["full_attention"] * config.num_hidden_layers
    return list(types)


def layer_windows(config) -> list[int]:
    """Each layer's sliding window (0: full attention) as transformers reads the config: with layer_types
    (Qwen2/Qwen3 from use_sliding_window and max_window_layers, Gemma 3, gpt-oss), the "sliding_attention"
    layers have config.sliding_window; without (Mistral, Phi-3), every layer has it, when it is set."""
    window = getattr(config, "sliding_window", None) or 0
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return [window] * config.num_hidden_layers
    return [window if layer_type == "sliding_attention" else 0 for layer_type in layer_types]


def kv_window(windows: list[int]) -> int:
    """The window beyond which no layer reads a key (0 when some layer attends to everything): KV blocks wholly
    before a request's last kv_window positions are never read again."""
    return 0 if not windows or 0 in windows else max(windows)


def check_supported(hf_config) -> None:
    """Refuse configs this module would compute wrongly (rope types, activations and FP8 formats are checked
    where used)."""
    config = hf_config.get_text_config()
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        unknown = sorted(set(layer_types) - set(LAYER_TYPES))
        if unknown or len(layer_types) != config.num_hidden_layers:
            raise ValueError(f"layer_types {unknown or layer_types} are not supported: each of the "
                             f"{config.num_hidden_layers} layers must be one of {', '.join(LAYER_TYPES)}")
        if "sliding_attention" in layer_types and not getattr(config, "sliding_window", None):
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=true (an encoder, not a causal decoder) is not supported")
    if getattr(config, "attn_logit_softcapping", None):
        raise ValueError("attention logit soft-capping (attn_logit_softcapping) is not supported")
    layout = layout_of(config)
    if config.model_type in QK_NORM_MODEL_TYPES and layout.padded != layout.head_dim:
        raise ValueError(f"q/k norms over a head of {layout.head_dim} dimensions (not a power of two) are not "
                         "supported")
    check_tensor_parallel(hf_config, tp_size())
    if any(is_moe_layer(config, i) for i in range(config.num_hidden_layers)):
        if fp8_format(hf_config):
            raise ValueError("FP8 checkpoints of mixture-of-experts models are not supported")
        check_moe_tensor_parallel(config, tp_size())


def check_tensor_parallel(hf_config, size: int) -> None:
    """Each of `size` ranks must get a whole number of query heads, KV heads and MLP features, and an FP8
    checkpoint's weight blocks whole along K (the inputs of o_proj and down_proj are split)."""
    config = hf_config.get_text_config()
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name)
        if value % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide the model's {name}={value}: pick a "
                             f"tensor-parallel size that divides {name}")
    quant = fp8_format(hf_config)
    if size == 1 or not quant or not quant.block:
        return
    for name, features in (("o_proj", config.num_attention_heads * head_dim_of(config)),
                           ("down_proj", config.intermediate_size)):
        if features // size % quant.block[1]:
            raise ValueError(f"tensor_parallel_size={size} splits the FP8 weight blocks of {name}: its "
                             f"{features} input features / {size} is not a multiple of the block's "
                             f"{quant.block[1]} columns; pick a tensor-parallel size that keeps blocks whole")
