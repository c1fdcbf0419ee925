"""Triton paged (decode, prefill, mixed) and varlen attention against the torch reference."""
import pytest
import torch
from kernel_testing import (
    DEVICE,
    DTYPES,
    assert_close,
    cuda_only,
    free_blocks_before_window,
    paged_batch,
)

from kernels import AttentionMetadata, reference, triton_attention
from kernels.split_arrivals import arrival_counters
from kernels.triton_attention import (
    DECODE_TILES,
    choose_num_splits,
    decode_attention,
    fitted_decode_tiles,
    paged_attention,
    prefill_tiles,
    varlen_attention,
)

pytestmark = pytest.mark.usefixtures("poisoned_outputs")

HEADS = [(2, 2), (4, 2), (8, 1), (6, 2)]  # GQA ratios 1, 2, 8 and a non-power-of-two 3
DECODE_CONTEXTS = [1, 15, 16, 17, 64, 65, 100]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 16), (128, 128)])
def test_decode(head_dim, block_size, num_q_heads, num_kv_heads, num_splits):
    q, k_cache, v_cache, meta = paged_batch([1] * len(DECODE_CONTEXTS), DECODE_CONTEXTS, num_q_heads,
                                            num_kv_heads, head_dim, block_size, torch.float32)
    out = decode_attention(q, k_cache, v_cache, meta, head_dim**-0.5, num_splits=num_splits)
    assert_close(out, reference.paged_attention(q, k_cache, v_cache, meta, head_dim**-0.5), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "contexts,num_q_heads,num_kv_heads,head_dim,block_size",
    [([1, 33, 600], 4, 2, 64, 16)]
    + cuda_only(([8192, 1, 4095, 4096, 4097, 513], 16, 8, 128, 16), ([8000] * 3 + [17] * 61, 32, 4, 128, 256),
                ([2048] * 256, 16, 8, 128, 16), ([300, 7000], 8, 8, 64, 32)),
)
def test_paged_attention_decode_picks_splits(contexts, num_q_heads, num_kv_heads, head_dim, block_size, dtype):
    q, k_cache, v_cache, meta = paged_batch([1] * len(contexts), contexts, num_q_heads, num_kv_heads, head_dim,
                                            block_size, dtype)
    out = paged_attention(q, k_cache, v_cache, meta, 0.1)
    assert_close(out, reference.paged_attention(q, k_cache, v_cache, meta, 0.1), dtype)


def test_decode_split_does_not_trust_max_seqlen_k():
    """A CUDA graph captured with one max_seqlen_k replays at longer contexts: splits cover each length."""
    q, k_cache, v_cache, meta = paged_batch([1, 1], [90, 200], 4, 2, 64, 16, torch.float32)
    expected = reference.paged_attention(q, k_cache, v_cache, meta, 0.125)
    meta.max_seqlen_k = 1
    assert_close(decode_attention(q, k_cache, v_cache, meta, 0.125, num_splits=4), expected, torch.float32)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_in_a_given_row_order(num_splits):
    """meta.seq_order (the order programs start in, longest first) changes no row's output."""
    q, k_cache, v_cache, meta = paged_batch([1] * 5, [90, 200, 1, 17, 130], 4, 2, 64, 16, torch.float32)
    meta.seq_order = torch.tensor([1, 4, 0, 3, 2], dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, k_cache, v_cache, meta, 0.125, num_splits=num_splits)
    assert_close(out, reference.paged_attention(q, k_cache, v_cache, meta, 0.125), torch.float32)


def test_split_decode_merges_again_at_every_launch():
    """The last split of each (sequence, KV head) to finish merges the partials and sets its arrival counter
    back to zero, so later launches (a captured graph's replays) merge again; counters read zero between."""
    q, k_cache, v_cache, meta = paged_batch([1, 1, 1], [90, 200, 17], 4, 2, 64, 16, torch.float32)
    expected = reference.paged_attention(q, k_cache, v_cache, meta, 0.125)
    for _ in range(3):  # splits of 64 keys: 2, 4 and 1 (written directly) of them
        assert_close(decode_attention(q, k_cache, v_cache, meta, 0.125, num_splits=4), expected, torch.float32)
        assert not arrival_counters(1, q.device).any()


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_empty_padding_sequence_gives_zeros(num_splits):
    """Graph-padding rows (seq_len 0, block table all -1) come out as zeros, not NaN, and harm no one."""
    q, k_cache, v_cache, meta = paged_batch([1, 1, 1], [30, 1, 70], 4, 2, 64, 16, torch.float32)
    expected = reference.paged_attention(q, k_cache, v_cache, meta, 0.125)
    meta.seq_lens[1] = 0
    meta.block_tables[1] = -1
    out = decode_attention(q, k_cache, v_cache, meta, 0.125, num_splits=num_splits)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_close(out[[0, 2]], expected[[0, 2]], torch.float32)


MIXED_Q_LENS = [1, 17, 1, 5, 33]  # decode over 1 token, fresh prefill, decode, chunks after a cached prefix
MIXED_SEQ_LENS = [1, 17, 40, 37, 70]


@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 16), (64, 128)])
def test_prefill_and_mixed(head_dim, block_size, num_q_heads, num_kv_heads):
    q, k_cache, v_cache, meta = paged_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, num_q_heads, num_kv_heads, head_dim,
                                            block_size, torch.float32)
    out = paged_attention(q, k_cache, v_cache, meta, head_dim**-0.5)
    assert_close(out, reference.paged_attention(q, k_cache, v_cache, meta, head_dim**-0.5), torch.float32)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 2), (8, 1)])
def test_prefill_padded_to_a_captured_shape(num_q_heads, num_kv_heads):
    """A step padded for a prefill CUDA graph: empty rows after the real ones, tokens no row owns at the
    end, and max_seqlen_q the graph's token count. The real rows' output is unchanged."""
    q, k_cache, v_cache, meta = paged_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, num_q_heads, num_kv_heads, 64, 16,
                                            torch.float32)
    expected = reference.paged_attention(q, k_cache, v_cache, meta, 0.125)
    total, pad_rows, pad_tokens = q.shape[0], 3, 40
    cu_seqlens = torch.cat((meta.cu_seqlens_q, meta.cu_seqlens_q[-1:].repeat(pad_rows)))
    seq_lens = torch.cat((meta.seq_lens, meta.seq_lens.new_ones(pad_rows)))
    padded = AttentionMetadata(
        slot_mapping=None, cu_seqlens_q=cu_seqlens, seq_lens=seq_lens,
        block_tables=torch.cat((meta.block_tables, meta.block_tables[:1].repeat(pad_rows, 1))),
        max_seqlen_q=total + pad_tokens, max_seqlen_k=meta.max_seqlen_k, is_decode=False)
    q_padded = torch.cat((q, torch.randn(pad_tokens, *q.shape[1:], device=DEVICE)))
    out = paged_attention(q_padded, k_cache, v_cache, padded, 0.125)
    assert_close(out[:total], expected, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "q_lens,seq_lens,num_q_heads,num_kv_heads,head_dim,block_size",
    [([3, 1, 20], [3, 50, 29], 8, 1, 64, 16)]
    + cuda_only(([1024], [1024], 16, 8, 128, 16), ([1, 300, 1, 2048], [8192, 4396, 2, 2048], 16, 8, 128, 16),
                ([513, 1, 100], [1000, 777, 100], 32, 4, 64, 256),
                ([129] * 8, [4000 + i for i in range(8)], 8, 8, 128, 32)),
)
def test_prefill_dtypes_and_long_contexts(q_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype):
    q, k_cache, v_cache, meta = paged_batch(q_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype)
    out = paged_attention(q, k_cache, v_cache, meta, 0.1)
    assert_close(out, reference.paged_attention(q, k_cache, v_cache, meta, 0.1), dtype)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_varlen(head_dim, num_q_heads, num_kv_heads, causal):
    lengths = [1, 17, 40]
    _check_varlen(lengths, num_q_heads, num_kv_heads, head_dim, causal, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lengths,causal", [([5, 70], False)] + cuda_only(([1024, 1, 3000, 512], True),
                                                                          ([128] * 64, False)))
def test_varlen_dtypes_and_long(lengths, causal, dtype):
    _check_varlen(lengths, 12, 12, 64, causal, dtype)


def _check_varlen(lengths, num_q_heads, num_kv_heads, head_dim, causal, dtype):
    tokens = sum(lengths)
    q = torch.randn(tokens, num_q_heads, head_dim, device=DEVICE).to(dtype)
    kv = torch.randn(tokens, 2, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    k, v = kv[:, 0], kv[:, 1]
    cu_seqlens = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    out = varlen_attention(q, k, v, cu_seqlens, max(lengths), head_dim**-0.5, causal)
    expected = reference.varlen_attention(q, k, v, cu_seqlens, max(lengths), head_dim**-0.5, causal)
    assert_close(out, expected, dtype)


def random_sinks(num_q_heads, dtype=torch.float32):
    return (2 * torch.randn(num_q_heads, device=DEVICE)).to(dtype)


def check_paged(q_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, window, with_sinks, dtype=None,
                num_splits=None):
    """Triton paged attention (decode_attention when num_splits is given) with a window and sinks against the
    reference, the blocks before each window freed (NaN): returns how many were."""
    dtype = dtype or torch.float32
    q, k_cache, v_cache, meta = paged_batch(q_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype)
    freed = free_blocks_before_window(k_cache, v_cache, meta, window) if window else 0
    sinks = random_sinks(num_q_heads) if with_sinks else None
    scale = head_dim**-0.5
    if num_splits is None:
        out = paged_attention(q, k_cache, v_cache, meta, scale, window, sinks)
    else:
        out = decode_attention(q, k_cache, v_cache, meta, scale, num_splits=num_splits, window=window, sinks=sinks)
    assert_close(out, reference.paged_attention(q, k_cache, v_cache, meta, scale, window, sinks), dtype)
    return freed


WINDOW_CONTEXTS = [1, 15, 16, 17, 64, 65, 100, 150]


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [1, 7, 16, 20, 64, 100, 1000])
def test_decode_with_window_and_sinks(window, num_splits, with_sinks):
    """Windows under, at and over the block (16) and the key tile (64), past every context; contexts longer
    than the window read none of the blocks before it; the splits share the window's keys."""
    freed = check_paged([1] * len(WINDOW_CONTEXTS), WINDOW_CONTEXTS, 4, 2, 64, 16, window, with_sinks,
                        num_splits=num_splits)
    assert freed or window >= 150 - 16


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(8, 1), (6, 2), (2, 2)])
@pytest.mark.parametrize("head_dim,block_size", [(128, 16), (256, 16), (64, 128)])
def test_decode_window_across_head_shapes(head_dim, block_size, num_q_heads, num_kv_heads):
    check_paged([1] * len(WINDOW_CONTEXTS), WINDOW_CONTEXTS, num_q_heads, num_kv_heads, head_dim, block_size, 20,
                True, num_splits=3)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_window_padding_rows_give_zeros(num_splits):
    """Graph-padding rows (seq_len 0) stay zeros with a window and sinks."""
    q, k_cache, v_cache, meta = paged_batch([1, 1, 1], [130, 1, 70], 4, 2, 64, 16, torch.float32)
    sinks = random_sinks(4)
    expected = reference.paged_attention(q, k_cache, v_cache, meta, 0.125, 24, sinks)
    meta.seq_lens[1] = 0
    meta.block_tables[1] = -1
    out = decode_attention(q, k_cache, v_cache, meta, 0.125, num_splits=num_splits, window=24, sinks=sinks)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_close(out[[0, 2]], expected[[0, 2]], torch.float32)


T4_SHARED_MEMORY, L4_SHARED_MEMORY = (64 << 10) - 1024, (100 << 10) - 1024  # a program's, the driver's 1 KB kept


def test_tiles_shrink_only_where_shared_memory_is_short():
    assert prefill_tiles(64, 16, 256, 2, T4_SHARED_MEMORY) == (32, 16)
    assert prefill_tiles(64, 16, 256, 2, L4_SHARED_MEMORY) == (64, 32)
    assert prefill_tiles(64, 16, 128, 2, T4_SHARED_MEMORY) == (64, 32)
    assert fitted_decode_tiles(DECODE_TILES, 256, 2, T4_SHARED_MEMORY).block_n == 32
    assert fitted_decode_tiles(DECODE_TILES, 256, 2, L4_SHARED_MEMORY) is DECODE_TILES


class LaunchRecorder:
    """A kernel whose launches record their constexprs, then run it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.parametrize("kernel, num_splits", [("_prefill_kernel", None), ("_decode_kernel", 3)])
def test_heads_of_256_in_a_t4s_shared_memory(monkeypatch, kernel, num_splits):
    """Gemma 3's heads of 256 in the smaller tiles a T4's shared memory holds (launched with 16 keys a tile, in
    float32): the same attention."""
    monkeypatch.setattr(triton_attention, "memory_sizes", lambda device: (T4_SHARED_MEMORY, 4 << 20))
    recorder = LaunchRecorder(getattr(triton_attention, kernel))
    monkeypatch.setattr(triton_attention, kernel, recorder)
    q_lens = WINDOW_Q_LENS if num_splits is None else [1] * len(WINDOW_CONTEXTS)
    check_paged(q_lens, WINDOW_SEQ_LENS if num_splits is None else WINDOW_CONTEXTS, 4, 2, 256, 16, 20, False,
                num_splits=num_splits)
    assert recorder.launches and all(launch["BLOCK_N"] == 16 for launch in recorder.launches)


WINDOW_Q_LENS = [1, 40, 1, 5, 33, 70]  # a decode, a fresh prompt, a decode, chunks after cached prefixes
WINDOW_SEQ_LENS = [1, 40, 90, 37, 120, 150]


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("window", [1, 5, 16, 33, 64, 200])
def test_prefill_and_mixed_with_window_and_sinks(window, with_sinks):
    """Windows smaller than a query tile (the window's edge and the diagonal in one tile) up to past every
    context, chunks whose earlier blocks are freed."""
    check_paged(WINDOW_Q_LENS, WINDOW_SEQ_LENS, 4, 2, 64, 16, window, with_sinks)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(8, 1), (6, 2), (2, 2)])
@pytest.mark.parametrize("head_dim,block_size", [(128, 16), (256, 16), (64, 128)])
def test_prefill_window_across_head_shapes(head_dim, block_size, num_q_heads, num_kv_heads):
    check_paged(WINDOW_Q_LENS, WINDOW_SEQ_LENS, num_q_heads, num_kv_heads, head_dim, block_size, 20, True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "q_lens,seq_lens,num_q_heads,num_kv_heads,head_dim,block_size,window",
    [([3, 1, 20], [3, 50, 29], 8, 1, 64, 16, 10)]
    + cuda_only(([1, 300, 1, 2048], [8192, 4396, 2, 2048], 32, 8, 128, 16, 4096),
                ([1] * 64, [5000 + 37 * i for i in range(64)], 32, 8, 128, 16, 4096),
                ([1] * 64, [100 + 30 * i for i in range(64)], 4, 1, 256, 16, 512),
                ([2048, 1, 700], [2048, 3000, 1400], 4, 1, 256, 16, 512),
                ([129] * 8, [4000 + i for i in range(8)], 64, 8, 64, 32, 128)),
)
def test_window_and_sinks_dtypes_and_long_contexts(q_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size,
                                                   window, dtype):
    """Mistral (window 4,096 over 32/8 heads of 128), Gemma 3 (512, 4/1 of 256) and gpt-oss (128 with sinks)
    shapes on the GPU."""
    check_paged(q_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, window, True, dtype)


# Gemma 3's image tokens in a mixed step: a fresh prompt whose image crosses a query tile and ends before the
# chunk does, a chunk after a cached prefix whose image ends with it, a decode, a chunk that starts inside an image
# (its first keys cached) and holds a second one to its end, a text chunk. (offset, end): key positions.
SPAN_Q_LENS = [48, 37, 1, 20, 5]
SPAN_SEQ_LENS = [48, 90, 50, 70, 37]
SPAN_IMAGES = {0: [(20, 44)], 1: [(60, 90)], 3: [(45, 58), (62, 70)]}


def image_spans(q_lens, seq_lens, images):
    """AttentionMetadata.image_spans of a step: each query in an image gets its (offset, end), the others (0, 0),
    as engine/images.py's step_images makes them."""
    spans = torch.zeros(sum(q_lens), 2, dtype=torch.int64)
    row = 0
    for b, (n, length) in enumerate(zip(q_lens, seq_lens)):
        for offset, end in images.get(b, []):
            first, last = max(offset, length - n), min(end, length)
            spans[row + first - (length - n):row + last - (length - n)] = torch.tensor([offset, end])
        row += n
    return spans.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,with_sinks", [(0, False), (0, True), (8, False), (20, True), (200, False)])
def test_prefill_with_image_spans(window, with_sinks, dtype):
    """A query in an image sees every key of it, later ones included, within its window (windows under an image,
    between, and past every context); the others stay causal; the blocks before each window are freed."""
    q, k_cache, v_cache, meta = paged_batch(SPAN_Q_LENS, SPAN_SEQ_LENS, 4, 2, 64, 16, dtype)
    if window:
        free_blocks_before_window(k_cache, v_cache, meta, window)
    sinks = random_sinks(4) if with_sinks else None
    causal = reference.paged_attention(q, k_cache, v_cache, meta, 0.125, window, sinks)
    meta.image_spans = image_spans(SPAN_Q_LENS, SPAN_SEQ_LENS, SPAN_IMAGES)
    expected = reference.paged_attention(q, k_cache, v_cache, meta, 0.125, window, sinks)
    out = paged_attention(q, k_cache, v_cache, meta, 0.125, window, sinks)
    assert_close(out, expected, dtype)
    in_image = meta.image_spans[:, 1] > 0
    assert not torch.allclose(expected[in_image].float(), causal[in_image].float())  # the spans change the rows
    assert torch.equal(expected[~in_image], causal[~in_image])


@pytest.mark.parametrize("causal,window,with_sinks", [(True, 1, False), (True, 7, True), (True, 40, False),
                                                      (False, 0, True), (True, 0, True)])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(4, 2, 64), (8, 1, 128), (2, 1, 256)])
def test_varlen_with_window_and_sinks(num_q_heads, num_kv_heads, head_dim, causal, window, with_sinks):
    lengths = [1, 17, 70]
    tokens = sum(lengths)
    q = torch.randn(tokens, num_q_heads, head_dim, device=DEVICE)
    k, v = torch.randn(2, tokens, num_kv_heads, head_dim, device=DEVICE)
    sinks = random_sinks(num_q_heads) if with_sinks else None
    cu_seqlens = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    out = varlen_attention(q, k, v, cu_seqlens, max(lengths), head_dim**-0.5, causal, window, sinks)
    expected = reference.varlen_attention(q, k, v, cu_seqlens, max(lengths), head_dim**-0.5, causal, window, sinks)
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize(
    "batch_kv_heads,max_seqlen_k,expected",
    [(64, 4096, 1), (16, 4096, 1), (15, 4096, 2), (8, 4096, 2), (64, 300, 1), (2, 4096, 4), (1, 300, 1),
     (3, 8192, 2), (1, 100_000, 8)],
)
def test_choose_num_splits_on_four_sm_stand_in(batch_kv_heads, max_seqlen_k, expected):
    assert choose_num_splits(batch_kv_heads, max_seqlen_k, torch.device("cpu")) == expected
