"""The FP8 (e4m3) KV cache end to end: greedy tokens equal transformers' with an attention that rounds every key and
value through e4m3 with the engine's scales, also with prefix-cache hits, chunked prefill and preemption; the
scales come from the checkpoint when it has them and from calibration otherwise; the pool holds twice the tokens
of a 16-bit one; the setting is read from the environment."""
import copy

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from engine import LLM, EngineConfig, SamplingParams
from engine.kv_cache import CALIBRATION_TOKENS, KV_SCALE_MARGIN, kv_amax
from kernels.reference import quantize_kv

LENGTHS = [3, 17, 33, 50]
NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW)


def _e4m3_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention over keys and values [B, n_kv, L, D] stored and read as the FP8 cache does:
    quantize_kv with the layer's scales, times the scales again."""
    k_scale, v_scale = module.e4m3_scales

    def round_trip(x, scale):
        stored = quantize_kv(x.transpose(1, 2).flatten(0, 1), scale).view(x.shape[0], x.shape[2], x.shape[1], -1)
        return (stored.float() * scale[:, None]).transpose(1, 2).to(x.dtype)

    return sdpa_attention_forward(module, query, round_trip(key, k_scale), round_trip(value, v_scale),
                                  attention_mask, **kwargs)


AttentionInterface.register("e4m3_kv_reference", _e4m3_attention)
AttentionMaskInterface.register("e4m3_kv_reference", sdpa_mask)  # SDPA's masks, sliding windows included


def fp8_reference(hf_model, k_scales, v_scales):
    """A copy of the transformers model whose attention rounds keys and values through e4m3 with the given
    per-layer scales [num_layers, n_kv]."""
    model = copy.deepcopy(hf_model)
    model.set_attn_implementation("e4m3_kv_reference")
    for layer, k_scale, v_scale in zip(model.model.layers, k_scales, v_scales):
        layer.self_attn.e4m3_scales = (k_scale, v_scale)
    return model


@torch.inference_mode()
def reference_greedy(model, prompt, max_new_tokens=NEW):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                         min_new_tokens=max_new_tokens, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def engine_scales(llm):
    """The engine's key and value scales [num_layers, n_kv], on the CPU."""
    layers = llm.core.runner.model.model.layers
    return (torch.stack([layer.self_attn.k_scale for layer in layers]).cpu(),
            torch.stack([layer.self_attn.v_scale for layer in layers]).cpu())


def generated(llm, prompts, params=GREEDY):
    return [out["token_ids"] for out in llm.generate(prompts, params)]


def test_greedy_matches_transformers_with_the_same_rounding(tiny_model, prompts_of_lengths):
    """Calibrated scales; the tokens also differ from unrounded transformers' somewhere, so the rounding is real."""
    prompts = prompts_of_lengths(LENGTHS)
    llm = LLM(tiny_model.path, dtype="float32", kv_cache_dtype="fp8")
    attention = llm.core.runner.model.model.layers[0].self_attn
    assert attention.k_cache.dtype == torch.float8_e4m3fn and attention.v_cache.dtype == torch.float8_e4m3fn
    reference = fp8_reference(tiny_model.hf_model, *engine_scales(llm))
    ours = generated(llm, prompts)
    assert ours == [reference_greedy(reference, prompt) for prompt in prompts]
    assert ours != [tiny_model.greedy(prompt, NEW) for prompt in prompts]
    stats = llm.core.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_prefix_hits_chunked_prefill_and_preemption_keep_the_tokens(tiny_llama, prompts_of_lengths):
    """Blocks written by one request and read by the next, prompts cut into chunks of 8 tokens, and requests
    preempted and recomputed: every engine calibrates the same scales, and its tokens are the reference's."""
    shared = prompts_of_lengths([40], seed=5)[0]
    prompts = prompts_of_lengths(LENGTHS) + [shared + tail for tail in prompts_of_lengths([1, 9, 20], seed=6)]
    llm = LLM(tiny_llama.path, dtype="float32", kv_cache_dtype="fp8")
    reference = fp8_reference(tiny_llama.hf_model, *engine_scales(llm))
    expected = [reference_greedy(reference, prompt) for prompt in prompts]
    generated(llm, prompts[-1:])
    hits = llm.core.block_manager.num_hit_tokens
    assert generated(llm, prompts) == expected
    assert llm.core.block_manager.num_hit_tokens - hits >= 3 * 32  # the shared prefix's two full blocks
    chunked = LLM(tiny_llama.path, dtype="float32", kv_cache_dtype="fp8", max_num_batched_tokens=8)
    preempting = LLM(tiny_llama.path, dtype="float32", kv_cache_dtype="fp8", num_kv_blocks=7)
    for other in (chunked, preempting):
        assert all(torch.equal(a, b) for a, b in zip(engine_scales(other), engine_scales(llm)))
        assert generated(other, prompts) == expected
    assert preempting.core.scheduler.num_preemptions > 0


def with_kv_scales(source, tmp_path, scales: dict) -> str:
    """A copy of the checkpoint at `source` with extra tensors {name: tensor}."""
    import shutil

    path = tmp_path / "checkpoint"
    shutil.copytree(source, path)
    weights = load_file(path / "model.safetensors")
    save_file({**weights, **scales}, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


def scale_names(style: str, layer: int) -> dict:
    prefix = f"model.layers.{layer}.self_attn."
    return {"compressed-tensors": {"k": prefix + "k_scale", "v": prefix + "v_scale"},
            "modelopt": {"k": prefix + "k_proj.k_scale", "v": prefix + "v_proj.v_scale"},
            "output": {"k": prefix + "k_proj.output_scale", "v": prefix + "v_proj.output_scale"},
            "kv": {"kv": prefix + "kv_scale"}}[style]


@pytest.mark.parametrize("style", ["compressed-tensors", "modelopt", "output", "kv"])
def test_checkpoint_scales_are_used(tiny_llama, prompts_of_lengths, tmp_path, style):
    """Scalar and per-head checkpoint scales (not powers of two) under each naming: the engine's scales are the
    checkpoint's, its tokens the reference's with them; query scales are skipped; a 16-bit cache ignores them."""
    per_layer = [(torch.tensor(0.3), torch.tensor([0.7, 1.9])), (torch.tensor([0.45]), torch.tensor(0.55))]
    extra = {}
    for layer, (k, v) in enumerate(per_layer):
        names = scale_names(style, layer)
        extra.update({names["kv"]: k} if style == "kv" else {names["k"]: k, names["v"]: v})
        extra[f"model.layers.{layer}.self_attn.q_scale"] = torch.tensor(1.0)
    path = with_kv_scales(tiny_llama.path, tmp_path, extra)
    llm = LLM(path, dtype="float32", kv_cache_dtype="fp8")
    k_scales, v_scales = engine_scales(llm)
    expected_k = torch.stack([k.float().expand(2) for k, _ in per_layer])
    expected_v = expected_k if style == "kv" else torch.stack([v.float().expand(2) for _, v in per_layer])
    assert torch.equal(k_scales, expected_k) and torch.equal(v_scales, expected_v)
    prompts = prompts_of_lengths(LENGTHS)
    reference = fp8_reference(tiny_llama.hf_model, k_scales, v_scales)
    assert generated(llm, prompts) == [reference_greedy(reference, prompt) for prompt in prompts]
    plain = LLM(path, dtype="float32")
    assert generated(plain, prompts[:2]) == [tiny_llama.greedy(prompt, NEW) for prompt in prompts[:2]]


@pytest.mark.parametrize("scales, message", [
    ({"model.layers.0.self_attn.k_scale": torch.tensor(0.5), "model.layers.0.self_attn.v_scale": torch.tensor(0.5)},
     "none for layer 1's keys"),
    ({f"model.layers.{i}.self_attn.kv_scale": torch.tensor([0.5, 0.5, 0.5]) for i in range(2)},
     r"3 scales; expected 1 or one per KV head \(2\)"),
    ({f"model.layers.{i}.self_attn.kv_scale": torch.tensor(-1.0) for i in range(2)}, "positive finite"),
])
def test_bad_checkpoint_scales_are_refused(tiny_llama, tmp_path, scales, message):
    path = with_kv_scales(tiny_llama.path, tmp_path, scales)
    with pytest.raises(ValueError, match=message):
        LLM(path, dtype="float32", kv_cache_dtype="fp8")


def test_calibrated_scales(tiny_model):
    """One power of two per layer (all KV heads share it) between KV_SCALE_MARGIN and twice that times the
    layer's largest |k| (|v|) over 448; the calibration's temporary cache is detached afterwards."""
    llm = LLM(tiny_model.path, dtype="float32", kv_cache_dtype="fp8")
    model = llm.core.runner.model
    k_scales, v_scales = engine_scales(llm)
    k_amax, v_amax = (amax.cpu() for amax in kv_amax(model, 16, min(CALIBRATION_TOKENS, llm.core.runner.max_model_len)))
    assert all(layer.self_attn.k_cache is None for layer in model.model.layers)
    for scales, amax in ((k_scales, k_amax), (v_scales, v_amax)):
        assert scales.dtype == torch.float32 and (scales == scales[:, :1]).all()
        assert torch.equal(scales, torch.exp2(torch.log2(scales).round()))
        ratio = scales[:, 0] * 448 / amax.amax(1)
        assert ((ratio >= KV_SCALE_MARGIN) & (ratio < 2 * KV_SCALE_MARGIN)).all()


def test_pool_holds_twice_the_tokens_of_a_16_bit_cache(tiny_llama):
    budget = {"device": "cpu", "dtype": "bfloat16", "cpu_kv_cache_gb": 2**-10}  # 1 MiB: binds before max_num_seqs
    blocks = LLM(tiny_llama.path, **budget).core.runner.num_blocks
    assert LLM(tiny_llama.path, kv_cache_dtype="fp8", **budget).core.runner.num_blocks == 2 * blocks


def test_environment_variable():
    assert EngineConfig.from_env("/m", {"HFENDPOINT_KV_CACHE_DTYPE": "fp8"}).kv_cache_dtype == "fp8"
    config = EngineConfig("/m", device="cpu")
    assert config.kv_cache_dtype == "auto" and config.kv_cache_torch_dtype == torch.float32
    assert EngineConfig("/m", device="cpu", kv_cache_dtype="fp8").kv_cache_torch_dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="HFENDPOINT_KV_CACHE_DTYPE.*one of auto, fp8"):
        EngineConfig.from_env("/m", {"HFENDPOINT_KV_CACHE_DTYPE": "int8"})
