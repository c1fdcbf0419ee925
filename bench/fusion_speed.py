"""The fused attention prologue on the GPU: correctness against the torch reference at Qwen3-0.6B shapes, then
speed against the separate launches it replaces.

Run on a CUDA machine from the repo root:  PYTHONPATH=. python3 bench/fusion_speed.py
q_norm + k_norm (with the copies their reshapes make) + rotary + store_kv_cache as four Triton launches (the
last two from bench/unfused_prologue.py), against the one fused launch. "eager" is do_bench's median with the
host launching every call (what a prefill pays); "graph" is GPU time alone (20 calls replayed from a CUDA
graph, what decode pays).
Cases that fail are reported, not fatal; the exit status is 1 if any did.
"""
import sys
import traceback

import torch
import triton
import triton.testing

from kernels import reference, triton_norm, triton_prologue
from unfused_prologue import apply_rotary, store_kv_cache

DTYPE = torch.bfloat16
HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128
EPS = 1e-6
PROLOGUE_TOKENS = [1, 64, 256, 1024]
NUM_BLOCKS, BLOCK_SIZE = 1024, 16
failures = []


def check(name, fn):
    try:
        fn()
        print(f"ok   {name}")
    except Exception as exc:  # noqa: BLE001 -- one failing case must not hide the others
        failures.append(name)
        print(f"FAIL {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        traceback.print_exc(limit=2)


def close(actual, expected, tol=2e-2):
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


def bench_us(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def graph_us(fn, calls=20):
    """GPU time per call, without host launch overhead: `calls` calls captured in one graph, replayed."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return triton.testing.do_bench(graph.replay, warmup=5, rep=40, return_mode="median") * 1e3 / calls


# ---- prologue -------------------------------------------------------------------------------------


def prologue_inputs(tokens):
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda", dtype=DTYPE)
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32, device="cuda") / HEAD_DIM))
    freqs = torch.outer(torch.arange(8192, dtype=torch.float32, device="cuda"), inv_freq)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    norms = tuple(torch.rand(HEAD_DIM, device="cuda", dtype=DTYPE) + 0.5 for _ in range(2))
    caches = [torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(4)]
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, device="cuda")[:tokens]
    slots[::5] = -1
    return qkv, positions, cos_sin, norms, caches, slots


def separate_prologue(qkv, positions, cos_sin, norms, k_cache, v_cache, slots):
    """What Attention.forward did before the fusion, kernel for kernel (bench/unfused_prologue.py)."""
    num_tokens = qkv.shape[0]
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    q = q.view(num_tokens, HEADS, HEAD_DIM)
    k = k.view(num_tokens, KV_HEADS, HEAD_DIM)
    v = v.view(num_tokens, KV_HEADS, HEAD_DIM)
    q = triton_norm.rms_norm(q.reshape(-1, HEAD_DIM), norms[0], EPS).view(q.shape)
    k = triton_norm.rms_norm(k.reshape(-1, HEAD_DIM), norms[1], EPS).view(k.shape)
    q, k = apply_rotary(q, k, positions, cos_sin)
    store_kv_cache(k, v, k_cache, v_cache, slots)
    return q


def fused_prologue(qkv, positions, cos_sin, norms, k_cache, v_cache, slots):
    return triton_prologue.qkv_prologue(qkv, positions, cos_sin, HEADS, KV_HEADS, *norms, EPS, k_cache, v_cache,
                                        slots, return_kv=False)[0]


def check_prologue():
    for tokens in PROLOGUE_TOKENS + [4096]:
        for qk_norm in (True, False):
            def case(tokens=tokens, qk_norm=qk_norm):
                qkv, positions, cos_sin, norms, (kc, vc, kr, vr), slots = prologue_inputs(tokens)
                norms = norms if qk_norm else (None, None)
                q, _, _ = triton_prologue.qkv_prologue(qkv, positions, cos_sin, HEADS, KV_HEADS, *norms, EPS, kc, vc,
                                                       slots, return_kv=False)
                q_ref, _, _ = reference.qkv_prologue(qkv, positions, cos_sin, HEADS, KV_HEADS, *norms, EPS, kr, vr,
                                                     slots)
                close(q, q_ref)
                close(kc, kr)
                assert torch.equal(vc, vr), "v cache differs"
                q2, k2, v2 = triton_prologue.qkv_prologue(qkv, positions, cos_sin, HEADS, KV_HEADS, *norms, EPS)
                _, k_ref, v_ref = reference.qkv_prologue(qkv, positions, cos_sin, HEADS, KV_HEADS, *norms, EPS)
                close(k2, k_ref)
                assert torch.equal(v2, v_ref)
            check(f"prologue T={tokens} qk_norm={qk_norm}", case)
        check(f"unfused baseline T={tokens}", lambda tokens=tokens: check_baseline(tokens))


def check_baseline(tokens):
    """The separate launches compute what the fused prologue does (so the timings compare like with like)."""
    qkv, positions, cos_sin, norms, (kc, vc, kr, vr), slots = prologue_inputs(tokens)
    q = separate_prologue(qkv, positions, cos_sin, norms, kc, vc, slots)
    q_ref, _, _ = reference.qkv_prologue(qkv, positions, cos_sin, HEADS, KV_HEADS, *norms, EPS, kr, vr, slots)
    close(q, q_ref)
    close(kc, kr)
    assert torch.equal(vc, vr), "v cache differs"


def time_prologue():
    print(f"\n== prologue (Qwen3-0.6B: {HEADS}q/{KV_HEADS}kv x {HEAD_DIM}, q/k norm, paged store), us per call")
    print(f"{'T':>6} {'separate eager':>15} {'fused eager':>12} {'separate graph':>15} {'fused graph':>12}")
    for tokens in PROLOGUE_TOKENS:
        qkv, positions, cos_sin, norms, (kc, vc, _, _), slots = prologue_inputs(tokens)
        args = (qkv, positions, cos_sin, norms, kc, vc, slots)
        times = [bench_us(lambda: separate_prologue(*args)), bench_us(lambda: fused_prologue(*args)),
                 graph_us(lambda: separate_prologue(*args)), graph_us(lambda: fused_prologue(*args))]
        print(f"{tokens:>6} {times[0]:>15.1f} {times[1]:>12.1f} {times[2]:>15.1f} {times[3]:>12.1f}")


def main():
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    check_prologue()
    time_prologue()
    print(f"\n{len(failures)} failed checks" + (f": {', '.join(failures)}" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
