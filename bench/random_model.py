"""Random bf16 weights for a model config (speed depends on shapes, not values): saved as safetensors (and an
FP8 copy of such a model, block-wise as the Qwen3 -FP8 checkpoints), or, for models too large to save and reload
quickly (Qwen3-30B-A3B: 61 GB), drawn on the GPU at load time."""
import argparse
import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from engine.config import KV_CACHE_DTYPES
from kernels import gpu_features
from kernels.reference import quantize_fp8
from models.fp8 import FP8_GEMMS
from models.loader import safetensors_files

FP8_BLOCK = (128, 128)
MXFP4_SCALE = 120  # 2^-7: random E2M1 codes (root mean square near 3) under it have a std near 0.02

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
    auto = AutoModelForCausalLM if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else \
        AutoModelForImageTextToText  # Qwen2.5-VL's class is only an image-text-to-text model
    with torch.device(device):
        model = auto.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out_dir, max_shard_size="4GB")
    _write_json(config_path, raw_config)  # the public config as written, not this transformers' rendering of it
    return out_dir


SHARDED_FIELDS = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size",
                  "vocab_size")  # what tensor parallelism divides among ranks


def config_only_model(name: str, drop_quantization: bool = False, shard_of: int = 1) -> str:
    """A model directory holding bench/models/<name>/config.json and no weights: for draw_weights_at_load().
    drop_quantization: without its quantization_config (gpt-oss's experts in bf16 instead of MXFP4). shard_of N:
    the part of the model one rank of tensor parallelism N holds (SHARDED_FIELDS divided by N, at least one KV
    head), to time a rank's kernels alone on one GPU, without the communication."""
    out_dir = f"/tmp/random-{name}-config" + ("-unquantized" if drop_quantization else "") + (
        f"-shard-of-{shard_of}" if shard_of > 1 else "")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(HERE, "models", name, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    if drop_quantization:
        config.pop("quantization_config", None)
    if shard_of > 1:
        _shard_config(config, shard_of)
    _write_json(os.path.join(out_dir, "config.json"), config)
    return out_dir


def _shard_config(config: dict, shard_of: int) -> None:
    """config's SHARDED_FIELDS divided by shard_of (at least 1), its special token ids kept inside the divided
    vocabulary."""
    for field in SHARDED_FIELDS:
        if field in config:
            config[field] = max(1, config[field] // shard_of)
    for field in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(config.get(field), int):
            config[field] = min(config[field], config["vocab_size"] - 1)


def draw_weights_at_load(std: float = 0.02) -> None:
    """From now on, loading a safetensors model draws its parameters where they live instead of reading files:
    norm weights 1, the others normal(0, std) (transformers' initialisation); MXFP4 experts random codes
    under scales of 2^-7, about that std. Tensor-parallel ranks are spawned
    processes that re-import the main script, so a script calls this at import time, not under __main__."""
    import models.loader

    @torch.no_grad()
    def draw(model, model_dir):
        for name, param in model.named_parameters():
            if param.dtype == torch.uint8:
                param.fill_(MXFP4_SCALE) if name.endswith("_scales") else param.random_(0, 256)
            else:
                param.fill_(1.0) if "norm" in name else param.normal_(0.0, std)

    models.loader.load_safetensors = draw


def make_fp8_copy(model_dir: str, out_dir: str | None = None, device: str | None = None) -> str:
    """The checkpoint in model_dir with every decoder-layer projection as e4m3 and a float32 weight_scale_inv
    per 128 x 128 block (quant_method "fp8", as the Qwen3 -FP8 checkpoints), written to out_dir (once, by
    default model_dir + "-fp8") one file per input file; returns out_dir."""
    out_dir = out_dir or model_dir.rstrip("/") + "-fp8"
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    config_path = os.path.join(out_dir, "config.json")
    if os.path.exists(config_path):
        return out_dir
    os.makedirs(out_dir, exist_ok=True)
    weight_map = {}
    for path in safetensors_files(model_dir):
        tensors = {}
        with safe_open(path, framework="pt", device=device) as f:
            for name in f.keys():  # noqa: SIM118 - a safe_open handle has keys() but cannot be iterated
                tensor = f.get_tensor(name)
                if ".layers." in name and name.endswith("proj.weight"):
                    tensor, scales = quantize_fp8(tensor, FP8_BLOCK)
                    tensors[name.removesuffix("weight") + "weight_scale_inv"] = scales.cpu()
                tensors[name] = tensor.cpu()
        save_file(tensors, os.path.join(out_dir, os.path.basename(path)), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, os.path.basename(path)))
    _write_json(os.path.join(out_dir, "model.safetensors.index.json"), {"metadata": {}, "weight_map": weight_map})
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(FP8_BLOCK)}
    _write_json(config_path + ".partial", config)
    os.replace(config_path + ".partial", config_path)  # written last: its presence means the copy is whole
    return out_dir


def add_fp8_arguments(ap: argparse.ArgumentParser, fp8_help: str) -> None:
    """The engine benchmarks' FP8 options: --fp8 (fp8_help says what it runs), --fp8-gemm, --kv-cache-dtype."""
    ap.add_argument("--fp8", action="store_true", help=fp8_help)
    ap.add_argument("--fp8-gemm", default=FP8_GEMMS[0], choices=FP8_GEMMS)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES))


def add_all_reduce_argument(ap: argparse.ArgumentParser) -> None:
    """--no-p2p-all-reduce: HFENDPOINT_P2P_ALL_REDUCE=false for the engine, every tensor-parallel sum through NCCL
    and then the norm, to time models/all_reduce.py's sums over peer memory against it."""
    ap.add_argument("--no-p2p-all-reduce", dest="p2p_all_reduce", action="store_false",
                    help="every tensor-parallel sum through NCCL (none fused into the norms over peer memory)")


def add_gpu_features_argument(ap: argparse.ArgumentParser) -> None:
    """--gpu-features: HFENDPOINT_GPU_FEATURES for the engine (kernels/gpu_features.py), e.g. portable to time
    the pre-Hopper paths on a Hopper GPU."""
    ap.add_argument("--gpu-features", default="auto", help=f"GPU features turned off: {gpu_features.SPEC_HELP}")


def weights_to_run(path: str, args) -> list[tuple[str, str, dict]]:
    """(label, model directory, engine settings): the weights at path, then with --fp8 their FP8 copy."""
    weights = [("as saved", path, {})]
    if args.fp8:
        weights.append((f"FP8 {args.fp8_gemm}", make_fp8_copy(path), {"fp8_gemm": args.fp8_gemm}))
    return weights


def _write_json(path: str, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("name", nargs="?", default="qwen3-0.6b")
    ap.add_argument("--out")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--fp8", action="store_true", help="also write its FP8 copy (to OUT-fp8)")
    args = ap.parse_args()
    path = make_random_model(args.name, args.out, args.device)
    print(make_fp8_copy(path, device=args.device) if args.fp8 else path)
