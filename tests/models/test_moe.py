"""The routed MLP (models/moe.py) against transformers' own blocks (Qwen3MoeSparseMoeBlock, GptOssMLP) on tiny
random configs, each loaded from a transformers checkpoint through our weight loaders: on the CPU reference
kernels, through the Triton kernels (interpreted on a CPU), split across two tensor-parallel ranks, and for
gpt-oss from MXFP4 expert weights."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from moe_testing import gpt_oss_config, mxfp4_experts, qwen3_moe_config, save_mxfp4_decoder
from torch import nn

import kernels
from models.loader import iterate_safetensors, load_weights
from models.moe import (
    MoeMLP,
    check_moe_tensor_parallel,
    is_moe_layer,
    moe_checkpoint_target,
)
from random_decoders import save_random_decoder

CONFIGS = {
    "qwen3_moe": qwen3_moe_config,
    "qwen3_moe-softmax-over-all": lambda: qwen3_moe_config(norm_topk_prob=False, num_experts_per_tok=3),
    "qwen3_moe-top1": lambda: qwen3_moe_config(num_experts_per_tok=1),
    "qwen3_moe-top8": lambda: qwen3_moe_config(num_experts_per_tok=8),
    "gpt_oss": gpt_oss_config,
}


class OneMoeLayer(nn.Module):
    """Just layer 0's routed MLP, under the name a decoder gives it (model.layers.0.mlp), for load_weights."""
    packed_modules: dict = {}
    tie_word_embeddings = False

    def __init__(self, config):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([nn.Module()])
        self.model.layers[0].mlp = MoeMLP(config)

    @property
    def mlp(self) -> MoeMLP:
        return self.model.layers[0].mlp


def layer_weights(weights):
    return ((name, tensor) for name, tensor in weights if name.startswith("model.layers.0.mlp."))


def load_moe_layer(config, path) -> OneMoeLayer:
    layer = OneMoeLayer(config)
    load_weights(layer, layer_weights(iterate_safetensors(str(path), lazy=True)), source=str(path))
    return layer


def transformers_block(reference):
    block = reference.model.layers[0].mlp

    def forward(x):
        out = block(x[None])
        return (out[0] if isinstance(out, tuple) else out)[0]  # GptOssMLP also returns its router scores

    return forward


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (config, transformers model, checkpoint directory), saved once per module."""
    saved = {}

    def get(name):
        if name not in saved:
            config = CONFIGS[name]()
            path = tmp_path_factory.mktemp(name)
            saved[name] = (config, save_random_decoder(config, path), path)
        return saved[name]

    return get


@pytest.mark.parametrize("name", list(CONFIGS))
def test_moe_layer_matches_transformers(checkpoints, name):
    config, reference, path = checkpoints(name)
    layer = load_moe_layer(config, path)
    x = torch.randn(13, config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(layer.mlp(x), transformers_block(reference)(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_tokens", [1, 9])  # routed directly, and sorted by expert
@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_moe_layer_through_triton_kernels_matches_reference(checkpoints, name, num_tokens, monkeypatch):
    """The fused Triton path (on a GPU, or interpreted on a CPU) equals the CPU reference path."""
    pytest.importorskip("triton")
    config, _, path = checkpoints(name)
    layer = load_moe_layer(config, path)
    x = torch.randn(num_tokens, config.hidden_size)
    with torch.no_grad():
        expected = layer.mlp(x)
    torch.testing.assert_close(through_triton_kernels(layer, x, monkeypatch), expected, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def through_triton_kernels(layer: OneMoeLayer, x: torch.Tensor, monkeypatch) -> torch.Tensor:
    """The layer's output on the Triton kernels: on the GPU, or interpreted on the CPU tensors."""
    if torch.cuda.is_available():
        return layer.cuda().mlp(x.cuda()).cpu()
    triton_backend = kernels._backend("cuda")
    monkeypatch.setattr(kernels, "_backend", lambda device_type: triton_backend)
    return layer.mlp(x)


def mxfp4_checkpoint(reference, path) -> dict:
    """Layer 0's tensors with the experts in MXFP4; transformers' block gets the values they encode."""
    return mxfp4_experts(reference, layer_weights(iterate_safetensors(str(path))))


def mxfp4_config():
    config = gpt_oss_config()
    config.quantization_config = {"quant_method": "mxfp4"}
    return config


def test_gpt_oss_layer_from_mxfp4_experts(tmp_path, monkeypatch):
    """The experts stay packed (a byte per two values, a scale per 32) and compute, on the CPU reference and
    through the Triton kernels (interpreted on a CPU), what transformers' block does on their values."""
    config = mxfp4_config()
    reference = save_random_decoder(gpt_oss_config(), tmp_path)
    layer = OneMoeLayer(config)
    load_weights(layer, sorted(mxfp4_checkpoint(reference, tmp_path).items()), source="mxfp4 test")
    experts = layer.mlp.experts
    assert experts.gate_up_proj.dtype == experts.down_proj_scales.dtype == torch.uint8
    assert experts.down_proj.shape == (config.num_local_experts, config.hidden_size, config.intermediate_size // 2)
    x = torch.randn(7, config.hidden_size)
    with torch.no_grad():
        expected = transformers_block(reference)(x)
        torch.testing.assert_close(layer.mlp(x), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(through_triton_kernels(layer, x, monkeypatch), expected, atol=1e-4, rtol=1e-4)


def test_missing_mxfp4_scales_are_named(tmp_path):
    reference = save_random_decoder(gpt_oss_config(), tmp_path)
    weights = mxfp4_checkpoint(reference, tmp_path)
    del weights["model.layers.0.mlp.experts.gate_up_proj_scales"]
    with pytest.raises(ValueError, match="lacks weights for .*experts.gate_up_proj"):
        load_weights(OneMoeLayer(mxfp4_config()), weights.items(), source="mxfp4 test")


def test_checkpoint_of_another_layout_is_refused(checkpoints):
    """gpt-oss's stacked expert tensor offered to Qwen3-MoE's per-expert parameters: an error, not a reshuffle."""
    config, _, path = checkpoints("qwen3_moe")
    weights = list(layer_weights(iterate_safetensors(str(path))))
    weights.append(("model.layers.0.mlp.experts.down_proj", torch.zeros(8, 32, 64)))
    with pytest.raises(ValueError, match="down_proj.*holds experts as stacked tensors.*expects one tensor per expert"):
        load_weights(OneMoeLayer(config), weights, source="test")


def test_checkpoint_names_map_onto_stacked_parameters():
    assert moe_checkpoint_target("model.layers.3.mlp.experts.17.up_proj.weight") == (
        "model.layers.3.mlp.experts.gate_up_proj", (17, "up"))
    assert moe_checkpoint_target("model.layers.3.mlp.experts.0.down_proj.weight") == (
        "model.layers.3.mlp.experts.down_proj", (0, "down"))
    assert moe_checkpoint_target("model.layers.0.mlp.experts.down_proj_blocks") == (
        "model.layers.0.mlp.experts.down_proj", "blocks")
    assert moe_checkpoint_target("model.layers.0.mlp.experts.down_proj_scales") == (
        "model.layers.0.mlp.experts.down_proj_scales", "scales")
    assert moe_checkpoint_target("model.layers.1.mlp.gate.weight") == ("model.layers.1.mlp.router.weight", None)
    for ours in ("model.layers.1.mlp.gate_proj.weight", "model.layers.0.mlp.experts.gate_up_proj",
                 "model.layers.0.mlp.router.bias"):
        assert moe_checkpoint_target(ours) is None


@pytest.mark.parametrize("settings", [dict(decoder_sparse_step=2, mlp_only_layers=[]),
                                      dict(decoder_sparse_step=1, mlp_only_layers=[0, 3]),
                                      dict(decoder_sparse_step=3, mlp_only_layers=[5])])
def test_moe_layers_are_those_transformers_builds(settings):
    from transformers import Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = qwen3_moe_config(num_hidden_layers=6, **settings)
    model = Qwen3MoeForCausalLM(config)
    built = [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in model.model.layers]
    assert [is_moe_layer(config, i) for i in range(6)] == built
    assert 0 < sum(built) < 6


def test_tensor_parallel_sizes_must_split_the_experts():
    check_moe_tensor_parallel(qwen3_moe_config(), 4)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not split the experts' intermediate size 32"):
        check_moe_tensor_parallel(qwen3_moe_config(), 3)
    quantized = gpt_oss_config(intermediate_size=64)
    quantized.quantization_config = {"quant_method": "mxfp4"}
    check_moe_tensor_parallel(quantized, 2)
    with pytest.raises(ValueError, match="MXFP4 groups"):
        check_moe_tensor_parallel(quantized, 4)


def _tensor_parallel_rank(rank, size, store_file, name, path, x, results):
    dist.init_process_group("gloo", store=dist.FileStore(store_file, size), rank=rank, world_size=size)
    try:
        torch.set_num_threads(1)
        config = CONFIGS[name]()
        layer = load_moe_layer(config, path)
        assert layer.mlp.experts.down_proj.shape[-1] == layer.mlp.spec.intermediate_size // size
        with torch.no_grad():
            results[rank] = layer.mlp(x).summed()  # each rank's part, summed as the norm after it would
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # tensor-parallel ranks, or interpreted Triton at model scale
@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_two_tensor_parallel_ranks_give_one_ranks_output(checkpoints, name, tmp_path):
    """Each rank loads its slice of every expert's intermediate features; the summed partial outputs (the down
    bias added once) equal transformers' block on both ranks."""
    _, reference, path = checkpoints(name)
    x = torch.randn(11, reference.config.hidden_size)
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_tensor_parallel_rank, args=(2, str(tmp_path / "store"), name, path, x, results), nprocs=2)
        outputs = [results[rank] for rank in range(2)]
    with torch.no_grad():
        expected = transformers_block(reference)(x)
    for output in outputs:
        torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)


# ---- whole decoders ------------------------------------------------------------------------------------

DECODERS = {
    # three layers: routed, dense (mlp_only_layers), routed
    "qwen3_moe": lambda: qwen3_moe_config(num_hidden_layers=3, mlp_only_layers=[1]),
    # sliding (window 8), full, sliding layers with sinks; YaRN stretching a 16-position original context
    "gpt_oss": lambda: gpt_oss_config(num_hidden_layers=3, rope_parameters={
        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 16}),
}
DECODERS["gpt_oss-mxfp4"] = lambda: gpt_oss_config(num_hidden_layers=2, intermediate_size=64)  # two 32-groups
PROMPT_LENGTHS = [3, 17, 33, 50]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def decoders(tmp_path_factory):
    """name -> (checkpoint directory, transformers model), saved once per module."""
    saved = {}

    def get(name):
        if name not in saved:
            path = tmp_path_factory.mktemp(f"decoder-{name}")
            save = save_mxfp4_decoder if name.endswith("mxfp4") else save_random_decoder
            saved[name] = (str(path), save(DECODERS[name](), path))
        return saved[name]

    return get


def transformers_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():  # an explicit mask: else generate takes the prompt's 0 tokens for padding
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


ENGINE_SETTINGS = {"plain": {}, "chunked-prefill": {"max_num_batched_tokens": 8}, "small-kv-pool": {"num_kv_blocks": 7}}


@pytest.mark.parametrize("name,engine_settings", [
    pytest.param(name, settings, id=f"{name}-{label}")
    for name in DECODERS for label, settings in ENGINE_SETTINGS.items()
    if label == "plain" or not name.endswith("mxfp4")])  # the scheduler's paths do not depend on the experts' format
def test_greedy_decoding_matches_transformers(decoders, name, engine_settings):
    """Whole prompts, prompts in chunks of 8 tokens, and a KV pool of 7 blocks of 16 that holds one request at
    a time (the others are preempted and recomputed); gpt-oss with MXFP4 experts against transformers on the
    values they encode."""
    from engine import LLM, SamplingParams

    path, reference = decoders(name)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, reference.config.vocab_size, (n,), generator=generator).tolist()
               for n in PROMPT_LENGTHS]
    llm = LLM(path, dtype="float32", **engine_settings)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = [out["token_ids"] for out in llm.generate(prompts, params)]
    assert outputs == [transformers_greedy(reference, prompt, NEW_TOKENS) for prompt in prompts]
    if "num_kv_blocks" in engine_settings:
        assert llm.core.scheduler.num_preemptions > 0


@pytest.mark.slow  # tensor-parallel ranks, or interpreted Triton at model scale
@pytest.mark.parametrize("name", [name for name in DECODERS if not name.endswith("mxfp4")])  # MXFP4: layer test
def test_decoder_through_triton_kernels_matches_transformers(decoders, name, monkeypatch):
    """Logits of a cacheless prefill and of paged steps (prompt chunks, then decodes of two sequences) through
    the Triton kernels, interpreted on the CPU, equal transformers' forward."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernels on CPU tensors under TRITON_INTERPRET=1 (set without a GPU)")
    from decoder_testing import assert_paged_steps_match

    from models.registry import load_model

    path, reference = decoders(name)
    triton_backend = kernels._backend("cuda")
    monkeypatch.setattr(kernels, "_backend", lambda device_type: triton_backend)
    assert_paged_steps_match(load_model(path, torch.float32, torch.device("cpu")).model, reference)


@pytest.mark.slow  # tensor-parallel ranks, or interpreted Triton at model scale
@pytest.mark.parametrize("name", list(DECODERS))
def test_two_tensor_parallel_ranks_decode_as_transformers(decoders, name):
    """Each rank holds half of the heads (and of gpt-oss's sinks) and half of every expert's features."""
    from engine import LLM, SamplingParams

    path, reference = decoders(name)
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, reference.config.vocab_size, (n,), generator=generator).tolist() for n in (5, 30)]
    llm = LLM(path, device="cpu", dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=16)
    try:
        layer = llm.core.runner.model.model.layers[0]
        assert layer.mlp.experts.down_weight.shape[-1] == layer.mlp.spec.intermediate_size // 2
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        outputs = [out["token_ids"] for out in llm.generate(prompts, params)]
    finally:
        llm.shutdown()
    assert outputs == [transformers_greedy(reference, prompt, 12) for prompt in prompts]


@pytest.mark.parametrize("rope", [
    {},  # gpt-oss's own: factor 32 over 4,096 positions, not truncated
    {"truncate": True, "beta_fast": 16.0},
    {"attention_factor": 0.9},
    {"factor": 4.0, "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": True},
])
def test_yarn_frequencies_match_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from models.rotary import inverse_frequencies, rope_parameters

    config = gpt_oss_config()
    config.rope_parameters = {**config.rope_parameters, **rope}
    expected, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    inv_freq, attention_factor = inverse_frequencies(config.head_dim, rope_parameters(config), 256)
    torch.testing.assert_close(inv_freq, expected, rtol=1e-6, atol=0)
    assert attention_factor == pytest.approx(expected_factor)


def test_mxfp4_weights_are_counted_at_their_packed_size(decoders):
    """The start-up line's weight size: transformers' float32 parameters, the experts' at 4.25 bits a value
    (a 4-bit code, and an 8-bit scale per 32) instead."""
    from models.registry import load_model

    path, reference = decoders("gpt_oss-mxfp4")
    loaded = load_model(path, torch.float32, torch.device("cpu"))
    experts = sum(p.numel() for name, p in reference.named_parameters()
                  if name.endswith(("experts.gate_up_proj", "experts.down_proj")))
    reference_bytes = sum(p.numel() * 4 for p in reference.parameters())
    assert loaded.weight_bytes == reference_bytes - experts * 4 + experts // 2 + experts // 32
