"""Random bf16 weights for a model config (speed depends on shapes, not values), saved as safetensors."""
import argparse
import json
import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))


def make_random_model(name: str = "qwen3-0.6b", out_dir: str | None = None, device: str = "cuda",
                      overrides: dict | None = None) -> str:
    """Writes bench/models/<name>/config.json, with `overrides` of its fields (fewer layers, another window),
    and random weights to out_dir (once; the default names the overrides) and returns out_dir."""
    overrides = overrides or {}
    out_dir = out_dir or f"/tmp/random-{name}" + "".join(f"-{key}={value}" for key, value in sorted(overrides.items()))
    if os.path.exists(os.path.join(out_dir, "model.safetensors")) or os.path.exists(
            os.path.join(out_dir, "model.safetensors.index.json")):
        return out_dir
    with open(os.path.join(HERE, "models", name, "config.json"), encoding="utf-8") as f:
        raw_config = {**json.load(f), **overrides}
    os.makedirs(out_dir, exist_ok=True)
    config_path = os.path.join(out_dir, "config.json")
    _write_json(config_path, raw_config)
    config = AutoConfig.from_pretrained(out_dir)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out_dir, max_shard_size="4GB")
    _write_json(config_path, raw_config)  # the public config as written, not this transformers' rendering of it
    return out_dir


def _write_json(path: str, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("name", nargs="?", default="qwen3-0.6b")
    ap.add_argument("--out")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    print(make_random_model(args.name, args.out, args.device))
