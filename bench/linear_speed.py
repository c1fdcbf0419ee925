"""The Qwen3-0.6B projections at decode sizes, cuBLAS against the engine's choice (kernels.linear: the split-K Triton
GEMM up to kernels/triton_linear.py's MAX_ROWS rows), as a decode step runs them: back to back in a CUDA graph,
each call on a weight of its own so that none is read from L2. Prints microseconds per call and per layer (the
four projections) against the layer's floor, its weights read once at bench/kernel_speed.py's PEAK_BYTES_PER_S. Run
on a CUDA machine: PYTHONPATH=.:bench python3 bench/linear_speed.py [--rows 32,64,96,128,160,256]"""
import argparse

import torch
import torch.nn.functional as F
from kernel_speed import PEAK_BYTES_PER_S
from moe_speed import graph_us

from kernels import linear

PROJECTIONS = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
               "lm_head": (151936, 1024)}  # (N, K)
CALLS = 12  # weights per timing, one call each: more than L2 holds for every projection but the LM head (2), which
# alone exceeds it


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="32,64,96,128,160,256")
    args = ap.parse_args()
    layer_bytes = sum(2 * n * k for name, (n, k) in PROJECTIONS.items() if name != "lm_head")
    print(f"{'rows':>4} {'projection':10} {'cuBLAS us':>9} {'engine us':>9}")
    for rows in map(int, args.rows.split(",")):
        per_layer = [0.0, 0.0]
        for name, (n, k) in PROJECTIONS.items():
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                       for _ in range(CALLS if name != "lm_head" else 2)]
            times = [graph_us(lambda f=f: [f(x, weight) for weight in weights]) / len(weights)
                     for f in (F.linear, linear)]
            print(f"{rows:4d} {name:10} {times[0]:9.1f} {times[1]:9.1f}", flush=True)
            if name != "lm_head":
                per_layer = [total + t for total, t in zip(per_layer, times)]
        floor_us = layer_bytes / PEAK_BYTES_PER_S * 1e6
        print(f"{rows:4d} {'layer':10} {per_layer[0]:9.1f} {per_layer[1]:9.1f}   floor {floor_us:.1f}")


if __name__ == "__main__":
    main()
