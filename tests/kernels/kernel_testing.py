"""Shared helpers for the kernel tests: device, dtypes, tolerances, and paged-cache batch builders."""
import pytest
import torch

from kernels.attention_metadata import AttentionMetadata

ON_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])  # numpy has no bfloat16
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
GARBAGE = 1e3  # fills cache slots no sequence owns: a kernel reading one is visibly wrong


def cuda_only(*cases):
    """Larger cases that only run where the kernels are compiled, not interpreted."""
    return [pytest.param(*c, marks=pytest.mark.skipif(not ON_CUDA, reason="large shape: CUDA only")) for c in cases]


def assert_close(actual, expected, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


def cos_sin_cache(max_pos, head_dim):
    """A rotary cos|sin table [max_pos, head_dim] in float32, as models/llama.py builds it (theta 10,000)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DEVICE)


def paged_batch(q_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, spare_blocks=3):
    """Random queries and a paged cache holding each sequence's context in randomly scattered blocks.

    Returns q, k_cache, v_cache, meta. Unowned slots hold GARBAGE; block tables are padded with -1.
    """
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks, device=DEVICE)
    width = max(blocks_per_seq, default=0) + 2
    block_tables = torch.full((len(seq_lens), width), -1, dtype=torch.int32, device=DEVICE)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, GARBAGE, dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, GARBAGE, dtype=dtype, device=DEVICE)
    used = 0
    for b, (n, length) in enumerate(zip(blocks_per_seq, seq_lens)):
        pages = order[used:used + n]
        used += n
        block_tables[b, :n] = pages.to(torch.int32)
        positions = torch.arange(length, device=DEVICE)
        slots = pages[positions // block_size] * block_size + positions % block_size
        for cache in (k_cache, v_cache):
            values = torch.randn(length, num_kv_heads, head_dim, device=DEVICE)
            cache.view(-1, num_kv_heads, head_dim)[slots] = values.to(dtype)
    cu_seqlens_q = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, device=DEVICE).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.full((sum(q_lens),), -1, dtype=torch.int64, device=DEVICE),
        cu_seqlens_q=cu_seqlens_q.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables,
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(seq_lens),
        is_decode=all(n == 1 for n in q_lens),
    )
    return q, k_cache, v_cache, meta


def free_blocks_before_window(k_cache, v_cache, meta, window):
    """Points every block-table entry that no query of the step can see through its window (the block's last
    key at or before the sequence's first query position - window) at a block full of NaN, as if the engine
    had freed it and another request reused it: a kernel that reads one is visibly wrong. Returns how many."""
    block_size = k_cache.shape[1]
    owned = set(meta.block_tables[meta.block_tables >= 0].tolist())
    poisoned = next(b for b in range(k_cache.shape[0]) if b not in owned)
    k_cache[poisoned], v_cache[poisoned] = float("nan"), float("nan")
    first_query = (meta.seq_lens - meta.cu_seqlens_q.diff()).tolist()
    freed = 0
    for row, first in enumerate(first_query):
        dead = max(first - window + 1, 0) // block_size
        meta.block_tables[row, :dead] = poisoned
        freed += dead
    return freed
