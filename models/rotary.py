"""Rotary position embeddings: the config's rope settings, the cos|sin table the kernels read, and the head
layout that lets rotary over part of a head (and heads whose size is not a power of two) run through the
same kernels.

The kernels rotate NeoX style over a whole head of a power-of-two size P, pairing dimension i with i + P/2
and reading cos and sin for pair i from the table. A checkpoint's head of D dimensions rotates only its first
R = D * partial_rotary_factor, pairing i with i + R/2. HeadLayout maps the checkpoint's q/k rows onto a head
of P = next power of two >= D: rotary pair (i, i + R/2) to (i, i + P/2), the D - R pass-through dimensions to
the remaining slots of each half, zero rows in whatever is left. The table gives the pass-through slots
cos = 1 and sin = 0, so rotating leaves them as they are. Scores q.k are sums over dimensions, unchanged when
q and k move their dimensions the same way; v keeps its order and pads with zeros, which o_proj's zero
columns ignore.
"""

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The rope settings as one dict with rope_type, rope_theta and partial_rotary_factor (transformers 5 and 4
    store them differently; Gemma 3 keeps one dict per layer type), plus max_position_embeddings."""
    params = getattr(config, "rope_parameters", None)
    local_theta = getattr(config, "rope_local_base_freq", None)
    if params is None and layer_type == "sliding_attention" and local_theta:  # transformers 4's Gemma 3
        params = {"rope_type": "default", "rope_theta": local_theta}
    elif params is None:  # transformers 4
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    elif layer_type in params:
        params = params[layer_type]
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    params.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    params.setdefault("original_max_position_embeddings",
                      getattr(config, "original_max_position_embeddings", None) or config.max_position_embeddings)
    params["max_position_embeddings"] = config.max_position_embeddings
    return params


def rotary_dim(head_dim: int, params: dict) -> int:
    dim = int(head_dim * params["partial_rotary_factor"])
    if dim % 2 or not 0 < dim <= head_dim:
        raise ValueError(f"partial_rotary_factor={params['partial_rotary_factor']} gives {dim} rotary dimensions "
                         f"of a {head_dim}-dimension head; it must give an even number between 2 and {head_dim}")
    return dim


def inverse_frequencies(dim: int, params: dict, max_model_len: int) -> tuple[Tensor, float]:
    """Rotary inverse frequencies [dim / 2] over `dim` rotated dimensions, rescaled as the config's rope_type
    says, and the factor transformers multiplies cos and sin by (longrope's attention factor; 1 otherwise)."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if rope_type == "longrope":
        return longrope_inverse_frequencies(exponents, params, max_model_len)
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        return llama3_inverse_frequencies(inv_freq, params), 1.0
    if rope_type == "yarn":
        return yarn_inverse_frequencies(inv_freq, params, dim)
    return inv_freq, 1.0


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


def yarn_inverse_frequencies(inv_freq: Tensor, params: dict, dim: int) -> tuple[Tensor, float]:
    """YaRN (gpt-oss): frequencies that turn more than beta_fast times over the original context are kept,
    those that turn fewer than beta_slow times are slowed by `factor`, with a linear ramp over the rotary pairs
    between (their bounds rounded outwards unless truncate is false); cos and sin scale by the attention factor,
    0.1 ln(factor) + 1 unless the config sets it (or its mscale / mscale_all_dim ratio)."""
    original, theta = params["original_max_position_embeddings"], params["rope_theta"]
    factor = params.get("factor") or params["max_position_embeddings"] / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim) if (
            mscale and mscale_all_dim) else _yarn_mscale(factor)

    def pair_turning(rotations: float) -> float:  # the rotary pair whose frequency turns that often
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_turning(params.get("beta_fast") or 32), pair_turning(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    slowed = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    return inv_freq / factor * slowed + inv_freq * (1 - slowed), attention_factor


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def longrope_inverse_frequencies(exponents: Tensor, params: dict, max_model_len: int) -> tuple[Tensor, float]:
    """Phi-3's LongRoPE: each frequency divided by its own factor, the short set or the long one.

    transformers picks the set by the length of the sequence being computed (positions 0..n-1): short while n
    is at most original_max_position_embeddings, long beyond it, recomputing the whole cache with the long
    set when generation crosses that length. A paged cache keeps keys once computed, so the engine picks one
    set for every request as vLLM does: long when a request can be longer than the original context
    (max_model_len above it), else short. Requests that fit equal transformers' output either way when
    max_model_len is at most the original context; above it, requests longer than the original context do.
    """
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or params["max_position_embeddings"] / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    chosen = params["long_factor"] if max_model_len > original else params["short_factor"]
    if len(chosen) != len(exponents):
        raise ValueError(f"longrope: {len(chosen)} factors for {len(exponents)} rotary frequencies")
    return 1.0 / (torch.tensor(chosen, dtype=torch.float32) * params["rope_theta"] ** exponents), attention_factor


@dataclass(frozen=True)
class HeadLayout:
    """Where a checkpoint head's D dimensions go in the kernels' head of `padded` dimensions (see the module
    docstring). qk_source[j] / v_source[j]: the checkpoint dimension in slot j, or -1 for a zero slot."""

    head_dim: int
    rotary: int
    padded: int

    @property
    def is_identity(self) -> bool:
        return self.padded == self.head_dim == self.rotary

    @property
    def qk_source(self) -> Tensor:
        half, rot_half = self.padded // 2, self.rotary // 2
        passing = self.head_dim - self.rotary
        source = torch.full((self.padded,), -1, dtype=torch.int64)
        source[:rot_half] = torch.arange(rot_half)
        source[half:half + rot_half] = torch.arange(rot_half, self.rotary)
        source[rot_half:rot_half + passing // 2] = torch.arange(self.rotary, self.rotary + passing // 2)
        source[half + rot_half:half + rot_half + passing - passing // 2] = torch.arange(
            self.rotary + passing // 2, self.head_dim)
        return source

    @property
    def v_source(self) -> Tensor:
        source = torch.full((self.padded,), -1, dtype=torch.int64)
        source[:self.head_dim] = torch.arange(self.head_dim)
        return source


def head_layout(head_dim: int, rotary: int) -> HeadLayout:
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} is odd: rotary embeddings need an even head size")
    return HeadLayout(head_dim, rotary, 1 << (head_dim - 1).bit_length())


def place_head_rows(rows: Tensor, num_heads: int, source: Tensor, fill: float = 0.0) -> Tensor:
    """rows [num_heads * D, ...] laid out per head as `source` says: [num_heads * len(source), ...], `fill`
    in the slots that no checkpoint dimension goes to."""
    heads = rows.reshape(num_heads, -1, *rows.shape[1:])
    placed = heads.new_full((num_heads, len(source), *rows.shape[1:]), fill)
    kept = source >= 0
    placed[:, kept.to(rows.device)] = heads[:, source[kept].to(rows.device)]
    return placed.reshape(-1, *rows.shape[1:])


def mrope_streams(layout: HeadLayout, sections: list[int]) -> Tensor:
    """M-RoPE (Qwen2-VL, Qwen2.5-VL): which of the three position streams (temporal, height, width) each column of
    the cos|sin table reads. mrope_section splits the rotary frequencies into consecutive runs, the i-th read by
    stream i % 3, as transformers recomposes them; pass-through columns read stream 0 (their cos 1, sin 0)."""
    if sum(sections) != layout.rotary // 2:
        raise ValueError(f"mrope_section {list(sections)} sums to {sum(sections)}; it must split the "
                         f"{layout.rotary // 2} rotary frequencies of a {layout.head_dim}-dimension head")
    streams = torch.zeros(layout.padded // 2, dtype=torch.int64)
    streams[:layout.rotary // 2] = torch.repeat_interleave(torch.arange(len(sections)) % 3, torch.tensor(sections))
    return torch.cat((streams, streams))


class RotaryEmbedding(nn.Module):
    """Holds cos_sin_cache [max_positions, P] = cat(cos, sin) in float32 for a head laid out as `layout`
    says; one instance per rope setting, shared by the layers that use it. With mrope_section in the rope
    settings, streams says which position stream each column reads (mrope_rows)."""

    def __init__(self, layout: HeadLayout, max_positions: int, params: dict, max_model_len: int):
        super().__init__()
        inv_freq, attention_factor = inverse_frequencies(layout.rotary, params, max_model_len)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        pad = (0, layout.padded // 2 - len(inv_freq))
        cos = nn.functional.pad(freqs.cos() * attention_factor, pad, value=1.0)
        sin = nn.functional.pad(freqs.sin() * attention_factor, pad, value=0.0)
        self.register_buffer("cos_sin_cache", torch.cat((cos, sin), dim=-1), persistent=False)
        sections = params.get("mrope_section")
        self.register_buffer("streams", mrope_streams(layout, sections) if sections else None, persistent=False)

    def mrope_rows(self, positions: Tensor) -> Tensor:
        """A cos|sin row [T, P] per token of positions [3, T] (its temporal, height and width positions), each
        column read at the stream's position that streams names: a table the kernels index by row."""
        return self.cos_sin_cache.gather(0, positions[self.streams].T)
