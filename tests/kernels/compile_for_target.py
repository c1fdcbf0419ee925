"""Compile every Triton and Gluon kernel the engine launches on one GPU generation, without that GPU (or any).

The engine's own launch code runs (kernels/triton_*.py, kernels/gluon_decode.py) on CPU tensors of the shapes a
step gives them, with the answers of that GPU: its compute capability (through kernels/gpu_features.py, with
HFENDPOINT_GPU_FEATURES' words turned off), its multiprocessors, shared memory and L2 (which choose the tiles).
Each launch compiles instead of running: Triton's JIT specializes it as for a real launch and compiles it for the
target with its bundled ptxas, which needs no driver. A kernel that cannot lower raises; one whose shared memory
exceeds what a program may take on that GPU is reported, since it could not be loaded there.

Run it without TRITON_INTERPRET (the interpreter compiles nothing): tests/kernels/test_compile_targets.py does, once
per target. `python tests/kernels/compile_for_target.py 89 [portable]` prints a line per compiled kernel, then a
JSON summary line.
"""
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's packages

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import KernelInterface

from kernels import (
    gluon_decode,
    gpu_features,
    triton_activation,
    triton_all_reduce_norm,
    triton_attention,
    triton_fp8_gemm,
    triton_linear,
    triton_moe,
    triton_norm,
    triton_prologue,
    triton_sampling,
)
from kernels.attention_metadata import AttentionMetadata
from kernels.mxfp4 import GROUP_SIZE, Mxfp4Weight

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Gpu:
    """What the launch code asks of a device: one GPU that Inference Endpoints offers per compute capability."""
    name: str
    capability: tuple[int, int]
    sms: int
    shared_memory_per_sm: int  # a program may take all of it but the 1 KB the driver keeps
    l2_bytes: int

    @property
    def shared_memory(self) -> int:
        return self.shared_memory_per_sm - 1024


GPUS = {gpu.capability[0] * 10 + gpu.capability[1]: gpu for gpu in (
    Gpu("T4", (7, 5), 40, 64 << 10, 4 << 20),
    Gpu("A100", (8, 0), 108, 164 << 10, 40 << 20),
    Gpu("A10G", (8, 6), 80, 100 << 10, 6 << 20),
    Gpu("L4", (8, 9), 58, 100 << 10, 48 << 20),
    Gpu("H100", (9, 0), 132, 228 << 10, 50 << 20),
    Gpu("B200", (10, 0), 148, 228 << 10, 126 << 20),
)}

# The Qwen3-0.6B shape (the engine's benchmark model): hidden 1024, 16 query and 8 KV heads of 128, MLP 3072.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, BLOCK = 1024, 16, 8, 128, 3072, 16
QKV = (HEADS + 2 * KV_HEADS) * HEAD_DIM
WIDE_HEAD_DIM = 256  # Gemma 3's


class CompileOnlyDriver:
    """Triton's view of the current device, for the JIT: the target GPU, device 0, no stream."""

    def __init__(self, capability: int):
        self.target = GPUTarget("cuda", capability, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def pretend(gpu: Gpu, disabled: frozenset[str], compiled: list) -> None:
    """Make the launch code see `gpu`, and every launch compile (appending the compiled kernel) instead of run."""
    driver.set_active(CompileOnlyDriver(gpu.capability[0] * 10 + gpu.capability[1]))
    gpu_features.has = lambda feature, tensor: gpu_features.supported(feature, gpu.capability, disabled)
    for module in (triton_linear, triton_attention, triton_fp8_gemm, gluon_decode):
        module.num_sms = lambda device: gpu.sms
    for module in (triton_linear, triton_fp8_gemm, triton_attention):
        module.memory_sizes = lambda device: (gpu.shared_memory, gpu.l2_bytes)

    def compile_instead(kernel, grid):
        name = f"{kernel.fn.__module__}.{kernel.fn.__name__}"
        return lambda *args, **kwargs: compiled.append((name, kernel.warmup(*args, grid=grid, **kwargs)))

    KernelInterface.__getitem__ = compile_instead


def decode_meta(num_seqs: int, context: int) -> AttentionMetadata:
    blocks = math.ceil(context / BLOCK)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.zeros(num_seqs, dtype=torch.int64),
        cu_seqlens_q=torch.arange(num_seqs + 1, dtype=torch.int32),
        seq_lens=seq_lens, block_tables=torch.zeros((num_seqs, blocks), dtype=torch.int32), max_seqlen_q=1,
        max_seqlen_k=context, is_decode=True, seq_order=torch.arange(num_seqs, dtype=torch.int32))


def prefill_meta(q_lens: list[int], contexts: list[int]) -> AttentionMetadata:
    blocks = math.ceil(max(contexts) / BLOCK)
    return AttentionMetadata(
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64),
        cu_seqlens_q=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor(contexts, dtype=torch.int32),
        block_tables=torch.zeros((len(q_lens), blocks), dtype=torch.int32), max_seqlen_q=max(q_lens),
        max_seqlen_k=max(contexts), is_decode=False)


def caches(cache_dtype: torch.dtype, head_dim: int = HEAD_DIM, num_blocks: int = 64):
    """A paged K and V cache and, for FP8, their per-head scales."""
    shape = (num_blocks, BLOCK, KV_HEADS, head_dim)
    scales = (torch.ones(KV_HEADS), torch.ones(KV_HEADS)) if cache_dtype == FP8 else (None, None)
    return torch.empty(shape, dtype=cache_dtype), torch.empty(shape, dtype=cache_dtype), *scales


def launch_layers(dtype: torch.dtype) -> None:
    """A decoder layer's launches outside attention, at decode and prefill sizes: norms, projections (each of the
    split-K kernel's row tiles and, where the GPU has them, descriptors), the fused MLP and the separate
    activation, the sampler's kernels."""
    eps = 1e-6
    for rows in (1, 512):
        x = torch.empty(rows, HIDDEN, dtype=dtype)
        triton_norm.rms_norm(x, torch.empty(HIDDEN, dtype=dtype), eps)
        triton_norm.add_rms_norm(x, torch.empty_like(x), torch.empty(HIDDEN, dtype=dtype), eps)
    exchange = triton_all_reduce_norm.Exchange(0, tuple(torch.empty(8, HIDDEN, dtype=dtype) for _ in range(2)),
                                               tuple(torch.empty(2, 8, 2, dtype=torch.int32) for _ in range(2)))
    x = torch.empty(1, HIDDEN, dtype=dtype)
    for residual in (torch.empty_like(x), None):  # a tensor-parallel sum with the residual add, and alone
        triton_all_reduce_norm.all_reduce_rms_norm(x, residual, torch.empty(HIDDEN, dtype=dtype), eps, exchange)
    for rows in (1, 64, 128, 256):  # choose_config's branches: 16-row tiles, 64-row, descriptors in one and two waves
        x = torch.empty(rows, HIDDEN, dtype=dtype)
        for n, k in ((QKV, HIDDEN), (HIDDEN, INTER)):  # a wide and a narrow output
            triton_linear.decode_linear(torch.empty(rows, k, dtype=dtype), torch.empty(n, k, dtype=dtype), None)
        triton_linear.gated_linear(x, torch.empty(2 * INTER, HIDDEN, dtype=dtype), None, "silu")
    triton_linear.gated_linear(torch.empty(8, HIDDEN, dtype=dtype), torch.empty(2 * INTER, HIDDEN, dtype=dtype),
                               torch.empty(2 * INTER, dtype=dtype), "gelu_tanh")
    triton_activation.silu_and_mul(torch.empty(512, 2 * INTER, dtype=dtype))
    triton_activation.gelu_tanh_and_mul(torch.empty(512, 2 * INTER, dtype=dtype))
    vocab = 151936
    logits = torch.empty(64, vocab, dtype=torch.float32)
    triton_sampling.gumbel_argmax(logits, torch.ones(64), torch.zeros(64, dtype=torch.int64))
    triton_sampling.apply_token_bitmask(logits, torch.empty(4, math.ceil(vocab / 32), dtype=torch.int32),
                                        torch.arange(4, dtype=torch.int32))


def launch_attention(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """The prologue and attention launches of a step over a cache of cache_dtype: prefill chunks over a cached
    prefix, decode with the prologue fused at small (split) and large (unsplit) batches, decode apart from its
    prologue where the Gluon kernel takes large FP8 batches, attention without a cache (encoders, both masks),
    a sliding window with sinks (gpt-oss, head_dim 64), and a prefill with image spans in full and sliding layers
    (Gemma 3's image tokens)."""
    k_cache, v_cache, k_scale, v_scale = caches(cache_dtype)
    cos_sin = torch.empty(4096, HEAD_DIM, dtype=torch.float32)
    norms = (torch.empty(HEAD_DIM, dtype=dtype), torch.empty(HEAD_DIM, dtype=dtype))
    scale = HEAD_DIM ** -0.5
    prefill = prefill_meta([48, 16], [112, 16])
    qkv = torch.empty(64, QKV, dtype=dtype)
    q, _, _ = triton_prologue.qkv_prologue(qkv, torch.zeros(64, dtype=torch.int64), cos_sin, HEADS, KV_HEADS, *norms,
                                           1e-6, k_cache, v_cache, prefill.slot_mapping, False, k_scale, v_scale)
    triton_attention.paged_attention(q, k_cache, v_cache, prefill, scale, 0, None, k_scale, v_scale)
    for num_seqs, context in ((4, 1000), (256, 64)):
        meta = decode_meta(num_seqs, context)
        qkv = torch.empty(num_seqs, QKV, dtype=dtype)
        if triton_attention.decodes_apart(qkv, HEADS, k_cache, meta):
            q, _, _ = triton_prologue.qkv_prologue(qkv, torch.zeros(num_seqs, dtype=torch.int64), cos_sin, HEADS,
                                                   KV_HEADS, *norms, 1e-6, k_cache, v_cache, meta.slot_mapping,
                                                   False, k_scale, v_scale)
            triton_attention.paged_attention(q, k_cache, v_cache, meta, scale, 0, None, k_scale, v_scale)
        else:
            triton_attention.qkv_decode_attention(qkv, cos_sin, HEADS, KV_HEADS, *norms, 1e-6, k_cache, v_cache,
                                                  meta, scale, k_scale=k_scale, v_scale=v_scale)
            triton_attention.qkv_decode_attention(qkv, cos_sin, HEADS, KV_HEADS, *norms, 1e-6, k_cache, v_cache,
                                                  meta, scale, k_scale=k_scale, v_scale=v_scale,
                                                  positions=torch.zeros(num_seqs, dtype=torch.int64))  # M-RoPE's
    k_cache, v_cache, k_scale, v_scale = caches(cache_dtype, head_dim=64)
    sinks = torch.empty(HEADS, dtype=dtype)
    for meta in (prefill, decode_meta(4, 1000)):
        q = torch.empty(meta.slot_mapping.shape[0], HEADS, 64, dtype=dtype)
        triton_attention.paged_attention(q, k_cache, v_cache, meta, 0.125, 128, sinks, k_scale, v_scale)
    k_cache, v_cache, k_scale, v_scale = caches(cache_dtype)
    prefill.image_spans = torch.zeros(64, 2, dtype=torch.int64)
    q = torch.empty(64, HEADS, HEAD_DIM, dtype=dtype)
    for window in (0, 1024):
        triton_attention.paged_attention(q, k_cache, v_cache, prefill, scale, window, None, k_scale, v_scale)


def launch_wide_heads(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """Gemma 3's heads of WIDE_HEAD_DIM (4B to 27B): prefill chunks, with image spans, in full and sliding
    layers, and the fused decode."""
    k_cache, v_cache, k_scale, v_scale = caches(cache_dtype, head_dim=WIDE_HEAD_DIM)
    scale = WIDE_HEAD_DIM ** -0.5
    prefill = prefill_meta([48, 16], [112, 16])
    q = torch.empty(64, HEADS, WIDE_HEAD_DIM, dtype=dtype)
    for spans in (None, torch.zeros(64, 2, dtype=torch.int64)):
        prefill.image_spans = spans
        for window in (0, 1024):
            triton_attention.paged_attention(q, k_cache, v_cache, prefill, scale, window, None, k_scale, v_scale)
    meta = decode_meta(4, 1000)
    qkv = torch.empty(4, (HEADS + 2 * KV_HEADS) * WIDE_HEAD_DIM, dtype=dtype)
    norms = (torch.empty(WIDE_HEAD_DIM, dtype=dtype), torch.empty(WIDE_HEAD_DIM, dtype=dtype))
    triton_attention.qkv_decode_attention(qkv, torch.empty(4096, WIDE_HEAD_DIM, dtype=torch.float32), HEADS,
                                          KV_HEADS, *norms, 1e-6, k_cache, v_cache, meta, scale, k_scale=k_scale,
                                          v_scale=v_scale)


def launch_without_cache(dtype: torch.dtype) -> None:
    """Attention within packed sequences (encoders, and prompts run without a cache), causal or not, with the
    prologue returning k and v."""
    cu_seqlens = torch.tensor([0, 48, 64], dtype=torch.int32)
    qkv = torch.empty(64, QKV, dtype=dtype)
    q, k, v = triton_prologue.qkv_prologue(qkv, torch.zeros(64, dtype=torch.int64),
                                           torch.empty(4096, HEAD_DIM, dtype=torch.float32), HEADS, KV_HEADS)
    for causal in (True, False):
        triton_attention.varlen_attention(q, k, v, cu_seqlens, 48, HEAD_DIM ** -0.5, causal)


def launch_moe(dtype: torch.dtype, mxfp4: bool) -> None:
    """A mixture of experts' routing, sort and grouped GEMMs at decode and prefill sizes: SiLU (Qwen3-MoE) and
    gpt-oss's clamped SwiGLU with biases; and a single token's direct routing (route, then the GEMMs without the
    sort), with and without biases; where the GPU reads them, MXFP4 experts."""
    experts, hidden, inter, top_k = 8, 256, 128, 2
    w_gate_up, w_down = torch.empty(experts, 2 * inter, hidden, dtype=dtype), torch.empty(experts, hidden, inter,
                                                                                          dtype=dtype)
    for tokens in (4, 128, 1024):
        ids, weights = triton_moe.select_experts(torch.empty(tokens, experts, dtype=dtype), top_k, True)
        triton_moe.fused_moe(torch.empty(tokens, hidden, dtype=dtype), ids, weights, w_gate_up, w_down)
    biases = (torch.empty(experts, 2 * inter, dtype=dtype), torch.empty(experts, hidden, dtype=dtype))
    triton_moe.fused_moe(torch.empty(4, hidden, dtype=dtype), ids[:4], weights[:4], w_gate_up, w_down, *biases,
                         "clamped_swiglu")
    router = torch.empty(experts, hidden, dtype=dtype)
    triton_moe.routed_experts(torch.empty(1, hidden, dtype=dtype), router, None, top_k, True, w_gate_up, w_down)
    triton_moe.routed_experts(torch.empty(1, hidden, dtype=dtype), router, torch.empty(experts, dtype=dtype), top_k,
                              True, w_gate_up, w_down, *biases, "clamped_swiglu")
    if mxfp4:  # gpt-oss's packed experts, sorted and direct
        packed = [Mxfp4Weight(torch.empty(experts, rows, cols // 2, dtype=torch.uint8),
                              torch.empty(experts, rows, cols // GROUP_SIZE, dtype=torch.uint8))
                  for rows, cols in ((2 * inter, hidden), (hidden, inter))]
        for tokens in (4, 128):
            triton_moe.fused_moe(torch.empty(tokens, hidden, dtype=dtype), ids[:tokens], weights[:tokens], *packed,
                                 *biases, "clamped_swiglu")
        triton_moe.routed_experts(torch.empty(1, hidden, dtype=dtype), router, torch.empty(experts, dtype=dtype),
                                  top_k, True, *packed, *biases, "clamped_swiglu")


def launch_fp8_gemms(dtype: torch.dtype, scaled_mm: bool) -> None:
    """FP8 weights' projections: our block-scaled Triton GEMM at decode (K split) and prefill sizes, with 128 x 128
    blocks and per-channel scales; where torch._scaled_mm runs instead, its activation quantization."""
    n, k = QKV, HIDDEN
    weight = torch.empty(n, k, dtype=FP8)
    for rows in (1, 64, 512):
        x = torch.empty(rows, k, dtype=dtype)
        triton_fp8_gemm.triton_fp8_linear(x, weight, torch.empty(n // 128, k // 128), (128, 128))
        triton_fp8_gemm.triton_fp8_linear(x, weight, torch.empty(n, 1), (1, k), torch.empty(n, dtype=dtype))
        if scaled_mm:
            triton_fp8_gemm.quantize_rows(x)


def launch_all(gpu: Gpu, disabled: frozenset[str]) -> None:
    """Every launch the engine makes on gpu, in its default dtype, with the features `disabled` turned off."""
    dtype = torch.bfloat16 if gpu_features.supported("bfloat16", gpu.capability, disabled) else torch.float16
    e4m3 = gpu_features.supported("e4m3", gpu.capability, disabled)
    launch_layers(dtype)
    launch_without_cache(dtype)
    launch_moe(dtype, gpu_features.supported("mxfp4", gpu.capability, disabled))
    for cache_dtype in (dtype, FP8) if e4m3 else (dtype,):
        launch_attention(dtype, cache_dtype)
        launch_wide_heads(dtype, cache_dtype)
    if e4m3:
        launch_fp8_gemms(dtype, gpu_features.supported("scaled_mm", gpu.capability, disabled))


def main():
    capability = int(sys.argv[1])
    disabled = gpu_features.parse(sys.argv[2] if len(sys.argv) > 2 else "auto")
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET: the interpreter compiles nothing")
    gpu = GPUS[capability]
    compiled = []
    pretend(gpu, disabled, compiled)
    launch_all(gpu, disabled)
    kernels, too_large = {}, []
    for name, kernel in compiled:
        shared = kernel.metadata.shared
        kernels[name] = kernels.get(name, 0) + 1
        if shared > gpu.shared_memory:
            too_large.append(f"{name} ({shared} bytes)")
    print(json.dumps({"triton": triton.__version__, "gpu": gpu.name, "launches": len(compiled), "kernels": kernels,
                      "shared_memory_over": too_large}), flush=True)
    os._exit(0)  # no interpreter teardown: Triton's bindings report their objects as leaked there


if __name__ == "__main__":
    main()
