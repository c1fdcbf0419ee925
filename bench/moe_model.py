"""A mixture-of-experts model end to end on the Nano-vLLM workload: throughput, time to first token and time
per output token at batch 1 and 64, each against its floor, and the MoE layer's achieved bandwidth.

Run on one H200 (the bf16 Qwen3-30B-A3B shape is 61 GB) from the repo root:
    PYTHONPATH=. python3 bench/moe_model.py [--tensor-parallel-size 2] [--model gpt-oss-20b [--bf16-experts]]

gpt-oss keeps its experts in MXFP4 as published; --bf16-experts drops the config's quantization_config to
serve the same shape with bf16 experts (its dequantized self).

The weights are random (speed depends on shapes, not values) and drawn on the GPU at load
(bench/random_model.py's draw_weights_at_load): nothing is written to or read from disk.

After the TPOT rows it prints where one batch-1 decode step's GPU time goes: a profile (torch.profiler, CUDA
activities) of replayed decode steps, per kernel name, in launches and microseconds per step and per layer (with
tensor parallelism, rank 0's GPU). --tpot-only skips TTFT, throughput and the MoE layer alone, for a quick
before/after: --direct-max-tokens N sets kernels/triton_moe.py's DIRECT_MAX_TOKENS and DIRECT_MXFP4_MAX_TOKENS (0:
every step on the sorted path, as before direct routing) in this process and, through the environment variable
DIRECT_MAX_TOKENS_ENV names, in its spawned tensor-parallel ranks: a switch for this bench only. --gpu-features
portable launches without dependent launch, so the kernels' spans no longer overlap and each one's time is its own.
--tp-shard N runs, on one GPU, the part of the model one rank of tensor parallelism N holds (its heads, intermediate
sizes and vocabulary divided by N): a rank's step without its all-reduces, against its floor.

Floors, at the copy bandwidth and bf16 matmul rate measured here:
- a decode step of B sequences reads the dense weights (attention, routers, norms, LM head), the experts it
  routes to in every layer, and its sequences' KV cache (within each layer's window). Random routers route as
  a uniform draw, so B tokens reach E (1 - (1 - k/E)^B) experts per layer (k at B = 1).
- a prefill of P tokens reads every weight it routes to once, and computes 2 x active parameters x P plus
  causal attention: its floor is the larger of the two.
- the workload's floor: its prefills, then its decode steps with every request running from the start
  (max_num_seqs 256) until its own output ends.
"""
import argparse
import os
import re
import statistics
import time
from collections import Counter, defaultdict

import numpy as np
import torch
from moe_speed import SHAPES, Case, copy_bandwidth, graph_us, matmul_flops
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from transformers import AutoConfig

from engine import LLM, SamplingParams
from kernels import triton_moe
from latency import (
    random_prompt,
    run_to_first_token,
    time_per_output_token,
    time_to_first_token,
)
from random_model import add_all_reduce_argument, add_gpu_features_argument, config_only_model, draw_weights_at_load
from throughput import workload

DIRECT_MAX_TOKENS_ENV = "MOE_MODEL_DIRECT_MAX_TOKENS"
draw_weights_at_load()  # at import: spawned tensor-parallel ranks import this script again
if os.environ.get(DIRECT_MAX_TOKENS_ENV):
    triton_moe.DIRECT_MAX_TOKENS = triton_moe.DIRECT_MXFP4_MAX_TOKENS = int(os.environ[DIRECT_MAX_TOKENS_ENV])

TPOT_BATCHES = (1, 64)
PROFILED_STEPS = 10


class Floors:
    """Bytes and FLOPs of the model's steps on one GPU (with tensor parallelism, rank 0's share; the
    all-reduces are not counted), from the parameters it holds, its layers' windows and the config."""

    def __init__(self, model, config, bandwidth: float, flops_rate: float, tp: int):
        self.bandwidth, self.flops_rate = bandwidth, flops_rate
        params = dict(model.named_parameters())
        element = model.model.embed_tokens.weight.element_size()  # of activations and the KV cache

        def nbytes(p):
            return p.numel() * p.element_size()

        expert_bytes = sum(nbytes(p) for n, p in params.items() if ".experts." in n)
        self.moe_layers = sum(1 for n in params if n.endswith("experts.down_proj"))
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.expert_bytes = expert_bytes / max(self.moe_layers * self.num_experts, 1)  # this GPU's part of one
        self.dense_bytes = (sum(nbytes(p) for p in params.values()) - expert_bytes
                            - model.model.embed_tokens.weight.numel() * element)  # the embedding reads a row a token
        self.active_params = (self.dense_bytes + self.moe_layers * self.top_k * self.expert_bytes) / element
        self.windows = Counter(layer.self_attn.window for layer in model.model.layers)  # window (0: full) -> layers
        self.kv_bytes_per_layer_token = 2 * config.num_key_value_heads // tp * config.head_dim * element
        self.attention_flops_per_pair = 4 * config.num_attention_heads // tp * config.head_dim  # per layer

    def reached_experts(self, tokens: int) -> float:
        return self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** tokens)

    def decode_step_s(self, contexts: np.ndarray) -> float:
        """One decode step of sequences with these context lengths: each layer reads a sequence's KV entries
        within its window."""
        weights = self.dense_bytes + self.moe_layers * self.reached_experts(len(contexts)) * self.expert_bytes
        entries = sum(layers * (np.minimum(contexts, window) if window else contexts).sum()
                      for window, layers in self.windows.items())
        return (weights + entries * self.kv_bytes_per_layer_token) / self.bandwidth

    def prefill_s(self, prompt_lengths: list[int]) -> float:
        tokens = sum(prompt_lengths)
        reads = (self.dense_bytes + self.moe_layers * self.reached_experts(tokens) * self.expert_bytes) / self.bandwidth
        pairs = sum(layers * causal_pairs(n, window) for n in prompt_lengths for window, layers in self.windows.items())
        flops = 2 * self.active_params * tokens + self.attention_flops_per_pair * pairs
        return max(reads, flops / self.flops_rate)

    def workload_s(self, prompts: list[list[int]], params: list[SamplingParams]) -> float:
        lengths = np.array([len(p) for p in prompts])
        outputs = np.array([p.max_tokens for p in params])
        seconds = self.prefill_s(lengths.tolist())
        for step in range(outputs.max()):
            seconds += self.decode_step_s(lengths[outputs > step] + step)
        return seconds


def causal_pairs(length: int, window: int) -> int:
    """Query-key pairs a causal prompt of `length` tokens computes (each query sees its last `window` keys)."""
    if not window or length <= window:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


def measure_throughput(llm, repeats: int) -> tuple[float, int]:
    prompts, params = workload()
    total = sum(p.max_tokens for p in params)
    runs = []
    for _ in range(repeats):
        llm.core.block_manager.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate(prompts, params)
        runs.append(total / (time.perf_counter() - start))
        print(f"throughput {runs[-1]:,.0f} tok/s", flush=True)
    return statistics.median(runs), total


def time_to_first_tokens(core, batch: int, prompt_len: int) -> float:
    """Seconds until each of `batch` fresh prompts admitted together has its first token."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    run_to_first_token(core, [random_prompt(prompt_len) for _ in range(batch)], max_tokens=1)
    return time.perf_counter() - start


def decode_kernels(core, prompt_len: int, steps: int = PROFILED_STEPS) -> list[tuple[str, float, float]]:
    """(kernel name, launches per step, GPU us per step) of batch-1 decode steps at a context of prompt_len,
    most time first. Kernels launched with programmatic dependent launch start early and wait for the one before:
    their spans overlap, so the sum exceeds the step's GPU time."""
    seqs = run_to_first_token(core, [random_prompt(prompt_len)], max_tokens=core.max_model_len - prompt_len)
    for _ in range(3):
        core.step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            core.step()
        torch.cuda.synchronize()
    for seq in seqs:
        core.abort(seq)
    kernels = defaultdict(lambda: [0.0, 0])
    for event in prof.key_averages():
        if event.device_type != DeviceType.CPU and event.self_device_time_total:
            name = re.sub(r"\s+", " ", event.key)[:60]
            kernels[name][0] += event.self_device_time_total / steps
            kernels[name][1] += event.count / steps
    return sorted(((name, count, us) for name, (us, count) in kernels.items()), key=lambda row: -row[2])


def print_decode_kernels(rows: list[tuple[str, float, float]], num_layers: int) -> None:
    print(f"\n== one batch-1 decode step on the GPU, per kernel (sum {sum(us for _, _, us in rows):.1f} us, "
          f"{sum(count for _, count, _ in rows):.0f} launches; {num_layers} layers)")
    print(f"{'kernel':<60} {'per step':>8} {'us/step':>9} {'us/layer':>9}")
    for name, count, us in rows:
        print(f"{name:<60} {count:8.1f} {us:9.1f} {us / num_layers:9.2f}")


def moe_layer_rows(shape: str, bandwidth: float) -> list[tuple]:
    """The MoE layer alone (router, top-k and experts) on random experts of bench/moe_speed.py's `shape`, per
    token count."""
    rows = []
    for tokens in TPOT_BATCHES + (256,):
        case = Case(shape, tokens)
        layer_us = graph_us(case.layer)
        moved = case.bytes_moved() + case.router.numel() * case.router.element_size()
        rows.append((tokens, case.num_reached, layer_us, moved / (layer_us * 1e-6) / 1e9,
                     moved / bandwidth * 1e6 / layer_us))
        del case
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-30b-a3b", help="a config name under bench/models")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per batch size")
    ap.add_argument("--repeat", type=int, default=2, help="throughput runs (median)")
    ap.add_argument("--bf16-experts", action="store_true", help="an MXFP4 model's experts in bf16 instead")
    ap.add_argument("--skip-layer", action="store_true", help="skip the MoE layer alone")
    ap.add_argument("--tpot-only", action="store_true",
                    help="only TPOT and the batch-1 kernel breakdown (no TTFT, throughput or MoE layer alone)")
    ap.add_argument("--direct-max-tokens", type=int,
                    help="steps of up to this many tokens route directly, whatever the experts' format (0: all "
                         "sorted by expert, as before)")
    ap.add_argument("--tp-shard", type=int, default=1, metavar="N",
                    help="time one rank's part of tensor parallelism N alone on one GPU (no communication)")
    add_gpu_features_argument(ap)
    add_all_reduce_argument(ap)
    args = ap.parse_args()
    if args.tp_shard > 1 and args.tensor_parallel_size > 1:
        ap.error("--tp-shard runs one rank's part on one GPU: leave --tensor-parallel-size at 1")
    if args.direct_max_tokens is not None:
        os.environ[DIRECT_MAX_TOKENS_ENV] = str(args.direct_max_tokens)
        triton_moe.DIRECT_MAX_TOKENS = triton_moe.DIRECT_MXFP4_MAX_TOKENS = args.direct_max_tokens
    bandwidth, flops_rate = copy_bandwidth(), matmul_flops()
    model_dir = config_only_model(args.model, drop_quantization=args.bf16_experts, shard_of=args.tp_shard)
    quantized = "quantization_config" in AutoConfig.from_pretrained(model_dir).to_dict()
    names = [f"{args.model}-tp{args.tensor_parallel_size}", args.model]
    names = [f"{name}-mxfp4" for name in names] if quantized else names
    shape = None if args.skip_layer or args.tpot_only else next((s for s in names if s in SHAPES), None)
    layers = moe_layer_rows(shape, bandwidth) if shape else []  # before the engine takes the GPU's memory
    torch.cuda.empty_cache()
    start = time.perf_counter()
    llm = LLM(model_dir, tensor_parallel_size=args.tensor_parallel_size, gpu_features=args.gpu_features,
              p2p_all_reduce=args.p2p_all_reduce)
    print(f"engine ready in {time.perf_counter() - start:.0f} s: weights "
          f"{sum(p.numel() * p.element_size() for p in llm.core.runner.model.parameters()) / 2**30:.2f} GiB, "
          f"{llm.core.stats()['num_total_blocks']} KV blocks", flush=True)
    core = llm.core
    floors = Floors(core.runner.model, core.runner.model.config, bandwidth, flops_rate, args.tensor_parallel_size)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8))  # warm-up request
    rows = []
    time_to_first_token(core, args.prompt_len, 3)  # warm-up
    for batch in () if args.tpot_only else TPOT_BATCHES:
        ttft = statistics.median(time_to_first_tokens(core, batch, args.prompt_len) for _ in range(3))
        rows.append((f"TTFT batch {batch} x {args.prompt_len}", ttft, floors.prefill_s([args.prompt_len] * batch)))
    for batch in TPOT_BATCHES:
        tpot = time_per_output_token(core, batch, args.prompt_len, args.steps)
        contexts = np.full(batch, args.prompt_len + args.steps // 2)
        rows.append((f"TPOT batch {batch} ctx {args.prompt_len}", tpot, floors.decode_step_s(contexts)))
    kernels, num_layers = decode_kernels(core, args.prompt_len), len(core.runner.model.model.layers)
    if not args.tpot_only:
        throughput, total = measure_throughput(llm, args.repeat)
        prompts, params = workload()
        floor_throughput = total / floors.workload_s(prompts, params)
    llm.shutdown()

    shard = f" (one rank's part of TP {args.tp_shard})" if args.tp_shard > 1 else ""
    direct_max_tokens = triton_moe.DIRECT_MXFP4_MAX_TOKENS if quantized else triton_moe.DIRECT_MAX_TOKENS
    print(f"\n== {args.model}{shard} (random weights, experts in {'MXFP4' if quantized else 'bf16'}), TP "
          f"{args.tensor_parallel_size}, MoE routed directly up to {direct_max_tokens} tokens, on "
          f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops_rate / 1e12:.0f} "
          "TFLOP/s (measured)")
    print(f"per GPU: dense weights read per step {floors.dense_bytes / 1e9:.2f} GB, one expert "
          f"{floors.expert_bytes / 1e6:.2f} MB x {floors.moe_layers} layers, KV "
          f"{floors.kv_bytes_per_layer_token / 1024:.0f} KiB per token and layer, windows {dict(floors.windows)}")
    print(f"{'metric':<28} {'measured':>12} {'floor':>12} {'floor/measured':>15}")
    for name, seconds, floor in rows:
        print(f"{name:<28} {seconds * 1e3:9.2f} ms {floor * 1e3:9.2f} ms {floor / seconds:14.0%}")
    print_decode_kernels(kernels, num_layers)
    if args.tpot_only:
        return
    print(f"{f'throughput ({len(prompts)} requests)':<28} {throughput:8,.0f} t/s {floor_throughput:8,.0f} t/s "
          f"{throughput / floor_throughput:14.0%}   ({total:,} output tokens)")
    print(f"\n== the MoE layer alone (router, top-k and experts; {shape} experts) on one GPU, CUDA-graph replays")
    print(f"{'tokens':>6} {'experts':>7} {'us':>8} {'GB/s':>7} {'of copy bw':>10}")
    for tokens, reached, layer_us, gbps, fraction in layers:
        print(f"{tokens:>6} {reached:>7} {layer_us:8.1f} {gbps:7.0f} {fraction:10.0%}")


if __name__ == "__main__":
    main()
