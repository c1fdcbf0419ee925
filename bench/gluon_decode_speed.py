"""FP8 decode attention, the Gluon kernel (kernels/gluon_decode.py) against the Triton one it replaces for large
batches and against a kernel that only reads the same keys and values, at batch 256, 192, 128 and 64 of the
Qwen3-0.6B shape (16 query / 8 KV heads of 128, blocks of 16) over contexts drawn from [100, 2100].

The read-only kernel (Triton) walks the same block tables with 16-byte loads, 128 keys per step and 8 warps per
(sequence, KV head), and only xors what it reads: about what any kernel over this cache and these contexts needs.
Times are medians of 30 launches, each after a sum over another 1 GiB buffer, which leaves L2 holding clean lines:
do_bench's flush (a memset) leaves it full of dirty ones that the timed kernel writes back; the last table shows
what that adds to the engine's kernel.

Needs a GPU with e4m3 conversions (compute capability 8.9 or later):
PYTHONPATH=. python3 bench/gluon_decode_speed.py [--configs WARPS,MAX_REGISTERS ...]
"""
import argparse
import contextlib
import functools
import itertools
import random

import torch
import triton
import triton.language as tl
import triton.testing

from kernels import gluon_decode, reference
from kernels.attention_metadata import AttentionMetadata
from kernels.triton_attention import decode_attention
from kernels.triton_prologue import qkv_prologue

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, MAX_MODEL_LEN = 16, 8, 128, 16, 4096
FP8 = torch.float8_e4m3fn
BATCHES = (256, 192, 128, 64)


def decode_step(lengths: list[int]):
    """The fused projection's rows, an FP8 cache holding each sequence's context in scattered blocks (quantized
    with per-head scales), and the step's metadata (each new token's slot at the end of its context)."""
    batch, per_seq = len(lengths), [-(-n // BLOCK_SIZE) for n in lengths]
    scales = tuple(torch.full((NUM_KV_HEADS,), 2.0 ** -5, device="cuda") for _ in range(2))
    shape = (sum(per_seq), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = (reference.quantize_kv(torch.randn(shape, device="cuda").flatten(0, 1), scale).view(shape)
                        for scale in scales)
    order = torch.randperm(sum(per_seq), device="cuda").to(torch.int32)
    tables = torch.zeros(batch, MAX_MODEL_LEN // BLOCK_SIZE, dtype=torch.int32, device="cuda")
    for row, (start, count) in enumerate(zip(itertools.accumulate(per_seq, initial=0), per_seq)):
        tables[row, :count] = order[start:start + count]
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    rows = torch.arange(batch, device="cuda")
    slots = tables[rows, (seq_lens - 1) // BLOCK_SIZE].long() * BLOCK_SIZE + (seq_lens - 1) % BLOCK_SIZE
    meta = AttentionMetadata(slot_mapping=slots, cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
                             seq_lens=seq_lens, block_tables=tables, max_seqlen_q=1, max_seqlen_k=MAX_MODEL_LEN,
                             is_decode=True, seq_order=torch.argsort(seq_lens, descending=True).to(torch.int32))
    qkv = torch.randn(batch, (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    return qkv, k_cache, v_cache, meta, scales


def rotary_and_norms():
    """Qwen3's rotary table (theta 1e6) and q and k norm weights."""
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    freqs = torch.outer(torch.arange(MAX_MODEL_LEN, dtype=torch.float32), inv_freq)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).cuda()
    norms = tuple(torch.rand(HEAD_DIM, device="cuda", dtype=torch.bfloat16) + 0.5 for _ in range(2))
    return cos_sin, norms


@triton.jit
def _read_only_kernel(k_ptr, v_ptr, tables_ptr, seq_lens_ptr, order_ptr, out_ptr, stride_bt, stride_slot,
                      WORDS: tl.constexpr, KEYS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    head = tl.program_id(0)
    seq = tl.load(order_ptr + tl.program_id(1))
    n = tl.load(seq_lens_ptr + seq)
    keys = tl.arange(0, KEYS)
    words = tl.arange(0, WORDS)
    acc = tl.zeros([KEYS, WORDS], tl.int32)
    for start in range(0, n, KEYS):
        inside = (start + keys) < n
        block = tl.load(tables_ptr + seq * stride_bt + (start + keys) // BLOCK_SIZE, mask=inside, other=0)
        offsets = (block.to(tl.int64) * BLOCK_SIZE + (start + keys) % BLOCK_SIZE)[:, None] * stride_slot \
            + head * WORDS + words[None, :]
        acc ^= tl.load(k_ptr + offsets, mask=inside[:, None], other=0)
        acc ^= tl.load(v_ptr + offsets, mask=inside[:, None], other=0)
    tl.store(out_ptr + tl.program_id(1) * tl.num_programs(0) + head, tl.sum(tl.sum(acc, 1), 0))


def read_only(k_cache, v_cache, meta, keys=128, warps=8):
    """A launch that reads every key and value of the batch, as int32 words."""
    k_words, v_words = k_cache.view(torch.int32), v_cache.view(torch.int32)
    out = torch.empty(meta.seq_lens.shape[0] * k_cache.shape[2], dtype=torch.int32, device=k_cache.device)
    return lambda: _read_only_kernel[(k_cache.shape[2], meta.seq_lens.shape[0])](
        k_words, v_words, meta.block_tables, meta.seq_lens, meta.seq_order, out, meta.block_tables.stride(0),
        k_words.stride(1), WORDS=k_words.shape[3], KEYS=keys, BLOCK_SIZE=k_cache.shape[1], num_warps=warps,
        num_stages=1)


def clean_l2_us(fn, other, repeats=30):
    """Median microseconds of fn, each run after a sum over `other` has replaced L2's lines by clean ones."""
    total = torch.zeros((), device=other.device)
    times = []
    for _ in range(repeats):
        torch.sum(other, dim=(0,), out=total)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[repeats // 2]


@contextlib.contextmanager
def triton_only():
    """The Gluon kernel switched off: decode_attention runs the Triton kernel."""
    supports = gluon_decode.supports
    gluon_decode.supports = lambda *args: False
    try:
        yield
    finally:
        gluon_decode.supports = supports


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=["1,0", "2,0", "4,0", "8,0"], metavar="WARPS,MAX_REGISTERS",
                    help="Gluon launches to time beside the engine's choice (0 registers: the compiler's choice)")
    args = ap.parse_args()
    configs = [tuple(map(int, spec.split(","))) for spec in args.configs]
    random.seed(0)
    torch.manual_seed(0)
    cos_sin, norms = rotary_and_norms()
    other = torch.ones(256 * 2**20, device="cuda")  # 1 GiB: its sum outlasts any launch's host work
    scale = HEAD_DIM**-0.5
    bias = []
    print(f"{'batch':>5} {'kernel':32} {'us':>8} {'TB/s':>6} {'max err':>8}")
    for batch in BATCHES:
        lengths = [random.randint(100, 2100) for _ in range(batch)]
        qkv, k_cache, v_cache, meta, scales = decode_step(lengths)
        q, _, _ = qkv_prologue(qkv, meta.seq_lens.long() - 1, cos_sin, NUM_Q_HEADS, NUM_KV_HEADS, *norms,
                               1e-6, k_cache, v_cache, meta.slot_mapping, False, *scales)
        expected = reference.paged_attention(q, k_cache, v_cache, meta, scale, 0, None, *scales).float()
        kv_bytes = 2 * sum(lengths) * NUM_KV_HEADS * HEAD_DIM
        engine = functools.partial(decode_attention, q, k_cache, v_cache, meta, scale, k_scale=scales[0],
                                   v_scale=scales[1])
        kernels = {"engine's choice": engine, "Triton": engine}
        for warps, registers in configs:
            kernels[f"Gluon, {warps} warps, registers {registers or 'free'}"] = functools.partial(
                gluon_decode.decode_attention, q, k_cache, v_cache, meta, scale, *scales, warps=warps,
                max_registers=registers)
        kernels["read only"] = read_only(k_cache, v_cache, meta)
        for name, fn in kernels.items():
            with triton_only() if name == "Triton" else contextlib.nullcontext():
                error = (fn().float() - expected).abs().max().item() if name != "read only" else float("nan")
                us = clean_l2_us(fn, other)
            print(f"{batch:5d} {name:32} {us:8.1f} {kv_bytes / us / 1e6:6.2f} {error:8.1e}", flush=True)
        with triton_only():
            bias.append((batch, clean_l2_us(engine, other),
                         triton.testing.do_bench(engine, warmup=20, rep=100, return_mode="median") * 1e3))
    print(f"\n{'batch':>5} {'Triton kernel, clean L2 (us)':>30} {'do_bench, dirty L2 (us)':>26}")
    for batch, clean, dirty in bias:
        print(f"{batch:5d} {clean:30.1f} {dirty:26.1f}")


if __name__ == "__main__":
    main()
