"""Clear errors for checkpoints we cannot serve, rather than wrong tokens."""

import json

import pytest
import torch
from decoder_testing import CONFIGS, save_tiny_model
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, LlamaConfig

from models.llama import LlamaForCausalLM
from models.registry import SUPPORTED, load_model

CPU = torch.device("cpu")


def test_unsupported_architecture_names_it_and_the_supported_ones(tmp_path):
    GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unsupported model architecture: GPT2LMHeadModel") as error:
        load_model(str(tmp_path), torch.float32, CPU)
    assert all(name in str(error.value) for name in SUPPORTED)


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a .gguf file nor a directory with a config.json"):
        load_model(str(tmp_path / "nowhere"), torch.float32, CPU)


def test_unknown_rope_type_is_refused():
    config = LlamaConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, intermediate_size=64,
                         vocab_size=64, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="rope type 'dynamic' is not supported"):
        LlamaForCausalLM(config)


def test_unknown_layer_types_are_refused_by_name():
    config = LlamaConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=2, intermediate_size=64,
                         vocab_size=64)
    config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ValueError, match=r"layer_types \['chunked_attention'\] are not supported"):
        LlamaForCausalLM(config)


@pytest.mark.parametrize("layer_types,sliding_window,expected_windows,expected_kv_window", [
    (None, None, [0, 0], 0),  # Llama: full attention
    (None, 7, [7, 7], 7),  # Mistral: every layer
    (["full_attention", "sliding_attention"], 7, [0, 7], 0),  # Qwen2 above max_window_layers, Gemma 3
    (["sliding_attention", "sliding_attention"], 7, [7, 7], 7),
])
def test_layer_windows_follow_transformers(layer_types, sliding_window, expected_windows, expected_kv_window):
    config = LlamaConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=2, intermediate_size=64,
                         vocab_size=64)
    config.layer_types, config.sliding_window = layer_types, sliding_window
    model = LlamaForCausalLM(config)
    assert [layer.self_attn.window for layer in model.model.layers] == expected_windows
    assert model.kv_window == expected_kv_window


@pytest.fixture
def llama_dir(tmp_path):
    save_tiny_model("llama-gqa", tmp_path)
    return tmp_path


def rewrite_weights(path, change):
    weights = load_file(path / "model.safetensors")
    change(weights)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_weight_is_named(llama_dir):
    rewrite_weights(llama_dir, lambda w: w.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks weights for \['model.layers.1.self_attn.qkv_proj.weight'\]"):
        load_model(str(llama_dir), torch.float32, CPU)


def test_unexpected_weight_is_named(llama_dir):
    rewrite_weights(llama_dir, lambda w: w.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match="unexpected weights \\['model.layers.0.extra.weight'\\]"):
        load_model(str(llama_dir), torch.float32, CPU)


def test_wrong_shape_is_named(llama_dir):
    config = json.loads((llama_dir / "config.json").read_text())
    config["intermediate_size"] += 8
    (llama_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight' has shape \(\d+, \d+\), the model expects"):
        load_model(str(llama_dir), torch.float32, CPU)


def test_bare_decoder_checkpoint_loads_without_lm_head(tmp_path):
    """Embedding models are often saved as the base model: names without 'model.', no lm_head."""
    from transformers import AutoModel

    torch.manual_seed(0)
    AutoModel.from_config(CONFIGS["qwen3"]()).save_pretrained(tmp_path)
    model = load_model(str(tmp_path), torch.float32, CPU).model
    assert model.lm_head is None
    with pytest.raises(ValueError, match="no LM head"):
        model.compute_logits(torch.zeros(1, 64))


def test_multimodal_checkpoint_in_the_older_layout_loads_the_same(tmp_path):
    """Gemma 3 multimodal checkpoints saved by transformers 4 name the text decoder language_model.model.* and
    the head language_model.lm_head.*; the vision tower and projector sit at the top level. Either layout loads
    the same decoder."""
    save_tiny_model("gemma3-multimodal", tmp_path / "new")
    older = {}
    for name, tensor in load_file(tmp_path / "new" / "model.safetensors").items():
        for new, old in (("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
                         ("model.multi_modal_projector.", "multi_modal_projector.")):
            name = name.replace(new, old, 1) if name.startswith(new) else name
        older[name] = tensor
    assert any(name.startswith("vision_tower.") for name in older)
    (tmp_path / "old").mkdir()
    save_file(older, tmp_path / "old" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "old" / "config.json").write_text((tmp_path / "new" / "config.json").read_text())
    new, old = (load_model(str(tmp_path / layout), torch.float32, CPU).model.state_dict() for layout in ("new", "old"))
    assert new.keys() == old.keys() and all(torch.equal(new[name], old[name]) for name in new)
    assert load_model(str(tmp_path / "old"), torch.float32, CPU).hf_config.model_type == "gemma3_text"
