"""The torch reference attention against attention written out directly from its definition."""

import math

import pytest
import torch

import kernels
from kernels import AttentionMetadata, reference

HEAD_DIM = 16
BLOCK_SIZE = 4


def direct_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: int = 0,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v for one sequence: q [Lq, n_q, D] (last query at the last key), k/v [Lk, n_kv, D].
    A window keeps the keys at q - window < p <= q (transformers' sliding_window_causal_mask_function); sinks
    [n_q] join each softmax as an extra column that is then dropped (transformers' GptOss eager attention)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / math.sqrt(q.shape[-1])
    if causal:
        q_pos = torch.arange(k.shape[0] - q.shape[0], k.shape[0])[:, None]
        k_pos = torch.arange(k.shape[0])
        hidden = (k_pos > q_pos) | ((k_pos <= q_pos - window) if window else False)
        scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        columns = torch.cat((scores, sinks.double()[:, None, None].expand(-1, scores.shape[1], 1)), dim=-1)
        weights = columns.softmax(-1)[..., :-1]
    else:
        weights = scores.softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, v.double()).float()


def run_paged(chunks: list[tuple[int, int]], num_kv_heads: int, group: int, seed: int, window: int = 0,
              with_sinks: bool = False):
    """Random K/V for each sequence's whole context stored through shuffled block tables; returns (ours, direct).
    With a window, the blocks wholly before each sequence's window point at a block full of NaN (as if freed
    and reused), so reading one shows."""
    generator = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    lengths = [cached + new for cached, new in chunks]
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in lengths]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables, start = [], 0
    for count in blocks_per_seq:
        tables.append(order[start : start + count])
        start += count
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=generator)  # garbage elsewhere
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=generator)
    ks = [torch.randn(n, num_kv_heads, HEAD_DIM, generator=generator) for n in lengths]
    vs = [torch.randn(n, num_kv_heads, HEAD_DIM, generator=generator) for n in lengths]
    qs = [torch.randn(new, num_heads, HEAD_DIM, generator=generator) for _, new in chunks]
    slots = torch.tensor(
        [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for table, n in zip(tables, lengths) for p in range(n)]
    )
    reference.store_kv_cache(torch.cat(ks), torch.cat(vs), k_cache, v_cache, slots)
    if window:
        freed = order[-1]  # a spare block: no table owns it
        k_cache[freed], v_cache[freed] = float("nan"), float("nan")
        for table, (cached, _) in zip(tables, chunks):
            for i in range(max(cached - window + 1, 0) // BLOCK_SIZE):  # no query of the step sees these
                table[i] = freed
    sinks = torch.randn(num_heads, generator=generator) if with_sinks else None
    width = max(blocks_per_seq) + 1
    q_lens = [new for _, new in chunks]
    meta = AttentionMetadata(
        slot_mapping=torch.full((sum(q_lens),), -1),
        cu_seqlens_q=torch.tensor([0, *q_lens]).cumsum(0).int(),
        seq_lens=torch.tensor(lengths, dtype=torch.int32),
        block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(lengths),
        is_decode=all(n == 1 for n in q_lens),
    )
    ours = reference.paged_attention(torch.cat(qs), k_cache, v_cache, meta, HEAD_DIM**-0.5, window, sinks)
    direct = torch.cat([direct_attention(q, k, v, True, window, sinks) for q, k, v in zip(qs, ks, vs)])
    return ours, direct


BATCHES = {
    "prefill": [(0, 9), (0, 4), (0, 1)],
    "decode-at-block-boundaries": [(3, 1), (4, 1), (7, 1), (8, 1), (0, 1), (15, 1)],
    "chunks-after-cached-prefixes": [(8, 4), (5, 3), (4, 9)],
    "mixed-prefill-and-decode": [(11, 1), (0, 6), (6, 5), (3, 1), (12, 4)],
}


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_paged_attention_equals_direct_causal_attention(batch, group):
    ours, direct = run_paged(BATCHES[batch], num_kv_heads=2, group=group, seed=group)
    torch.testing.assert_close(ours, direct, atol=1e-5, rtol=1e-5)


WINDOWED_BATCHES = {
    "decode-past-the-window": [(3, 1), (4, 1), (9, 1), (16, 1), (0, 1), (22, 1)],
    "chunks-past-the-window": [(8, 4), (13, 3), (4, 9), (0, 11)],
    "mixed": [(11, 1), (0, 6), (6, 5), (17, 1), (12, 4)],
}


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("window", [1, 3, 4, 5, 9, 40])
@pytest.mark.parametrize("batch", sorted(WINDOWED_BATCHES))
def test_paged_attention_with_window_and_sinks_equals_direct_attention(batch, window, with_sinks):
    """Windows under, at and over the block size (4) and past every context; blocks before the window unread."""
    ours, direct = run_paged(WINDOWED_BATCHES[batch], num_kv_heads=2, group=2, seed=window, window=window,
                             with_sinks=with_sinks)
    torch.testing.assert_close(ours, direct, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_paged_attention_with_sinks_alone_equals_direct_attention(batch):
    ours, direct = run_paged(BATCHES[batch], num_kv_heads=2, group=3, seed=5, with_sinks=True)
    torch.testing.assert_close(ours, direct, atol=1e-5, rtol=1e-5)


def test_a_window_changes_the_output():
    """The window is not ignored: a window of 3 over contexts of up to 23 keys differs from full attention."""
    windowed, _ = run_paged(WINDOWED_BATCHES["decode-past-the-window"], 2, 2, seed=0, window=3)
    full, _ = run_paged(WINDOWED_BATCHES["decode-past-the-window"], 2, 2, seed=0)
    assert not torch.allclose(windowed[2:4], full[2:4], atol=1e-3)


def test_paged_attention_keeps_dtype():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, HEAD_DIM, generator=generator, dtype=torch.bfloat16)
    cache = torch.randn(3, BLOCK_SIZE, 2, HEAD_DIM, generator=generator, dtype=torch.bfloat16)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([-1, -1]), cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=torch.tensor([5, 2], dtype=torch.int32),
        block_tables=torch.tensor([[2, 0], [1, -1]], dtype=torch.int32),
        max_seqlen_q=1, max_seqlen_k=5, is_decode=True,
    )
    assert reference.paged_attention(q, cache, cache, meta, 0.25).dtype == torch.bfloat16


def test_store_kv_cache_skips_negative_slots():
    k_cache, v_cache = torch.zeros(2, BLOCK_SIZE, 1, 2), torch.zeros(2, BLOCK_SIZE, 1, 2)
    k = torch.arange(1.0, 7.0).view(3, 1, 2)
    reference.store_kv_cache(k, -k, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert k_cache[1, 1, 0].tolist() == [1.0, 2.0] and k_cache[0, 0, 0].tolist() == [5.0, 6.0]
    assert v_cache[1, 1, 0].tolist() == [-1.0, -2.0]
    assert k_cache.count_nonzero() == 4


@pytest.mark.parametrize("causal,window,with_sinks", [(True, 0, False), (False, 0, False), (True, 3, False),
                                                       (True, 0, True), (False, 0, True), (True, 6, True)])
@pytest.mark.parametrize("group", [1, 2])
def test_varlen_attention_equals_direct_attention(causal, group, window, with_sinks):
    generator = torch.Generator().manual_seed(3)
    lengths = [5, 1, 8]
    q = torch.randn(sum(lengths), 2 * group, HEAD_DIM, generator=generator)
    k = torch.randn(sum(lengths), 2, HEAD_DIM, generator=generator)
    v = torch.randn(sum(lengths), 2, HEAD_DIM, generator=generator)
    sinks = torch.randn(2 * group, generator=generator) if with_sinks else None
    cu = torch.tensor([0, *lengths]).cumsum(0).int()
    ours = reference.varlen_attention(q, k, v, cu, max(lengths), HEAD_DIM**-0.5, causal, window, sinks)
    bounds = cu.tolist()
    direct = torch.cat(
        [direct_attention(q[s:e], k[s:e], v[s:e], causal, window, sinks) for s, e in zip(bounds[:-1], bounds[1:])]
    )
    torch.testing.assert_close(ours, direct, atol=1e-5, rtol=1e-5)


def test_window_and_sinks_are_checked():
    q = torch.zeros(3, 4, HEAD_DIM)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    for kwargs, message in [({"window": -1}, "window must be"), ({"window": 2, "causal": False}, "causal"),
                            ({"sinks": torch.zeros(3)}, "one logit per query head")]:
        with pytest.raises(ValueError, match=message):
            kernels.varlen_attention(q, q, q, cu, 3, 0.1, **{"causal": True, **kwargs})


def test_rotary_and_norms_follow_their_definitions():
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(3, 8, generator=generator)
    residual = torch.randn(3, 8, generator=generator)
    weight = torch.randn(8, generator=generator)
    expected = (x + residual) / torch.sqrt(((x + residual) ** 2).mean(-1, keepdim=True) + 1e-6) * weight
    normed, new_residual = reference.add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(normed, expected)
    torch.testing.assert_close(new_residual, x + residual)

    angles = torch.randn(10, 4, generator=generator)
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1)
    q = torch.randn(2, 3, 8, generator=generator)
    k = torch.randn(2, 1, 8, generator=generator)
    positions = torch.tensor([7, 2])
    rq, rk = reference.apply_rotary(q, k, positions, cache)
    # Rotate-half: dims i and i + D/2 form a 2-D vector turned by angle[position, i].
    cos, sin = angles[positions].cos()[:, None], angles[positions].sin()[:, None]
    torch.testing.assert_close(rq[..., :4], q[..., :4] * cos - q[..., 4:] * sin)
    torch.testing.assert_close(rq[..., 4:], q[..., 4:] * cos + q[..., :4] * sin)
    torch.testing.assert_close(rk[..., 4:], k[..., 4:] * cos + k[..., :4] * sin)

    gate_up = torch.randn(3, 10, generator=generator)
    torch.testing.assert_close(
        reference.silu_and_mul(gate_up), gate_up[:, :5] * torch.sigmoid(gate_up[:, :5]) * gate_up[:, 5:]
    )
