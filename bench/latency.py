"""Time to first token for a 1,024-token prompt and time per output token at batch 1, 8, 64 and 256,
through the engine's own step loop (random Qwen3-0.6B-shaped weights unless --model is given). Decode steps
overlap the host's work with the previous step's GPU time unless --no-overlap is given."""
import argparse
import statistics
import time
from random import randint, seed

import torch

from engine import LLM, SamplingParams
from fp8_attention_sweep import use_decode_tiles
from random_model import make_random_model


def random_prompt(length: int) -> list[int]:
    return [randint(0, 10000) for _ in range(length)]


def run_to_first_token(core, prompts, max_tokens) -> list:
    """Admits the prompts and steps until each has its first token; returns the sequences."""
    seqs = [core.make_sequence(object(), p, SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens))
            for p in prompts]
    for seq in seqs:
        core.add(seq)
    while any(seq.num_output_tokens == 0 for seq in seqs):
        core.step()
    return seqs


def time_to_first_token(core, prompt_len: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):  # a fresh prompt each time: no prefix-cache hits
        torch.cuda.synchronize()
        start = time.perf_counter()
        seqs = run_to_first_token(core, [random_prompt(prompt_len)], max_tokens=1)
        times.append(time.perf_counter() - start)
        assert seqs[0].is_finished
    return statistics.median(times)


def time_per_output_token(core, batch: int, prompt_len: int, steps: int) -> float:
    seqs = run_to_first_token(core, [random_prompt(prompt_len) for _ in range(batch)], max_tokens=steps + 2)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        core.step()  # returns after a step's sampled ids reached the host (overlapped: the step before)
        times.append(time.perf_counter() - start)
    for seq in seqs:
        core.abort(seq)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--no-overlap", action="store_true", help="read each step's ids before launching the next")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    ap.add_argument("--decode-tiles", metavar="N,WARPS,STAGES[,MIN_SPLIT]",
                    help="decode attention's tiles for this cache dtype (bench/fp8_attention_sweep.py)")
    args = ap.parse_args()
    if args.decode_tiles:
        use_decode_tiles(args.decode_tiles, args.kv_cache_dtype)
    seed(0)
    path = make_random_model(args.model) if "/" not in args.model else args.model
    llm = LLM(path, enforce_eager=args.enforce_eager, tensor_parallel_size=args.tensor_parallel_size,
              kv_cache_dtype=args.kv_cache_dtype)
    core = llm.core
    core.overlap = not args.no_overlap
    time_to_first_token(core, args.prompt_len, 3)  # warm-up
    ttft = time_to_first_token(core, args.prompt_len, 10)
    rows = [("TTFT", f"1 x {args.prompt_len}", ttft * 1e3)]
    for batch in map(int, args.batches.split(",")):
        tpot = time_per_output_token(core, batch, args.prompt_len, args.steps)
        rows.append(("TPOT", f"batch {batch} x ctx {args.prompt_len}", tpot * 1e3))
    print(f"{'metric':6} {'shape':28} {'ms (median)':>12}")
    for metric, shape, ms in rows:
        print(f"{metric:6} {shape:28} {ms:12.3f}")


if __name__ == "__main__":
    main()
