"""Decode attention with a sliding window on the GPU: a window reads only its keys, so a step's time should
follow the window, not the context. Times the Triton decode kernel (plain and with sinks) at long contexts for
windows of none, 4,096 and 512, with the bandwidth its window's bytes achieve (and its share of the copy bandwidth
measured first), on Mistral-7B (32/8 heads of 128) and Gemma-3-1B (4/1 heads of 256) shapes.

Run on a CUDA machine from the repo root:  PYTHONPATH=.:bench python3 bench/window_speed.py
"""
import sys

import torch
import triton
from moe_speed import copy_bandwidth

from kernels import reference
from kernels.triton_attention import choose_num_splits, paged_attention
from tests.kernels.kernel_testing import paged_batch

SHAPES = {"mistral-7b": (32, 8, 128), "gemma-3-1b": (4, 1, 256)}
BATCHES = [1, 64]
CONTEXT = 8192
WINDOWS = [0, 4096, 512]


def main():
    if not torch.cuda.is_available():
        sys.exit("bench/window_speed.py needs a CUDA GPU (tests/kernels checks the kernels on CPU)")
    torch.manual_seed(0)
    peak = copy_bandwidth()
    print(f"copy bandwidth {peak / 1e12:.2f} TB/s")
    print(f"{'shape':12} {'batch':>5} {'context':>7} {'window':>6} {'sinks':>5} {'splits':>6} {'us':>9} "
          f"{'GB/s':>7} {'of copy':>7}")
    for name, (num_q, num_kv, head_dim) in SHAPES.items():
        for batch in BATCHES:
            q, k_cache, v_cache, meta = paged_batch([1] * batch, [CONTEXT] * batch, num_q, num_kv, head_dim, 16,
                                                    torch.bfloat16)
            sinks = torch.randn(num_q, device="cuda")
            for window in WINDOWS:
                for with_sinks in (False, True):
                    run = sinks if with_sinks else None
                    out = paged_attention(q, k_cache, v_cache, meta, head_dim**-0.5, window, run)
                    expected = reference.paged_attention(q, k_cache, v_cache, meta, head_dim**-0.5, window, run)
                    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
                    us = 1e3 * triton.testing.do_bench(
                        lambda: paged_attention(q, k_cache, v_cache, meta, head_dim**-0.5, window, run))
                    keys = min(CONTEXT, window or CONTEXT)
                    num_bytes = 2 * batch * keys * num_kv * head_dim * 2
                    splits = choose_num_splits(batch * num_kv, keys, q.device)
                    rate = num_bytes / (us * 1e-6)
                    print(f"{name:12} {batch:5} {CONTEXT:7} {window or '-':>6} {'yes' if with_sinks else 'no':>5} "
                          f"{splits:6} {us:9.1f} {rate / 1e9:7.0f} {rate / peak:7.0%}")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
