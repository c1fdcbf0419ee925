"""GPU benchmark: the FP8 projections (kernels/triton_fp8_gemm.py: our block-scaled Triton GEMM, and
torch._scaled_mm after our per-token quantizer) against bf16 (kernels.linear: our split-K GEMM up to 128
rows, cuBLAS above) on Qwen3-8B's projection shapes, at decode (1-256 rows) and prefill sizes. Each call is
timed replayed from a CUDA graph, as the engine runs decode steps. The FP8 outputs are checked against the
torch reference (relative error of the largest output) before timing.

--sweep also times a grid of Triton configs per shape and prints the fastest (choose_config's candidates).

    PYTHONPATH=. python3 bench/fp8_gemm.py [--sweep]
"""
import argparse
import itertools

import torch
import triton

from kernels import linear, reference
from kernels.split_arrivals import num_sms
from kernels.triton_fp8_gemm import choose_config, scaled_mm_linear, triton_fp8_linear

SHAPES = {  # Qwen3-8B: hidden 4096, 32/8 heads of 128, intermediate 12,288
    "qkv_proj": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up_proj": (24576, 4096),
    "down_proj": (4096, 12288),
}
ROWS = [1, 4, 16, 32, 64, 128, 256, 1024, 4096, 8192]
BLOCK = (128, 128)


def time_us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3


def sweep_configs(m: int) -> list[tuple]:
    if m <= 128:
        block_ms = [16] if m <= 16 else [32, 64]
        grid = itertools.product(block_ms, [32, 64, 128], [1, 2, 4, 8], [4], [3, 4])
    else:
        grid = itertools.product([64, 128], [64, 128, 256], [1], [4, 8], [3, 4])
    return list(grid)


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="time a grid of Triton configs, print the fastest")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    args = ap.parse_args()
    torch.manual_seed(0)
    sms = num_sms(torch.device("cuda"))
    header = (f"{'shape':13} {'rows':>5} {'bf16 us':>8} {'triton us':>9} {'scaled_mm us':>12} {'triton x':>8} "
              f"{'scaled x':>8} {'err triton':>10} {'err scaled':>10}  triton config")
    lines, best = [header], []
    for name, (n, k) in SHAPES.items():
        w_bf16 = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
        w_block, s_block = reference.quantize_fp8(w_bf16, BLOCK)
        w_row, s_row = reference.quantize_fp8(w_bf16, (1, k))
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            config = choose_config(m, n, k, sms)
            err_triton = relative_error(triton_fp8_linear(x, w_block, s_block, BLOCK),
                                        reference.fp8_linear(x, w_block, s_block, BLOCK, method="triton"))
            err_scaled = relative_error(scaled_mm_linear(x, w_row, s_row),
                                        reference.fp8_linear(x, w_row, s_row, (1, k), method="scaled_mm"))
            bf16 = time_us(lambda: linear(x, w_bf16))
            tri = time_us(lambda: triton_fp8_linear(x, w_block, s_block, BLOCK))
            scaled = time_us(lambda: scaled_mm_linear(x, w_row, s_row))
            lines.append(f"{name:13} {m:5d} {bf16:8.1f} {tri:9.1f} {scaled:12.1f} {bf16 / tri:8.2f} "
                         f"{bf16 / scaled:8.2f} {err_triton:10.4f} {err_scaled:10.4f}  {config}")
            print(lines[-1], flush=True)
            if args.sweep:
                timed = [(time_us(lambda c=c: triton_fp8_linear(x, w_block, s_block, BLOCK, config=c)), c)
                         for c in sweep_configs(m)]
                fastest = min(timed)
                best.append(f"{name:13} {m:5d} default {tri:8.1f} us  fastest {fastest[0]:8.1f} us  {fastest[1]}")
                print(best[-1], flush=True)
    print("\n" + "\n".join(lines))
    if best:
        print("\nTriton configs (BLOCK_M, BLOCK_N, SPLIT_K, num_warps, num_stages):\n" + "\n".join(best))


if __name__ == "__main__":
    main()
