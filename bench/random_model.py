"""Random bf16 weights for a model config (speed depends on shapes, not values): saved as safetensors, or, for
models too large to save and reload quickly (Qwen3-30B-A3B: 61 GB), drawn on the GPU at load time."""
import argparse
import os
import shutil

import torch
from transformers import AutoConfig, AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))


def make_random_model(name: str = "qwen3-0.6b", out_dir: str | None = None, device: str = "cuda") -> str:
    """Writes bench/models/<name>/config.json with random weights to out_dir (once) and returns out_dir."""
    out_dir = out_dir or f"/tmp/random-{name}"
    if os.path.exists(os.path.join(out_dir, "model.safetensors")) or os.path.exists(
            os.path.join(out_dir, "model.safetensors.index.json")):
        return out_dir
    config = AutoConfig.from_pretrained(os.path.join(HERE, "models", name))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out_dir, max_shard_size="4GB")
    shutil.copy(os.path.join(HERE, "models", name, "config.json"), os.path.join(out_dir, "config.json"))
    return out_dir


def config_only_model(name: str) -> str:
    """A model directory holding bench/models/<name>/config.json and no weights: for draw_weights_at_load()."""
    out_dir = f"/tmp/random-{name}-config"
    os.makedirs(out_dir, exist_ok=True)
    shutil.copy(os.path.join(HERE, "models", name, "config.json"), os.path.join(out_dir, "config.json"))
    return out_dir


def draw_weights_at_load(std: float = 0.02) -> None:
    """From now on, loading a safetensors model draws its parameters where they live instead of reading files:
    norm weights 1, the others normal(0, std) (transformers' initialisation). Tensor-parallel ranks are spawned
    processes that re-import the main script, so a script calls this at import time, not under __main__."""
    import models.loader

    @torch.no_grad()
    def draw(model, model_dir):
        for name, param in model.named_parameters():
            param.fill_(1.0) if "norm" in name else param.normal_(0.0, std)

    models.loader.load_safetensors = draw


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("name", nargs="?", default="qwen3-0.6b")
    ap.add_argument("--out")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    print(make_random_model(args.name, args.out, args.device))
