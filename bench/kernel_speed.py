"""Triton kernels on the GPU: correctness against the torch reference over many shapes, then speed.

Run on a CUDA machine from the repo root:  PYTHONPATH=. python3 bench/kernel_speed.py
Every case runs with freshly allocated outputs poisoned with NaN, so an element a kernel forgets to write
fails the check. Timings are do_bench medians; bandwidth is the bytes a kernel must move divided by its
time, against PEAK_BYTES_PER_S (an H100's copy bandwidth). Failures are reported per case, not fatal.
"""
import contextlib
import sys
import time
import traceback

import torch
import torch.nn.functional as F


PEAK_BYTES_PER_S = 3.0e12
DTYPE = torch.bfloat16
QWEN3 = dict(num_q_heads=16, num_kv_heads=8, head_dim=128, hidden=1024, intermediate=3072)
CHECK_CONTEXTS = [1, 15, 16, 17, 255, 256, 257, 1000, 4095, 4096, 4097, 8192]
CHECK_MIXED = ([1, 1024, 1, 77, 300, 1], [8192, 1024, 1, 4173, 300, 4097])  # (query lengths, context lengths)
CHECK_VARLEN = [1, 1024, 17, 3000, 128]
CHECK_TOKENS = [1, 7, 8192]
DECODE_BATCHES = [1, 8, 64, 256]
DECODE_CONTEXTS = [512, 1024, 2048, 4096]
PREFILL_PROMPTS = [(1, 1024), (8, 1024)]  # (prompts, tokens each)
ELEMENTWISE_TOKENS = [256, 8192]


@contextlib.contextmanager
def poisoned_outputs():
    """Every floating torch.empty / empty_like inside comes back full of NaN."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(tensor):
        if tensor.is_floating_point():
            tensor.fill_(float("nan"))
        return tensor

    torch.empty = lambda *a, **kw: poison(empty(*a, **kw))
    torch.empty_like = lambda *a, **kw: poison(empty_like(*a, **kw))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


class Report:
    def __init__(self):
        self.checks = []  # (name, ok, detail)
        self.timings = []  # (name, shape, microseconds, GB/s or None, TFLOP/s or None)

    def check(self, name, fn):
        try:
            with poisoned_outputs():
                detail = fn()
            self.checks.append((name, True, detail or ""))
        except Exception as exc:  # noqa: BLE001 -- one failing case must not hide the others
            self.checks.append((name, False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"))
            traceback.print_exc(limit=3)

    def time(self, name, shape, fn, num_bytes=None, flops=None):
        import triton.testing

        try:
            ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
            gbps = num_bytes / (ms * 1e-3) / 1e9 if num_bytes else None
            tflops = flops / (ms * 1e-3) / 1e12 if flops else None
            self.timings.append((name, shape, ms * 1e3, gbps, tflops))
        except Exception as exc:  # noqa: BLE001
            self.timings.append((name, shape, None, None, f"{type(exc).__name__}: {str(exc)[:100]}"))
            traceback.print_exc(limit=3)

    def print(self):
        failed = [c for c in self.checks if not c[1]]
        print(f"\n== correctness: {len(self.checks) - len(failed)}/{len(self.checks)} cases pass")
        for name, _, detail in failed:
            print(f"FAIL {name}: {detail}")
        peak = PEAK_BYTES_PER_S / 1e12
        print(f"\n== speed on {torch.cuda.get_device_name()} (do_bench median; % of {peak:.1f} TB/s)")
        print(f"{'kernel':<22} {'shape':<34} {'us':>9} {'GB/s':>8} {'%peak':>6} {'TFLOP/s':>8}")
        for name, shape, us, gbps, extra in self.timings:
            if us is None:
                print(f"{name:<22} {shape:<34} FAILED {extra}")
                continue
            bw = f"{gbps:8.0f} {100 * gbps * 1e9 / PEAK_BYTES_PER_S:5.0f}%" if gbps else f"{'':>8} {'':>6}"
            tf = f"{extra:8.1f}" if extra else ""
            print(f"{name:<22} {shape:<34} {us:9.1f} {bw} {tf}")
        return not failed and all(t[2] is not None for t in self.timings)


def close(actual, expected, dtype):
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)
    return f"max err {(actual.float() - expected.float()).abs().max().item():.2e}"


def check_correctness(report, reference, triton_attention, elementwise, paged_batch):
    heads = [(8, 8, 1), (16, 8, 2), (32, 4, 8), (12, 4, 3)]
    contexts = CHECK_CONTEXTS
    for dtype in (torch.bfloat16, torch.float16):
        layouts = ((64, 16), (128, 16), (128, 256)) if dtype == torch.bfloat16 else ((128, 16),)
        for head_dim, block_size in layouts:
            for num_q, num_kv, group in heads:
                for splits in (None, 1, 8):
                    def decode(num_q=num_q, num_kv=num_kv, head_dim=head_dim, block_size=block_size, dtype=dtype,
                               splits=splits):
                        q, kc, vc, meta = paged_batch([1] * len(contexts), contexts, num_q, num_kv, head_dim,
                                                      block_size, dtype)
                        out = triton_attention.decode_attention(q, kc, vc, meta, head_dim**-0.5, num_splits=splits)
                        return close(out, reference.paged_attention(q, kc, vc, meta, head_dim**-0.5), dtype)
                    report.check(f"decode {dtype} D{head_dim} bs{block_size} G{group} splits={splits}", decode)

                def mixed(num_q=num_q, num_kv=num_kv, head_dim=head_dim, block_size=block_size, dtype=dtype):
                    q_lens, seq_lens = CHECK_MIXED
                    q, kc, vc, meta = paged_batch(q_lens, seq_lens, num_q, num_kv, head_dim, block_size, dtype)
                    out = triton_attention.paged_attention(q, kc, vc, meta, head_dim**-0.5)
                    return close(out, reference.paged_attention(q, kc, vc, meta, head_dim**-0.5), dtype)
                report.check(f"prefill+mixed {dtype} D{head_dim} bs{block_size} G{group}", mixed)

        for head_dim in (64, 128):
            for causal in (True, False):
                def varlen(head_dim=head_dim, causal=causal, dtype=dtype):
                    lengths = CHECK_VARLEN
                    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32).cuda()
                    q = torch.randn(sum(lengths), 16, head_dim, device="cuda", dtype=dtype)
                    k, v = (torch.randn(sum(lengths), 8, head_dim, device="cuda", dtype=dtype) for _ in range(2))
                    out = triton_attention.varlen_attention(q, k, v, cu, max(lengths), 0.1, causal)
                    return close(out, reference.varlen_attention(q, k, v, cu, max(lengths), 0.1, causal), dtype)
                report.check(f"varlen {dtype} D{head_dim} causal={causal}", varlen)

        for tokens in CHECK_TOKENS:
            def norms(tokens=tokens, dtype=dtype):
                x, r = (torch.randn(tokens, 1024, device="cuda", dtype=dtype) for _ in range(2))
                w = torch.randn(1024, device="cuda", dtype=dtype)
                close(elementwise["rms_norm"](x, w, 1e-6), reference.rms_norm(x, w, 1e-6), dtype)
                for a, b in zip(elementwise["add_rms_norm"](x, r, w, 1e-6), reference.add_rms_norm(x, r, w, 1e-6)):
                    close(a, b, dtype)

            def rotary(tokens=tokens, dtype=dtype):
                q = torch.randn(tokens, 16, 128, device="cuda", dtype=dtype)
                k = torch.randn(tokens, 8, 128, device="cuda", dtype=dtype)
                pos = torch.randint(0, 8192, (tokens,), device="cuda")
                cos_sin = torch.randn(8192, 128, device="cuda")
                expected = reference.apply_rotary(q, k, pos, cos_sin)
                for a, b in zip(elementwise["apply_rotary"](q, k, pos, cos_sin), expected):
                    close(a, b, dtype)

            def silu(tokens=tokens, dtype=dtype):
                x = torch.randn(tokens, 2 * 3072, device="cuda", dtype=dtype)
                return close(elementwise["silu_and_mul"](x), reference.silu_and_mul(x), dtype)

            def store(tokens=tokens, dtype=dtype):
                k, v = (torch.randn(tokens, 8, 128, device="cuda", dtype=dtype) for _ in range(2))
                slots = torch.randperm(1024 * 16, device="cuda")[:tokens]
                slots[::3] = -1
                caches = [torch.full((1024, 16, 8, 128), float("nan"), device="cuda", dtype=dtype) for _ in range(4)]
                elementwise["store_kv_cache"](k, v, caches[0], caches[1], slots)
                reference.store_kv_cache(k, v, caches[2], caches[3], slots)
                torch.testing.assert_close(caches[0], caches[2], rtol=0, atol=0, equal_nan=True)
                torch.testing.assert_close(caches[1], caches[3], rtol=0, atol=0, equal_nan=True)

            for name, fn in (("rms_norm+add", norms), ("rotary", rotary), ("silu_and_mul", silu),
                             ("store_kv_cache", store)):
                report.check(f"{name} {dtype} T{tokens}", fn)


def decode_inputs(batch, context, block_size=16):
    """Qwen3-0.6B-shaped decode step: every sequence at `context` tokens, blocks scattered at random."""
    from kernels.attention_metadata import AttentionMetadata

    n_kv, d = QWEN3["num_kv_heads"], QWEN3["head_dim"]
    per_seq = -(-context // block_size)
    num_blocks = batch * per_seq
    k_cache, v_cache = (torch.randn(num_blocks, block_size, n_kv, d, device="cuda", dtype=DTYPE) for _ in range(2))
    tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int64).to(torch.int32).view(batch, per_seq)
    q = torch.randn(batch, QWEN3["num_q_heads"], d, device="cuda", dtype=DTYPE)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device="cuda"),
        cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device="cuda"),
        block_tables=tables, max_seqlen_q=1, max_seqlen_k=context, is_decode=True,
    )
    return q, k_cache, v_cache, meta


def measure_speed(report, triton_attention, elementwise):
    n_q, n_kv, d = QWEN3["num_q_heads"], QWEN3["num_kv_heads"], QWEN3["head_dim"]
    hidden, inter = QWEN3["hidden"], QWEN3["intermediate"]
    elem = torch.finfo(DTYPE).bits // 8
    for batch in DECODE_BATCHES:
        for context in DECODE_CONTEXTS:
            try:
                q, kc, vc, meta = decode_inputs(batch, context)
            except Exception as exc:  # noqa: BLE001
                report.timings.append(("decode attn", f"B{batch} ctx{context}", None, None, repr(exc)[:100]))
                continue
            splits = triton_attention.choose_num_splits(batch * n_kv, context, q.device)
            kv_bytes = 2 * batch * context * n_kv * d * elem + 2 * q.numel() * elem
            report.time("decode attn", f"B{batch} ctx{context} splits={splits}",
                        lambda: triton_attention.paged_attention(q, kc, vc, meta, d**-0.5), num_bytes=kv_bytes)
            del q, kc, vc, meta
    torch.cuda.empty_cache()

    for num_prompts, tokens in PREFILL_PROMPTS:
        try:
            q, kc, vc, meta = decode_inputs(num_prompts, tokens)
            q = torch.randn(num_prompts * tokens, n_q, d, device="cuda", dtype=DTYPE)
            meta.cu_seqlens_q = torch.arange(0, num_prompts * tokens + 1, tokens, dtype=torch.int32, device="cuda")
            meta.max_seqlen_q, meta.is_decode = tokens, False
            meta.slot_mapping = torch.zeros(len(q), dtype=torch.int64, device="cuda")
        except Exception as exc:  # noqa: BLE001
            report.timings.append(("prefill attn", f"{num_prompts}x{tokens}", None, None, repr(exc)[:100]))
            continue
        flops = 4 * num_prompts * n_q * d * tokens * (tokens + 1) / 2  # causal: QK^T and PV over half the square
        report.time("prefill attn (paged)", f"{num_prompts}x{tokens} causal",
                    lambda: triton_attention.paged_attention(q, kc, vc, meta, d**-0.5), flops=flops)
        k, v = (torch.randn(len(q), n_kv, d, device="cuda", dtype=DTYPE) for _ in range(2))
        report.time("varlen attn", f"{num_prompts}x{tokens} causal",
                    lambda: triton_attention.varlen_attention(q, k, v, meta.cu_seqlens_q, tokens, d**-0.5, True),
                    flops=flops)
        qd, kd, vd = (t.view(num_prompts, tokens, -1, d).transpose(1, 2) for t in (q, k, v))
        report.time("torch sdpa (baseline)", f"{num_prompts}x{tokens} causal",
                    lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True), flops=flops)

    for tokens in ELEMENTWISE_TOKENS:
        x, r = (torch.randn(tokens, hidden, device="cuda", dtype=DTYPE) for _ in range(2))
        w = torch.randn(hidden, device="cuda", dtype=DTYPE)
        report.time("rms_norm", f"T{tokens} H{hidden}", lambda: elementwise["rms_norm"](x, w, 1e-6),
                    num_bytes=2 * x.numel() * elem)
        report.time("add_rms_norm", f"T{tokens} H{hidden}", lambda: elementwise["add_rms_norm"](x, r, w, 1e-6),
                    num_bytes=4 * x.numel() * elem)
        qr = torch.randn(tokens, n_q, d, device="cuda", dtype=DTYPE)
        kr = torch.randn(tokens, n_kv, d, device="cuda", dtype=DTYPE)
        pos = torch.randint(0, 8192, (tokens,), device="cuda")
        cos_sin = torch.randn(8192, d, device="cuda")
        report.time("rotary", f"T{tokens} {n_q}q/{n_kv}kv x{d}",
                    lambda: elementwise["apply_rotary"](qr, kr, pos, cos_sin),
                    num_bytes=2 * (qr.numel() + kr.numel()) * elem + tokens * d * 4)
        xs = torch.randn(tokens, 2 * inter, device="cuda", dtype=DTYPE)
        report.time("silu_and_mul", f"T{tokens} I{inter}", lambda: elementwise["silu_and_mul"](xs),
                    num_bytes=3 * tokens * inter * elem)
        ks, vs = (torch.randn(tokens, n_kv, d, device="cuda", dtype=DTYPE) for _ in range(2))
        kc, vc = (torch.empty(tokens // 16 + 1, 16, n_kv, d, device="cuda", dtype=DTYPE) for _ in range(2))
        slots = torch.randperm(tokens, device="cuda")
        report.time("store_kv_cache", f"T{tokens} {n_kv}kv x{d}",
                    lambda: elementwise["store_kv_cache"](ks, vs, kc, vc, slots), num_bytes=4 * ks.numel() * elem)


def main():
    if not torch.cuda.is_available():
        sys.exit("bench/kernel_speed.py needs a CUDA GPU (the Triton kernels are tested on CPU by tests/kernels)")
    from kernels import reference, triton_activation, triton_attention, triton_kv_cache, triton_norm, triton_rotary
    from tests.kernels.kernel_testing import paged_batch

    elementwise = dict(
        rms_norm=triton_norm.rms_norm, add_rms_norm=triton_norm.add_rms_norm,
        apply_rotary=triton_rotary.apply_rotary, silu_and_mul=triton_activation.silu_and_mul,
        store_kv_cache=triton_kv_cache.store_kv_cache,
    )
    torch.manual_seed(0)
    report = Report()
    start = time.perf_counter()
    check_correctness(report, reference, triton_attention, elementwise, paged_batch)
    print(f"correctness took {time.perf_counter() - start:.0f} s", flush=True)
    measure_speed(report, triton_attention, elementwise)
    ok = report.print()
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
