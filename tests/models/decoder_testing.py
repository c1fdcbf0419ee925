"""Tiny random decoders saved as transformers checkpoints, and helpers to drive our models step by step."""

import torch
from transformers import (
    Gemma3Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    SiglipVisionConfig,
)

from kernels import AttentionMetadata
from random_decoders import save_random_decoder

COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.2,
)
NO_SPECIAL_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)  # Phi-3's defaults lie outside
CONFIGS = {
    "llama-gqa": lambda: LlamaConfig(
        **COMMON, num_key_value_heads=2, architectures=["LlamaForCausalLM"],
        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32},
    ),
    "qwen2": lambda: Qwen2Config(
        **COMMON, num_key_value_heads=1, tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"]
    ),
    "qwen3": lambda: Qwen3Config(
        **COMMON, num_key_value_heads=2, head_dim=32, architectures=["Qwen3ForCausalLM"]
    ),
    # Windows shorter than the tests' prompts: every layer (Mistral), the layers from max_window_layers (Qwen2).
    "mistral-window": lambda: MistralConfig(
        **COMMON, num_key_value_heads=2, sliding_window=5, architectures=["MistralForCausalLM"]
    ),
    "qwen2-window": lambda: Qwen2Config(
        **COMMON, num_key_value_heads=2, use_sliding_window=True, sliding_window=6, max_window_layers=1,
        architectures=["Qwen2ForCausalLM"]
    ),
    # Heads of 24 dimensions (padded to 32), 12 of them rotated; LongRoPE's short factors (the sequences fit
    # the original context) with its attention factor from `factor`.
    "phi3-longrope": lambda: Phi3Config(
        **{**COMMON, "hidden_size": 96, "max_position_embeddings": 64}, **NO_SPECIAL_TOKENS,
        num_key_value_heads=2, partial_rotary_factor=0.5, original_max_position_embeddings=64,
        architectures=["Phi3ForCausalLM"],
        rope_scaling={"rope_type": "longrope", "factor": 4.0, "short_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0],
                      "long_factor": [2.0] * 6},
    ),
    # Heads of 16 dimensions, 12 rotated: a permutation, no padding.
    "phi3-partial": lambda: Phi3Config(
        **COMMON, **NO_SPECIAL_TOKENS, num_key_value_heads=4, partial_rotary_factor=0.75,
        architectures=["Phi3ForCausalLM"],
    ),
    "gemma3": lambda: gemma3_text(final_logit_softcapping=3.0, architectures=["Gemma3ForCausalLM"]),
    # The text decoder of a multimodal checkpoint (names under model.language_model).
    "gemma3-multimodal": lambda: Gemma3Config(
        text_config=gemma3_text().to_dict(), mm_tokens_per_image=4,
        vision_config=SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, image_size=28, patch_size=14).to_dict(),
        architectures=["Gemma3ForConditionalGeneration"], **NO_SPECIAL_TOKENS,
    ),
}


def gemma3_text(**overrides) -> Gemma3TextConfig:
    """Local layers (a window of 5, shorter than the tests' prompts) around a global one, each kind with its own
    rope base (the global one scaled), and an attention scale from query_pre_attn_scalar, not head_dim."""
    return Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 3}, **NO_SPECIAL_TOKENS, num_key_value_heads=2,
                            head_dim=32, sliding_window=5, sliding_window_pattern=2, query_pre_attn_scalar=20,
                            rope_theta=1000.0, rope_local_base_freq=50.0,
                            rope_scaling={"rope_type": "linear", "factor": 2.0}, **overrides)


def save_tiny_model(name: str, path, **save_kwargs):
    """A random transformers model of the named family saved under `path`; returns the transformers model."""
    return save_random_decoder(CONFIGS[name](), path, **save_kwargs)


def varlen_metadata(lengths: list[int]) -> AttentionMetadata:
    """Cacheless prefill of whole sequences packed back to back."""
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.full((sum(lengths),), -1, dtype=torch.int64),
        cu_seqlens_q=cu,
        seq_lens=torch.tensor(lengths, dtype=torch.int32),
        block_tables=None,
        max_seqlen_q=max(lengths),
        max_seqlen_k=max(lengths),
        is_decode=False,
    )


def paged_step(
    chunks: list[tuple[int, int]], block_tables: list[list[int]], block_size: int
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata and positions for one step: chunks[b] = (num_cached, num_new) of sequence b."""
    slots, positions = [], []
    for (cached, new), table in zip(chunks, block_tables):
        for p in range(cached, cached + new):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
    width = max(len(t) for t in block_tables)
    q_lens = [new for _, new in chunks]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        cu_seqlens_q=torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n in chunks], dtype=torch.int32),
        block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in block_tables], dtype=torch.int32),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(c + n for c, n in chunks),
        is_decode=all(n == 1 for n in q_lens),
    )
    return meta, torch.tensor(positions, dtype=torch.int64)


def attach_kv_cache(model, num_blocks: int, block_size: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Zeroed per-layer K and V caches set on the model (as the engine's model runner does)."""
    shape = model.kv_cache_shape(num_blocks, block_size)[1:]
    k_caches = [torch.zeros(shape) for _ in range(model.num_layers)]
    v_caches = [torch.zeros(shape) for _ in range(model.num_layers)]
    model.set_kv_cache(k_caches, v_caches)
    return k_caches, v_caches


@torch.no_grad()
def assert_paged_steps_match(model, reference) -> None:
    """Logits of a cacheless 14-token prefill, then of paged steps (prompt chunks, then decodes of two sequences,
    blocks of 4), equal the transformers reference's forward."""
    attach_kv_cache(model, num_blocks=16, block_size=4)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, reference.config.vocab_size, (n,), generator=generator) for n in (14, 6)]
    tables = [[9, 2, 12, 5], [7, 0]]
    expected = [reference(p[None]).logits[0] for p in prompts]
    hidden = model(prompts[0], torch.arange(14), varlen_metadata([14]))
    torch.testing.assert_close(model.compute_logits(hidden), expected[0], atol=1e-4, rtol=1e-4)
    for chunks in ([(0, 5)], [(5, 6), (0, 5)], [(11, 1), (5, 1)], [(12, 2)]):
        meta, positions = paged_step(chunks, tables[: len(chunks)], 4)
        ids = torch.cat([prompts[b][c : c + n] for b, (c, n) in enumerate(chunks)])
        want = torch.cat([expected[b][c : c + n] for b, (c, n) in enumerate(chunks)])
        torch.testing.assert_close(model.compute_logits(model(ids, positions, meta)), want, atol=1e-4, rtol=1e-4)
