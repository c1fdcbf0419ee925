"""Our decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 3 families) against transformers' forward on
identical weights, with and without a KV cache."""

import pytest
import torch
from decoder_testing import CONFIGS, attach_kv_cache, paged_step, save_tiny_model, varlen_metadata

from models.registry import load_model

CPU = torch.device("cpu")
TOLERANCE = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    reference = save_tiny_model(request.param, path)
    return path, reference


def reference_logits(reference, prompt: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return reference(prompt[None]).logits[0]


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator) for n in lengths]


@torch.no_grad()
def test_varlen_batch_matches_transformers(checkpoint):
    path, reference = checkpoint
    loaded = load_model(str(path), torch.float32, CPU)
    assert loaded.kind == "decoder" and loaded.model_dir == str(path)
    lengths = [7, 1, 13, 4]
    vocab_size = reference.config.get_text_config().vocab_size
    prompts = random_prompts(lengths, vocab_size)
    positions = torch.cat([torch.arange(n) for n in lengths])
    hidden = loaded.model(torch.cat(prompts), positions, varlen_metadata(lengths))
    logits = loaded.model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (sum(lengths), vocab_size)
    expected = torch.cat([reference_logits(reference, p) for p in prompts])
    torch.testing.assert_close(logits, expected, **TOLERANCE)


@torch.no_grad()
def test_paged_prefix_chunk_and_decode_match_full_forward(checkpoint):
    """Two sequences in non-contiguous blocks: prefill a prefix, then a chunk next to a decode, then decodes."""
    path, reference = checkpoint
    model = load_model(str(path), torch.float32, CPU).model
    block_size = 4
    attach_kv_cache(model, num_blocks=16, block_size=block_size)
    prompts = random_prompts([14, 6], reference.config.get_text_config().vocab_size, seed=2)
    tables = [[9, 2, 12, 5], [7, 0]]
    # (num_cached, num_new) per sequence and step; sequence 1 joins at step 2 and decodes from step 3.
    steps = [
        [(0, 5)],
        [(5, 6), (0, 5)],
        [(11, 1), (5, 1)],
        [(12, 2)],
    ]
    expected = [reference_logits(reference, p) for p in prompts]
    for chunks in steps:
        meta, positions = paged_step(chunks, tables[: len(chunks)], block_size)
        input_ids = torch.cat([prompts[b][c : c + n] for b, (c, n) in enumerate(chunks)])
        logits = model.compute_logits(model(input_ids, positions, meta))
        want = torch.cat([expected[b][c : c + n] for b, (c, n) in enumerate(chunks)])
        torch.testing.assert_close(logits, want, **TOLERANCE)


@torch.no_grad()
def test_cache_attached_but_no_block_tables_runs_cacheless_and_stores(checkpoint):
    """A whole-prompt prefill with block_tables None attends over its own tokens and still fills the cache."""
    path, reference = checkpoint
    model = load_model(str(path), torch.float32, CPU).model
    k_caches, _ = attach_kv_cache(model, num_blocks=4, block_size=8)
    prompt = random_prompts([6], reference.config.get_text_config().vocab_size, seed=3)[0]
    meta, positions = paged_step([(0, 6)], [[3]], 8)
    meta.block_tables = None
    logits = model.compute_logits(model(prompt, positions, meta))
    torch.testing.assert_close(logits, reference_logits(reference, prompt), **TOLERANCE)
    assert k_caches[0][3, :6].abs().sum() > 0 and k_caches[0][3, 6:].abs().sum() == 0
    assert k_caches[0][:3].abs().sum() == 0


def test_sharded_checkpoint_loads_identically(checkpoint, tmp_path):
    path, reference = checkpoint
    reference.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    single = load_model(str(path), torch.float32, CPU).model.state_dict()
    sharded = load_model(str(tmp_path), torch.float32, CPU).model.state_dict()
    assert single.keys() == sharded.keys()
    for name in single:
        assert torch.equal(single[name], sharded[name]), name


def test_kv_cache_shape_and_sizes(checkpoint):
    path, reference = checkpoint
    model = load_model(str(path), torch.float32, CPU).model
    config = reference.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    head_dim = 1 << (head_dim - 1).bit_length()  # the kernels' heads: padded to a power of two
    assert model.kv_cache_shape(10, 16) == (config.num_hidden_layers, 10, 16, config.num_key_value_heads, head_dim)
    with pytest.raises(ValueError, match=f"expected {config.num_hidden_layers} K and V caches"):
        model.set_kv_cache([], [])


def test_bfloat16_load_casts_parameters(checkpoint):
    path, _ = checkpoint
    model = load_model(str(path), torch.bfloat16, CPU).model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.layers[0].self_attn.rotary_emb.cos_sin_cache.dtype == torch.float32
