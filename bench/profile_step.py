"""Where a step's time goes: GPU time of a replayed decode graph against the whole step's wall time, with
the host's work for each step in the GPU's idle time (synchronous steps: the difference is host overhead)
and overlapped with the previous step's GPU time, and the kernels that dominate decode and a 1,024-token
prefill."""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from engine import LLM
from latency import random_prompt, run_to_first_token
from random_model import make_random_model


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


def top_kernels(fn, rows: int) -> str:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--rows", type=int, default=12)
    args = ap.parse_args()
    path = make_random_model(args.model) if "/" not in args.model else args.model
    core = LLM(path).core
    runner = core.runner
    for batch in map(int, args.batches.split(",")):
        seqs = run_to_first_token(core, [random_prompt(1024) for _ in range(batch)], max_tokens=400)
        shape = runner._graph_for([1] * batch)
        walls = {}
        for overlap in (False, True):
            core.overlap = overlap
            walls[overlap] = wall_ms(core.step)
        print(f"\n== decode batch {batch} (graph {shape.num_rows}): step wall {walls[False]:.3f} ms synchronous, "
              f"{walls[True]:.3f} ms overlapped; graph replay GPU {gpu_ms(runner.graphs[shape].replay):.3f} ms")
        print(top_kernels(lambda: [core.step() for _ in range(5)], args.rows))
        for seq in seqs:
            core.scheduler.abort(seq)
    prompt = random_prompt(1024)
    prefill = lambda: run_to_first_token(core, [prompt[:1] + random_prompt(1023)], max_tokens=1)
    shape = runner._graph_for([1024])
    print(f"\n== prefill 1x1024 ({f'graph of {shape.num_tokens} tokens' if shape else 'eager'}): "
          f"wall {wall_ms(prefill, 5):.3f} ms (GPU time: the profile's CUDA total)")
    print(top_kernels(prefill, args.rows))


if __name__ == "__main__":
    main()
