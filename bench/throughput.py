"""Offline throughput on the Nano-vLLM workload (Nano-vLLM's bench.py): 256 requests, random prompts of
100-1024 tokens, 100-1024 output tokens each (133,966 in all), ignore_eos, temperature 0.6. --fp8 runs the
model's block-wise FP8 copy next (bench/random_model.py), each on an engine of its own."""
import argparse
import gc
import time
from random import randint, seed

import torch

from engine import LLM, SamplingParams
from random_model import add_fp8_arguments, add_gpu_features_argument, make_random_model, weights_to_run
from step_trace import StepTrace


def workload(num_seqs=256, max_input_len=1024, max_output_len=1024):
    seed(0)
    prompts = [[randint(0, 10000) for _ in range(randint(100, max_input_len))] for _ in range(num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(100, max_output_len))
              for _ in range(num_seqs)]
    return prompts, params


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b", help="a config name under bench/models or a model directory")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--no-overlap", action="store_true", help="read each step's ids before launching the next")
    ap.add_argument("--trace", action="store_true", help="after each repeat, where its time went (bench/step_trace.py)")
    ap.add_argument("--config", action="append", default=[], metavar="NAME=INT",
                    help="an integer EngineConfig field, e.g. block_size=64 (repeatable)")
    add_fp8_arguments(ap, "then the model's block-wise FP8 copy")
    add_gpu_features_argument(ap)
    args = ap.parse_args()
    path = make_random_model(args.model) if "/" not in args.model else args.model
    overrides = {name: int(value) for name, value in (item.split("=", 1) for item in args.config)}
    for weights, model_path, settings in weights_to_run(path, args):
        run(model_path, weights, args, **overrides, **settings)


def run(path: str, weights: str, args, **settings) -> None:
    """Prints each repeat's throughput for the model at path, on an engine of its own (freed after)."""
    llm = LLM(path, enforce_eager=args.enforce_eager, tensor_parallel_size=args.tensor_parallel_size,
              overlap_steps=not args.no_overlap, kv_cache_dtype=args.kv_cache_dtype, gpu_features=args.gpu_features,
              **settings)
    trace = StepTrace(llm) if args.trace else None
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8))  # warm-up request
    if trace:
        trace.report()
    prompts, params = workload(args.num_seqs)
    total = sum(p.max_tokens for p in params)
    for _ in range(args.repeat):
        llm.core.block_manager.reset_prefix_cache()  # each repeat prefills its prompts again
        start = time.perf_counter()
        llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        print(f"{weights}: output tokens {total}  seconds {seconds:.2f}  throughput {total / seconds:,.0f} tok/s",
              flush=True)
        if trace:
            trace.report()
    llm.shutdown()
    del llm, trace
    gc.collect()
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
