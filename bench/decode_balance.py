"""Decode attention on equal against varied context lengths: one layer's decode step of the Qwen3-0.6B shape
at batch 256, 128, 64, 16 and 1, every context equal to the mean ("uniform") or drawn from [100, 2100]
("varied", the spread of the throughput workload), with 1 or 2 splits forced or the kernel's own choice.
Prints microseconds and TB/s of KV read. Run on a CUDA machine: PYTHONPATH=. python3 bench/decode_balance.py"""
import itertools
import random

import torch
import triton.testing

from kernels import triton_attention
from kernels.attention_metadata import AttentionMetadata

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, MAX_MODEL_LEN = 16, 8, 128, 16, 4096


def decode_step(lengths: list[int]):
    """Random queries and a cache holding each sequence's context in scattered blocks."""
    batch, per_seq = len(lengths), [-(-n // BLOCK_SIZE) for n in lengths]
    k_cache, v_cache = (torch.randn(sum(per_seq), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda",
                                    dtype=torch.bfloat16) for _ in range(2))
    order = torch.randperm(sum(per_seq), device="cuda").to(torch.int32)
    tables = torch.zeros(batch, MAX_MODEL_LEN // BLOCK_SIZE, dtype=torch.int32, device="cuda")
    for row, (start, count) in enumerate(zip(itertools.accumulate(per_seq, initial=0), per_seq)):
        tables[row, :count] = order[start:start + count]
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device="cuda"),
        cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device="cuda"), block_tables=tables,
        max_seqlen_q=1, max_seqlen_k=MAX_MODEL_LEN, is_decode=True)
    return q, k_cache, v_cache, meta


def main():
    random.seed(0)
    print(f"{'batch':>5} {'lengths':8} {'splits':>6} {'us':>8} {'TB/s':>6}")
    for batch in (256, 128, 64, 16, 1):
        varied = [random.randint(100, 2100) for _ in range(batch)] if batch > 1 else [1024]
        for kind, lengths in (("uniform", [sum(varied) // batch] * batch), ("varied", varied)):
            q, k_cache, v_cache, meta = decode_step(lengths)
            for splits in (1, 2, None):
                ms = triton.testing.do_bench(
                    lambda: triton_attention.decode_attention(q, k_cache, v_cache, meta, HEAD_DIM**-0.5, splits),
                    warmup=20, rep=100, return_mode="median")
                kv_bytes = 2 * sum(lengths) * NUM_KV_HEADS * HEAD_DIM * 2
                print(f"{batch:5d} {kind:8} {splits or 'auto'!s:>6} {ms * 1e3:8.1f} {kv_bytes / ms / 1e9:6.2f}",
                      flush=True)


if __name__ == "__main__":
    main()
