"""Decode attention's fixed work per program: one layer's decode step of the Qwen3-0.6B shape at batch 256, 128,
64, 16 and 1, over a 16-bit or an FP8 cache, contexts equal to 1,024 ("equal"), drawn from [100, 2100] ("varied",
the throughput workload's late steps) or from [100, 1100] ("short", its early ones). Times the fused kernel the
engine runs (prologue and attention, splits of its own choice) against attention alone with 1, 2 or 4 splits forced
and with its own choice, so that the cost of the prologue and of the splits' merge shows. Prints microseconds and
TB/s of KV read. Run on a CUDA machine: PYTHONPATH=.:bench python3 bench/decode_balance.py [--kv-cache-dtype fp8]"""
import argparse
import random

import torch
import triton.testing
from fp8_attention_sweep import FP8, HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS, decode_step, rotary_and_norms

from kernels.triton_attention import decode_attention, qkv_decode_attention
from kernels.triton_prologue import qkv_prologue

LENGTHS = {"equal": lambda: 1024, "varied": lambda: random.randint(100, 2100),
           "short": lambda: random.randint(100, 1100)}


def variants(lengths: list[int], dtype: torch.dtype, cos_sin, norms) -> tuple[dict, int]:
    """{name: launch} for one step over a cache of dtype, and the KV bytes it reads."""
    qkv, k, v, meta, scales = decode_step(lengths, dtype)
    q, _, _ = qkv_prologue(qkv, meta.seq_lens.long() - 1, cos_sin, NUM_Q_HEADS, NUM_KV_HEADS, *norms, 1e-6,
                           k.clone(), v.clone(), meta.slot_mapping, False, *scales)
    scale = HEAD_DIM**-0.5
    launches = {"fused, own splits": lambda: qkv_decode_attention(
        qkv, cos_sin, NUM_Q_HEADS, NUM_KV_HEADS, *norms, 1e-6, k, v, meta, scale, k_scale=scales[0],
        v_scale=scales[1])}
    for splits in (None, 1, 2, 4):
        launches[f"attention, {splits or 'own'} splits"] = lambda splits=splits: decode_attention(
            q, k, v, meta, scale, num_splits=splits, k_scale=scales[0], v_scale=scales[1])
    return launches, 2 * sum(lengths) * NUM_KV_HEADS * HEAD_DIM * k.element_size()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    ap.add_argument("--batches", default="256,128,64,16,1")
    args = ap.parse_args()
    random.seed(0)
    torch.manual_seed(0)
    dtype = FP8 if args.kv_cache_dtype == "fp8" else torch.bfloat16
    cos_sin, norms = rotary_and_norms()
    print(f"{'batch':>5} {'lengths':8} {'variant':24} {'us':>8} {'TB/s':>6}")
    for batch in map(int, args.batches.split(",")):
        for kind, draw in LENGTHS.items():
            lengths = [draw() for _ in range(batch)] if batch > 1 else [1024]
            launches, kv_bytes = variants(lengths, dtype, cos_sin, norms)
            for name, launch in launches.items():
                ms = triton.testing.do_bench(launch, warmup=20, rep=100, return_mode="median")
                print(f"{batch:5d} {kind:8} {name:24} {ms * 1e3:8.1f} {kv_bytes / ms / 1e9:6.2f}", flush=True)


if __name__ == "__main__":
    main()
