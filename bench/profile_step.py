"""Where a step's time goes: GPU time of a replayed decode graph against the whole step's wall time, with
the host's work for each step in the GPU's idle time (synchronous steps: the difference is host overhead)
and overlapped with the previous step's GPU time, and the kernels that dominate decode and a 1,024-token
prefill, summed per kind of kernel per step. --varied draws decode contexts from 100-2,100 tokens (the spread
of the throughput workload) instead of 1,024 each; --prefill-tokens also profiles one eager prefill step of
that many tokens made of the throughput workload's prompts. Kernels launched with programmatic dependent launch
(kernels/dependent_launch.py) start before the previous one ends and wait: their spans overlap, so the sums
per kind exceed the graph's GPU time and count the waiting in."""
import argparse
import re
import time
from collections import defaultdict
from random import randint

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from engine import LLM
from engine.config import KV_CACHE_DTYPES
from latency import random_prompt, run_to_first_token
from random_model import make_random_model
from throughput import workload

KERNEL_KINDS = (  # (kind, pattern on the kernel name, any case), first match wins; the LM head is a GEMM too
    ("attention", r"_decode_kernel|_prefill_kernel"),
    ("GEMM", r"gemm|nvjet|cutlass|xmma|cublas|sm90|_linear_kernel"), ("rms norm", r"rms_norm"),
    ("qkv prologue", r"prologue"), ("silu and mul", r"silu"), ("sampler", r"gumbel|argmax"))


def gpu_ms(fn, repeats=20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def wall_ms(fn, repeats=20) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / repeats


def top_kernels(fn, rows: int, steps: int = 1) -> str:
    """The kernels that took the most GPU time, then the GPU time per step of each kind of kernel."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    kinds = defaultdict(lambda: [0.0, 0])
    for event in averages:  # device events only: an eager op (aten::mm) also reports its kernels' time as its own
        if event.device_type != DeviceType.CPU and event.self_device_time_total:
            kind = next((k for k, pattern in KERNEL_KINDS if re.search(pattern, event.key, re.IGNORECASE)), "other")
            kinds[kind][0] += event.self_device_time_total / steps
            kinds[kind][1] += event.count / steps
    summary = "\n".join(f"  {kind:14} {us:9.1f} us/step  {count:6.1f} kernels/step"
                         for kind, (us, count) in sorted(kinds.items(), key=lambda item: -item[1][0]))
    total = sum(us for us, _ in kinds.values())
    return (averages.table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60)
            + f"\nGPU time per step by kind of kernel (total {total:.1f} us):\n{summary}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--rows", type=int, default=12)
    ap.add_argument("--varied", action="store_true", help="decode contexts drawn from 100-2,100 tokens")
    ap.add_argument("--prefill-tokens", type=int, default=0, help="also profile an eager prefill step of this size")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES))
    args = ap.parse_args()
    path = make_random_model(args.model) if "/" not in args.model else args.model
    core = LLM(path, kv_cache_dtype=args.kv_cache_dtype).core
    core.finish_warm_up()
    runner = core.runner
    for batch in map(int, args.batches.split(",")):
        lengths = [randint(100, 2100) if args.varied else 1024 for _ in range(batch)]
        seqs = run_to_first_token(core, [random_prompt(n) for n in lengths], max_tokens=400)
        shape = runner.graphs.shape_for([1] * batch)
        walls = {}
        for overlap in (False, True):
            core.overlap = overlap
            walls[overlap] = wall_ms(core.step)
        replay_ms = gpu_ms(runner.graphs.captured[shape].replay)
        print(f"\n== decode batch {batch} (graph {shape.num_rows}): step wall {walls[False]:.3f} ms synchronous, "
              f"{walls[True]:.3f} ms overlapped; graph replay GPU {replay_ms:.3f} ms")
        print(top_kernels(lambda: [core.step() for _ in range(5)], args.rows, steps=5))
        for seq in seqs:
            core.abort(seq)
    prompt = random_prompt(1024)

    def prefill():
        return run_to_first_token(core, [prompt[:1] + random_prompt(1023)], max_tokens=1)

    shape = runner.graphs.shape_for([1024])
    print(f"\n== prefill 1x1024 ({f'graph of {shape.num_tokens} tokens' if shape else 'eager'}): "
          f"wall {wall_ms(prefill, 5):.3f} ms (GPU time: the profile's CUDA total)")
    print(top_kernels(prefill, args.rows))
    if args.prefill_tokens:
        profile_prefill(core, args.prefill_tokens, args.rows)


def profile_prefill(core, num_tokens: int, rows: int) -> None:
    """One eager prefill step of num_tokens, made of the throughput workload's prompts (the last one cut)."""
    prompts, total = [], 0
    for prompt in workload()[0]:
        prompts.append(prompt[:num_tokens - total])
        total += len(prompts[-1])
        if total == num_tokens:
            break
    core.block_manager.reset_prefix_cache()

    def prefill():  # a random first token: no prefix hits
        return run_to_first_token(core, [[randint(0, 10000)] + p[1:] for p in prompts], 1)

    print(f"\n== prefill step of {len(prompts)} prompts, {num_tokens} tokens: wall {wall_ms(prefill, 3):.3f} ms")
    print(top_kernels(prefill, rows))


if __name__ == "__main__":
    main()
