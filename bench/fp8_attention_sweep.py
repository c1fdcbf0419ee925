"""Decode attention over an FP8 KV cache against bf16, and the FP8 kernel's tiles swept: one layer's decode step of the
Qwen3-0.6B shape (16 query / 8 KV heads of 128, blocks of 16) through the fused qkv decode kernel (prologue,
quantizing store, attention: the engine's below 4 (sequence, KV head) pairs per SM; larger FP8 batches run
kernels/gluon_decode.py, which bench/gluon_decode_speed.py times), at batch 256, 128, 64, 16 and 1, contexts drawn
from [100, 2100] (the throughput workload's spread; 1,024 at batch 1). Each FP8 tile configuration (DecodeTiles:
keys per tile, warps, pipeline stages, fewest keys per split, register caps unsplit and split) is checked against
the torch reference once, then timed with do_bench (L2 flushed before each run). Prints the launch's splits and
register cap, microseconds and TB/s of KV read per configuration and batch, each configuration's time summed over
the batches (the throughput workload's decode steps are mostly at 128-256), and the best, as the line to put in
kernels/triton_attention.py. A last table times a prefill step (16 chunks of 512 tokens after 0-512 cached ones) and
its prologue, bf16 against FP8.

Run on a CUDA machine from the repository root: PYTHONPATH=. python3 bench/fp8_attention_sweep.py [--quick] [--tiles
128,4,1 64,2,2 ...].
bench/throughput.py and bench/latency.py take the best line's numbers as --decode-tiles
N,WARPS,STAGES,MIN_SPLIT,MAX_REGISTERS[,SPLIT_MAX_REGISTERS] (use_decode_tiles) to try them end to end."""
import argparse
import functools
import itertools
import random

import torch
import triton.testing

from kernels import reference, triton_attention
from kernels.attention_metadata import AttentionMetadata
from kernels.triton_attention import (
    DECODE_TILES,
    FP8_DECODE_TILES,
    DecodeTiles,
    choose_num_splits,
    prefill_attention,
    qkv_decode_attention,
)
from kernels.triton_prologue import qkv_prologue

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, MAX_MODEL_LEN = 16, 8, 128, 16, 4096
FP8 = torch.float8_e4m3fn
BATCHES = (256, 128, 64, 16, 1)


def parse_tiles(spec: str) -> DecodeTiles:
    """DecodeTiles from "N,WARPS,STAGES[,MIN_SPLIT[,MAX_REGISTERS[,SPLIT_MAX_REGISTERS]]]"."""
    return DecodeTiles(*map(int, spec.split(",")))


def add_decode_tiles_argument(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--decode-tiles", metavar="N,WARPS,STAGES[,MIN_SPLIT[,MAX_REGISTERS[,SPLIT_MAX_REGISTERS]]]",
                    help="decode attention's tiles for this cache dtype, as bench/fp8_attention_sweep.py prints them")


def use_decode_tiles(spec: str, kv_cache_dtype: str) -> None:
    """Makes decode over a cache of kv_cache_dtype (auto: 16-bit, or fp8) use the tiles of spec (parse_tiles)."""
    tiles = parse_tiles(spec)
    setattr(triton_attention, "FP8_DECODE_TILES" if kv_cache_dtype == "fp8" else "DECODE_TILES", tiles)
    print(f"decode tiles for the {kv_cache_dtype} cache: {tiles}", flush=True)


def tile_grid(quick: bool) -> list[DecodeTiles]:
    grid = [DecodeTiles(n, w, s) for n, w, s in itertools.product((64, 128, 256), (4, 8), (2, 3))]
    grid += [DecodeTiles(n, 4, s, max_registers=r)
             for n, s, r in itertools.product((32, 64, 128), (2, 3), (96, 128, 168))]
    grid += [DecodeTiles(64, 4, 3, 512, max_registers=128), DecodeTiles(64, 4, 3, 128, max_registers=128)]
    if quick:
        grid = [DecodeTiles(64, 4, 2), DecodeTiles(128, 4, 2), DecodeTiles(64, 4, 3, max_registers=128)]
    return list(dict.fromkeys([FP8_DECODE_TILES, *grid]))


def decode_step(lengths: list[int], dtype: torch.dtype):
    """The fused projection's rows, a cache holding each sequence's context in scattered blocks (FP8: quantized
    with per-head scales), and the step's metadata (each new token's slot at the end of its context)."""
    batch, per_seq = len(lengths), [-(-n // BLOCK_SIZE) for n in lengths]
    k_cache, v_cache = (torch.randn(sum(per_seq), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda") for _ in range(2))
    scales = (None, None)
    if dtype == FP8:
        scales = tuple(torch.full((NUM_KV_HEADS,), 2.0 ** -5, device="cuda") for _ in range(2))
        k_cache, v_cache = (reference.quantize_kv(c.flatten(0, 1), s).view(c.shape) for c, s in zip((k_cache, v_cache),
                                                                                                    scales))
    else:
        k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
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
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    freqs = torch.outer(torch.arange(MAX_MODEL_LEN, dtype=torch.float32), inv_freq)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).cuda()
    norms = tuple(torch.rand(HEAD_DIM, device="cuda", dtype=torch.bfloat16) + 0.5 for _ in range(2))
    return cos_sin, norms


def expected_output(qkv, cos_sin, norms, k_cache, v_cache, meta, scales):
    """The reference prologue (storing into copies of the caches), then the reference attention."""
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q, _, _ = reference.qkv_prologue(qkv, meta.seq_lens.long() - 1, cos_sin, NUM_Q_HEADS, NUM_KV_HEADS, *norms, 1e-6,
                                     k_ref, v_ref, meta.slot_mapping, False, *scales)
    return reference.paged_attention(q, k_ref, v_ref, meta, HEAD_DIM**-0.5, 0, None, *scales).float()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="three FP8 tile configurations only")
    ap.add_argument("--tiles", nargs="+", metavar="N,WARPS,STAGES[,MIN_SPLIT[,MAX_REGISTERS[,SPLIT_MAX_REGISTERS]]]",
                    help="the FP8 tile configurations to try instead of the grid")
    args = ap.parse_args()
    random.seed(0)
    torch.manual_seed(0)
    cos_sin, norms = rotary_and_norms()
    configs = [("bf16", torch.bfloat16, DECODE_TILES)] + [("fp8", FP8, tiles) for tiles in (
        [parse_tiles(spec) for spec in args.tiles] if args.tiles else tile_grid(args.quick))]
    totals = {index: 0.0 for index in range(len(configs))}
    print(f"{'batch':>5} {'cache':5} {'block_n':>7} {'warps':>5} {'stages':>6} {'min split':>9} {'splits':>6} "
          f"{'regs':>4} {'us':>8} {'TB/s':>6} {'x bf16':>6} {'max err':>8}")
    for batch in BATCHES:
        lengths = [random.randint(100, 2100) for _ in range(batch)] if batch > 1 else [1024]
        bf16_us = None
        steps = {dtype: decode_step(lengths, dtype) for dtype in (torch.bfloat16, FP8)}
        expected = {dtype: expected_output(step[0], cos_sin, norms, *step[1:]) for dtype, step in steps.items()}
        for index, (name, dtype, tiles) in enumerate(configs):
            qkv, k_cache, v_cache, meta, scales = steps[dtype]

            def fused(k, v, tiles=tiles, qkv=qkv, meta=meta, scales=scales):
                return qkv_decode_attention(qkv, cos_sin, NUM_Q_HEADS, NUM_KV_HEADS, *norms, 1e-6, k, v, meta,
                                            HEAD_DIM**-0.5, k_scale=scales[0], v_scale=scales[1], tiles=tiles)

            try:
                error = (fused(k_cache.clone(), v_cache.clone()).float() - expected[dtype]).abs().max().item()
                ms = triton.testing.do_bench(functools.partial(fused, k_cache, v_cache), warmup=20, rep=100,
                                             return_mode="median")
            except Exception as exc:  # noqa: BLE001 - a tile that does not fit (shared memory) must not end the sweep
                print(f"{batch:5d} {name:5} {tiles}: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
                totals[index] = float("inf")
                continue
            us = ms * 1e3
            bf16_us = bf16_us or us
            totals[index] += us
            kv_bytes = 2 * sum(lengths) * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()
            splits = choose_num_splits(batch * NUM_KV_HEADS, max(lengths), qkv.device, tiles.min_split_keys)
            print(f"{batch:5d} {name:5} {tiles.block_n:7d} {tiles.num_warps:5d} {tiles.num_stages:6d} "
                  f"{tiles.min_split_keys:9d} {splits:6d} {tiles.registers(splits > 1):4d} {us:8.1f} "
                  f"{kv_bytes / ms / 1e9:6.2f} {bf16_us / us:6.2f} {error:8.1e}",
                  flush=True)
    print(f"\nsummed over batches {', '.join(map(str, BATCHES))} (us):")
    for index, (name, _, tiles) in sorted(enumerate(configs), key=lambda item: totals[item[0]]):
        print(f"  {name:5} {tiles}: {totals[index]:8.1f}")
    best = min((index for index, config in enumerate(configs) if config[0] == "fp8"), key=totals.get)
    print(f"\nbest FP8 tiles: FP8_DECODE_TILES = {configs[best][2]}")
    time_prefill(cos_sin, norms)


def time_prefill(cos_sin, norms):
    """One mixed step's prologue and attention: 16 chunks of 512 new tokens after 0-512 cached ones."""
    q_lens = [512] * 16
    seq_lens = [512 + random.randint(0, 512) for _ in q_lens]
    print(f"\n{'prefill step':14} {'cache':5} {'us':>8}")
    for name, dtype in (("bf16", torch.bfloat16), ("fp8", FP8)):
        _, k_cache, v_cache, meta, scales = decode_step(seq_lens, dtype)
        cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device="cuda")
        meta = AttentionMetadata(slot_mapping=torch.arange(sum(q_lens), device="cuda"), cu_seqlens_q=cu,
                                 seq_lens=meta.seq_lens, block_tables=meta.block_tables, max_seqlen_q=512,
                                 max_seqlen_k=max(seq_lens), is_decode=False)
        qkv = torch.randn(sum(q_lens), (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        positions = torch.cat([torch.arange(s - n, s) for s, n in zip(seq_lens, q_lens)]).cuda()
        q, _, _ = qkv_prologue(qkv, positions, cos_sin, NUM_Q_HEADS, NUM_KV_HEADS, *norms, 1e-6, k_cache, v_cache,
                               meta.slot_mapping, False, *scales)
        prologue = functools.partial(qkv_prologue, qkv, positions, cos_sin, NUM_Q_HEADS, NUM_KV_HEADS, *norms, 1e-6,
                                     k_cache, v_cache, meta.slot_mapping, False, *scales)
        attention = functools.partial(prefill_attention, q, k_cache, v_cache, meta, HEAD_DIM**-0.5, 0, None, *scales)
        for part, fn in (("prologue", prologue), ("attention", attention)):
            ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
            print(f"{part:14} {name:5} {ms * 1e3:8.1f}", flush=True)


if __name__ == "__main__":
    main()
