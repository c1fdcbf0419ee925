"""From a model path to a loaded model: the map from a config's `architectures` to our classes."""

import contextlib
import os
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoConfig

# Architectures with an LM head (all served by models/llama.py; of a multimodal checkpoint, its text decoder, with
# its image encoder beside it when VISION_ARCHITECTURES lists it),
# and bare decoders (no head: embedding models saved as the base model).
DECODERS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
            "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
            "Qwen3MoeForCausalLM", "GptOssForCausalLM")
BARE_DECODERS = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")
# Cross-encoders: encoders with a sequence-classification head, which score text pairs (models/bert.py)
CLASSIFIERS = ("BertForSequenceClassification", "RobertaForSequenceClassification",
               "XLMRobertaForSequenceClassification")
ENCODERS = ("BertModel", "BertForMaskedLM", "RobertaModel", "XLMRobertaModel", *CLASSIFIERS)
SUPPORTED = DECODERS + BARE_DECODERS + ENCODERS
# Their image encoder is served too (not from a GGUF): its module and class
VISION_ARCHITECTURES = {"Gemma3ForConditionalGeneration": ("models.gemma3_vision", "Gemma3VisionEncoder"),
                        "Qwen2_5_VLForConditionalGeneration": ("models.qwen2_5_vision", "Qwen2_5VisionEncoder")}


@dataclass
class LoadedModel:
    model: nn.Module
    hf_config: object  # a decoder's: the text config (of a multimodal checkpoint, its text_config)
    kind: str  # "decoder" | "encoder" | "classifier" (a cross-encoder)
    model_dir: str
    vision: nn.Module | None = None  # a multimodal decoder's image encoder (models/gemma3_vision.py, qwen2_5_vision.py)

    @property
    def weight_bytes(self) -> int:
        """Device bytes of this process's parameters (with tensor parallelism, its rank's share), as stored:
        FP8 and MXFP4 weights at their packed size."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Parameters created inside are born in `dtype` (no float32 copy first)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def architecture_of(hf_config) -> str:
    """The config's architecture if we support it; ValueError naming it and what we support otherwise."""
    architectures = getattr(hf_config, "architectures", None) or []
    for name in architectures:
        if name in SUPPORTED:
            return name
    found = ", ".join(architectures) or f"none (model_type {getattr(hf_config, 'model_type', None)!r})"
    raise ValueError(f"unsupported model architecture: {found}; supported: {', '.join(SUPPORTED)}")


def build_decoder(hf_config, dtype: torch.dtype, device: torch.device, with_lm_head: bool = True,
                  max_model_len: int | None = None, fp8_gemm: str = "scaled_mm") -> nn.Module:
    """An uninitialised decoder, its parameters allocated on `device` in `dtype` (FP8 checkpoints' projections
    in e4m3), ready for a weight loader."""
    from models.llama import LlamaForCausalLM

    with torch.device(device), default_dtype(dtype):
        return LlamaForCausalLM(hf_config, with_lm_head=with_lm_head, max_model_len=max_model_len, fp8_gemm=fp8_gemm)


def load_model(model_path: str, dtype: torch.dtype, device: torch.device, cache_dir: str | None = None,
               max_model_len: int | None = None, fp8_gemm: str = "scaled_mm") -> LoadedModel:
    """Load a local checkpoint directory (config.json + safetensors) or a .gguf file (its converted metadata kept
    under cache_dir, see models/gguf_loader.py). max_model_len and fp8_gemm go to the decoder (see
    models/llama.py)."""
    from models.loader import load_safetensors, load_weights

    if os.path.isfile(model_path) and model_path.endswith(".gguf"):
        from models.gguf_loader import gguf_model_dir, iterate_gguf

        model_dir = gguf_model_dir(model_path, cache_dir)
        hf_config = AutoConfig.from_pretrained(model_dir)
        model = build_decoder(hf_config, dtype, device, architecture_of(hf_config) in DECODERS, max_model_len)
        load_weights(model, iterate_gguf(model_path, hf_config), source=model_path)
        return LoadedModel(model.eval(), hf_config, "decoder", model_dir)
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise FileNotFoundError(f"{model_path!r} is neither a .gguf file nor a directory with a config.json")
    hf_config = AutoConfig.from_pretrained(model_path)
    architecture = architecture_of(hf_config)
    if architecture in ENCODERS:
        from models.bert import load_bert

        classifier = architecture in CLASSIFIERS
        return LoadedModel(load_bert(model_path, hf_config, dtype, device, classifier).eval(), hf_config,
                           "classifier" if classifier else "encoder", model_path)
    model = build_decoder(hf_config, dtype, device, architecture in DECODERS, max_model_len, fp8_gemm)
    load_safetensors(model, model_path)
    vision = load_vision(model_path, hf_config, architecture, dtype, device) if architecture in VISION_ARCHITECTURES \
        else None
    return LoadedModel(model.eval(), hf_config.get_text_config(), "decoder", model_path, vision)


def load_vision(model_dir: str, hf_config, architecture: str, dtype: torch.dtype, device: torch.device
                ) -> nn.Module | None:
    """A multimodal checkpoint's image encoder, whole, on tensor-parallel rank 0 only (None on the other ranks):
    rank 0 encodes a step's images and sends their soft tokens (engine/images.py's StepImages.on)."""
    import importlib

    from models.loader import iterate_safetensors, load_weights
    from models.parallel_layers import tp_rank

    if tp_rank() > 0:
        return None
    module_name, class_name = VISION_ARCHITECTURES[architecture]
    module = importlib.import_module(module_name)
    with torch.device(device), default_dtype(dtype):
        encoder = getattr(module, class_name)(hf_config)
    load_weights(encoder, iterate_safetensors(model_dir, lazy=True), source=model_dir,
                 names=module.checkpoint_names())
    return encoder.eval()
