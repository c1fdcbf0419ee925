"""Triton attention over the paged KV cache (decode and prefill/mixed) and over contiguous varlen batches.

One inner loop (`_attend`) does the flash-attention work for a tile of query rows against a range of keys
with an online softmax in float32 (base-2 exponentials, the scale folded in). Query rows pack a GQA group:
row r of a tile is query token r // GROUP, head r % GROUP of the group, so each key/value tile is loaded
once per KV head and multiplied against every query head that shares it.

- decode (`meta.is_decode`): one program per (sequence, KV head, split); the group's queries are padded to
  16 rows for tl.dot. Contexts are cut into splits (flash-decoding), more when batch * kv_heads cannot fill
  the GPU; the split that finishes last merges the partial outputs by their log-sum-exp, in the same kernel
  (a merge kernel of its own would add a launch per layer). A split is a chunk of
  the batch's longest context, found on the device from seq_lens, so the result never depends on
  meta.max_seqlen_k being exact (a CUDA graph captured at one length replays correctly at another).
  meta.seq_order, when given, is the order the sequences' programs start in (the engine stages longest
  context first, so short programs fill the end of the step). An unsplit batch that fills the GPU over an FP8
  cache goes to the Gluon kernel instead (kernels/gluon_decode.py, _gluon_takes), its prologue to a launch of
  its own (decodes_apart).
- prefill/mixed: one program per (query tile, KV head), the tiles numbered across the batch; each program
  finds its sequence from cu_seqlens, so the grid depends only on the token and sequence counts (a step
  padded to a captured shape replays correctly; padding tokens that no sequence owns are left unwritten).
  Keys come through the block table, the causal mask is applied only on the tiles that straddle the
  diagonal, and tiles past it are never read. With image spans (SPANS: Gemma 3's image rows see their whole
  image), a row's causal bound moves to the end of its image, and a tile reads keys up to its rows' furthest.
- varlen_attention: the same program reading keys and values from contiguous [T, n_kv, D] tensors.

A sliding window (`window` > 0, WINDOW) moves where the keys start: a decode program reads only the last
`window` keys of its sequence (its splits share them, so decode reads fewer bytes rather than masking more),
and a prefill tile starts at its first row's window, masking the window's edge on the tiles that straddle it,
as the diagonal. No key before a query's window is read, so the engine may free those blocks. Sinks (one
logit per query head, HAS_SINKS) join each softmax's denominator once: at the end of a program whose keys are
all of the query's, or in the merge of a decode's splits.

An FP8 cache (torch.float8_e4m3fn, FP8) holds keys and values divided by their KV head's scale: a program folds
its head's k_scale into the softmax scale and multiplies its output by v_scale, and converts each tile to float16
in registers for tl.dot (with float32 queries, to float32); the fused decode prologue stores the new key and
value quantized (kernels/triton_fp8.py). Decode's tiles may differ by cache dtype (DecodeTiles): an FP8
program caps its registers so that more programs share an SM.

Grids and scratch shapes come from host-side values only (no .item()), so every path can be graph-captured.
"""

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import gluon_decode
from kernels.dependent_launch import launch_options, release_next, wait_for_previous
from kernels.split_arrivals import arrival_counters, is_last_arrival, num_sms
from kernels.triton_fp8 import dot_operand, e4m3_quantized, ptx_conversion, value_operand
from kernels.triton_linear import memory_sizes

LOG2E = 1.4426950408889634
MIN_TOKENS_PER_SPLIT = 256
MIN_SPLITS = 2  # below UNSPLIT_PROGRAMS_PER_SM: see choose_num_splits
UNSPLIT_PROGRAMS_PER_SM = 4
MAX_SPLITS = 32
FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class DecodeTiles:
    """How decode programs walk their keys: block_n keys per tile, num_warps and num_stages of the launch,
    min_split_keys, the fewest keys that choose_num_splits gives a split, and max_registers per thread (0: the
    compiler's choice), which sets how many programs share an SM; split_max_registers replaces it in a launch whose
    contexts are split (0: the same)."""
    block_n: int
    num_warps: int
    num_stages: int
    min_split_keys: int = MIN_TOKENS_PER_SPLIT
    max_registers: int = 0
    split_max_registers: int = 0

    def registers(self, split: bool) -> int:
        return self.split_max_registers if split and self.split_max_registers else self.max_registers


# 64 keys of 2 bytes, 4 warps, 2 stages: the fastest at large batches of varied context lengths. A program keeps one
# tile of keys and values in flight (the block table read makes the copies indirect, so Triton's pipeliner gives
# them one buffer), so the bytes in flight per SM are the programs it holds times a tile's bytes. Converting an FP8
# tile for the MMAs takes registers, which limit the programs per SM: with values converted by PTX (value_operand)
# 64-key tiles capped at 96 registers, 5 programs per SM without spills, were the fastest end to end once large
# batches ran unsplit; the small batches whose contexts are split run faster at 104 (bench/RESULTS.md).
DECODE_TILES = DecodeTiles(block_n=64, num_warps=4, num_stages=2)
FP8_DECODE_TILES = DecodeTiles(block_n=64, num_warps=4, num_stages=2, max_registers=96, split_max_registers=104)


def decode_tiles(cache_dtype: torch.dtype, query_dtype: torch.dtype) -> DecodeTiles:
    """FP8 tiles cap the registers (FP8_DECODE_TILES says why). Float32 queries convert the keys to float32,
    operands of twice the registers, so they keep the 16-bit cache's uncapped tiles (with FP8 tiles of 128 keys,
    the H100 once computed wrong outputs: 3 splits, 8 query heads per KV head, head_dim 128)."""
    return FP8_DECODE_TILES if cache_dtype == FP8 and query_dtype != torch.float32 else DECODE_TILES


def fitted_decode_tiles(tiles: DecodeTiles, head_dim: int, element_size: int, shared_memory: int) -> DecodeTiles:
    """tiles with as many keys per tile (halved down to 16) as a program's shared memory holds: head_dim x (a
    tile of keys, one of values and 32 rows of queries); only a T4 at Gemma 3's heads of 256 needs fewer."""
    block_n = tiles.block_n
    while block_n > 16 and (32 + 2 * block_n) * head_dim * element_size > shared_memory:
        block_n //= 2
    return tiles if block_n == tiles.block_n else dataclasses.replace(tiles, block_n=block_n)


def prefill_tiles(block_m: int, min_block_m: int, head_dim: int, element_size: int, shared_memory: int
                  ) -> tuple[int, int]:
    """Query rows and keys per prefill tile: block_m and 32 keys, fewer keys and then fewer rows (not under
    min_block_m) while a program's shared memory cannot hold head_dim x (4 bytes a row, 2 x element_size a key),
    what Triton allocates them on a T4 and more than on later GPUs. Only a T4 at heads of 256 gets less."""
    block_n = 32
    while head_dim * (4 * block_m + 2 * element_size * block_n) > shared_memory:
        if block_n > 16:
            block_n //= 2
        elif block_m > min_block_m:
            block_m //= 2
        else:
            break
    return block_m, block_n


@triton.jit
def _key_rows(table_ptr, key_base, keys, key_mask, BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr):
    """Row index (in units of the key tensor's token stride) of each key position."""
    if PAGED:
        page = tl.load(table_ptr + keys // BLOCK_SIZE, mask=key_mask)
        return page.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE
    else:
        return (key_base + keys).to(tl.int64)


@triton.jit
def _attend(
    acc, m_i, l_i, q, k_ptr, v_ptr, table_ptr, key_base, stride_kt, stride_vt, lo, hi, row_pos, row_last, qk_scale,
    window, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, PTX: tl.constexpr,
):
    """Fold keys [lo, hi) into the running (acc, m_i, l_i). k_ptr/v_ptr already point at the KV head. Tiles
    start at lo (any key: the block table is read per key), so no key before lo is read.

    MASK False: every key in range is visible to every row and hi - lo is a multiple of BLOCK_N.
    MASK True: keys >= hi are masked, with CAUSAL so are keys past each row's row_last (its position, or the
    end of its image: see _prefill_kernel), and with WINDOW those at or before row_pos - window; a row may then
    see no key of a tile (its maximum stays -inf).
    Keys and values are converted to q's dtype (a no-op unless the cache is FP8: see dot_operand), values by PTX
    when PTX (see value_operand).
    """
    dims = tl.arange(0, HEAD_DIM)
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        if MASK:
            key_mask = keys < hi
            rows = _key_rows(table_ptr, key_base, keys, key_mask, BLOCK_SIZE, PAGED)
            k = tl.load(k_ptr + rows[:, None] * stride_kt + dims[None, :], mask=key_mask[:, None], other=0.0)
        else:
            rows = _key_rows(table_ptr, key_base, keys, None, BLOCK_SIZE, PAGED)
            k = tl.load(k_ptr + rows[:, None] * stride_kt + dims[None, :])
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
        if MASK:
            visible = key_mask[None, :]
            if CAUSAL:
                visible = visible & (keys[None, :] <= row_last[:, None])
            if WINDOW:
                visible = visible & (keys[None, :] > row_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = m_new
        if MASK:  # a row that has seen no key yet keeps m -inf: subtract 0 there, not -inf (-inf - -inf: NaN)
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASK:
            v = tl.load(v_ptr + rows[:, None] * stride_vt + dims[None, :], mask=key_mask[:, None], other=0.0)
        else:
            v = tl.load(v_ptr + rows[:, None] * stride_vt + dims[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), value_operand(v, q.dtype, PTX),
                                          input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _normalised(acc, m_i, l_i, sinks_ptr, heads, row_mask, HAS_SINKS: tl.constexpr):
    """acc / l_i, the rows' softmax denominators joined by their heads' sink logits when HAS_SINKS (natural
    log units, as the scores before the base-2 scale: hence log2(e)); rows that saw no key come out 0."""
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=row_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.exp2(sink - m_new)
    return acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]


@triton.jit
def _rotation(cos_sin_row, dims, HEAD_DIM: tl.constexpr):
    """(cos, sin negated on the first half), float32 [D], of NeoX rotary at the position of cos_sin_row."""
    half = dims % (HEAD_DIM // 2)
    cos = tl.load(cos_sin_row + half)
    return cos, tl.load(cos_sin_row + HEAD_DIM // 2 + half) * tl.where(dims < HEAD_DIM // 2, -1.0, 1.0)


@triton.jit
def _norm_weight(norm_ptr, dims, HAS_NORM: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A per-head RMSNorm's weight, float32 [D, 2]: at each dimension, and at its rotary partner (the other
    half's); zeros without HAS_NORM."""
    weight = tl.zeros([HEAD_DIM, 2], dtype=tl.float32)
    if HAS_NORM:
        weight = tl.load(norm_ptr + tl.join(dims, (dims + HEAD_DIM // 2) % HEAD_DIM)).to(tl.float32)
    return weight


@triton.jit
def _normed_rotated(rows_ptr, mask, dims, norm, cos, signed_sin, eps, HAS_NORM: tl.constexpr,
                    HEAD_DIM: tl.constexpr):
    """Heads [R, D] at rows_ptr [R, 1] after per-head RMSNorm (HAS_NORM, norm: _norm_weight's) and NeoX rotary
    (_rotation's cos and signed sin), rounded to the input dtype after each step as kernels/triton_prologue.py
    rounds. Each element's rotary partner (the other half's) is loaded beside it."""
    partner = (dims + HEAD_DIM // 2) % HEAD_DIM
    x = tl.load(rows_ptr + dims[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    xp = tl.load(rows_ptr + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps))[:, None]
        w, wp = norm.split()
        x = ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
        xp = ((xp * rstd).to(dtype).to(tl.float32) * wp).to(dtype).to(tl.float32)
    return (x * cos[None, :] + xp * signed_sin[None, :]).to(dtype)


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, seq_order_ptr, out_ptr, part_out_ptr,
    part_lse_ptr, arrivals_ptr, qk_scale, num_splits, window, sinks_ptr, k_scale_ptr, v_scale_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_slot,
    cos_sin_ptr, stride_cs, q_norm_ptr, k_norm_ptr, eps, slot_mapping_ptr, positions_ptr,
    GROUP: tl.constexpr, GROUP_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    LENS_BLOCK: tl.constexpr, BALANCE: tl.constexpr, SPLITS_BLOCK: tl.constexpr, ORDERED: tl.constexpr,
    PROLOGUE: tl.constexpr, HAS_NORM: tl.constexpr, NUM_Q_HEADS: tl.constexpr, WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr, FP8: tl.constexpr, PTX: tl.constexpr, HAS_POSITIONS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Programs start in grid order: a sequence's KV heads (which share each cache row) side by side, then its
    # splits, then the next sequence, longest context first when ORDERED, so the last programs are short.
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2)
    if ORDERED:
        seq = tl.load(seq_order_ptr + seq)
    num_kv_heads = tl.num_programs(0)
    num_seqs = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = tl.arange(0, GROUP_BLOCK)
    row_mask = rows < GROUP
    heads = kv_head * GROUP + rows
    out_group = out_ptr + seq.to(tl.int64) * stride_ot + kv_head * GROUP * stride_oh  # the group's output heads
    # The keys read: the last `window` of the context with a WINDOW (earlier blocks may be freed), else all.
    span = seq_len
    if WINDOW:
        span = tl.minimum(seq_len, window)
    chunk = span
    if SPLIT:
        # Every split is a chunk of the batch's longest span: a sequence takes as many as its span needs,
        # so the programs do equal work and none runs long after the others (cutting each sequence into
        # equal parts kept a long sequence's parts long, slower on varied lengths).
        # Splits that only BALANCE a full GPU are at least the mean span: equal spans are not cut.
        lens = tl.arange(0, LENS_BLOCK)
        batch_spans = tl.load(seq_lens_ptr + lens, mask=lens < num_seqs, other=0)
        if WINDOW:
            batch_spans = tl.minimum(batch_spans, window)
        chunk = tl.cdiv(tl.max(batch_spans, 0), num_splits)
        if BALANCE:
            chunk = tl.maximum(chunk, tl.cdiv(tl.sum(batch_spans, 0), num_seqs))
        chunk = tl.cdiv(chunk, BLOCK_N) * BLOCK_N
        if split > 0 and split * chunk >= span:  # past the span (split 0 writes an empty one's zeros)
            return
    lo = seq_len - span + split * chunk
    hi = tl.minimum(lo + chunk, seq_len)
    full_hi = tl.maximum(lo + (hi - lo) // BLOCK_N * BLOCK_N, lo)

    dims = tl.arange(0, HEAD_DIM)
    q_row = q_ptr + seq.to(tl.int64) * stride_qt
    if PROLOGUE:  # the rotation and the norms' weights, read before the wait as the step's inputs above are
        position = seq_len - 1
        if HAS_POSITIONS:
            position = tl.load(positions_ptr + seq).to(tl.int32)
        cos, signed_sin = _rotation(cos_sin_ptr + position.to(tl.int64) * stride_cs, dims, HEAD_DIM)
        q_norm = _norm_weight(q_norm_ptr, dims, HAS_NORM, HEAD_DIM)
        k_norm = _norm_weight(k_norm_ptr, dims, HAS_NORM, HEAD_DIM)
    # Everything read so far is a step input or a weight, no output of the kernel before (the qkv GEMM or the
    # prologue kernel): read before the wait, it leaves the step's chain (kernels/dependent_launch.py).
    wait_for_previous(USE_PDL)
    release_next(USE_PDL)
    if PROLOGUE:
        q = _rotated_query_storing_new_key(q_row, heads, row_mask, dims, k_cache_ptr, v_cache_ptr, k_scale_ptr,
                                           v_scale_ptr, cos, signed_sin, q_norm, k_norm, eps, slot_mapping_ptr, seq,
                                           seq_len, hi, kv_head, num_kv_heads, stride_slot, HAS_NORM, NUM_Q_HEADS,
                                           HEAD_DIM, FP8)
    else:
        q = tl.load(q_row + heads[:, None] * stride_qh + dims[None, :], mask=row_mask[:, None], other=0.0)
    q = dot_operand(q, FP8)
    if FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
    acc = tl.zeros([GROUP_BLOCK, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([GROUP_BLOCK], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_BLOCK], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head * HEAD_DIM
    v_head = v_cache_ptr + kv_head * HEAD_DIM
    # Every key in [lo, hi) is visible (the window is the span): only the last tile needs a mask, for hi.
    acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_head, v_head, table, 0, stride_slot, stride_slot,
                            lo, full_hi, rows, rows, qk_scale, 0, HEAD_DIM, BLOCK_N, BLOCK_SIZE, True, False, False,
                            False, DOT_PRECISION, PTX)
    acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_head, v_head, table, 0, stride_slot, stride_slot,
                            full_hi, hi, rows, rows, qk_scale, 0, HEAD_DIM, BLOCK_N, BLOCK_SIZE, True, True, False,
                            False, DOT_PRECISION, PTX)
    if FP8:
        acc = acc * tl.load(v_scale_ptr + kv_head)
    if span <= chunk:  # one split holds the whole span: the output is final
        out = _normalised(acc, m_i, l_i, sinks_ptr, heads, row_mask, HAS_SINKS)
        tl.store(out_group + rows[:, None] * stride_oh + dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None])
    else:  # partial outputs without the sinks, which join once, in the merge
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        first_row = (seq.to(tl.int64) * num_kv_heads + kv_head) * GROUP * num_splits  # group's first head, split 0
        part_rows = first_row + rows * num_splits + split
        tl.store(part_out_ptr + part_rows[:, None] * HEAD_DIM + dims[None, :], acc / l_safe[:, None],
                 mask=row_mask[:, None])
        tl.store(part_lse_ptr + part_rows, m_i + tl.log2(l_safe), mask=row_mask)
        _merge_if_last(arrivals_ptr + seq * num_kv_heads + kv_head, part_out_ptr, part_lse_ptr, out_group, first_row,
                       tl.cdiv(span, chunk), num_splits, stride_oh, sinks_ptr + kv_head * GROUP, GROUP,
                       GROUP_BLOCK, HEAD_DIM, SPLITS_BLOCK, HAS_SINKS)


@triton.jit
def _rotated_query_storing_new_key(qkv_row, heads, row_mask, dims, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                                   cos, signed_sin, q_norm, k_norm, eps, slot_mapping_ptr, seq, seq_len, hi, kv_head,
                                   num_kv_heads, stride_slot, HAS_NORM: tl.constexpr, NUM_Q_HEADS: tl.constexpr,
                                   HEAD_DIM: tl.constexpr, FP8: tl.constexpr):
    """The prologue inside a decode program, reading the fused qkv row of its sequence (rotated by cos and
    signed_sin: at seq_len - 1, or an M-RoPE model's shifted position): returns the group's queries normed and
    rotated; the program whose keys end at seq_len also norms and rotates the new key, stores it and the new value
    in the cache slot (quantized with its head's scales into an FP8 cache), and waits for the stores before its
    reads of the cache (a block barrier makes them visible to the whole program)."""
    q = _normed_rotated(qkv_row + heads[:, None] * HEAD_DIM, row_mask[:, None], dims, q_norm, cos, signed_sin,
                        eps, HAS_NORM, HEAD_DIM)
    if hi == seq_len:
        key_row = qkv_row + (NUM_Q_HEADS + kv_head) * HEAD_DIM + tl.zeros([1, 1], dtype=tl.int32)
        k = _normed_rotated(key_row, dims[None, :] < HEAD_DIM, dims, k_norm, cos, signed_sin, eps, HAS_NORM,
                            HEAD_DIM)
        v = tl.load(qkv_row + (NUM_Q_HEADS + num_kv_heads + kv_head) * HEAD_DIM + dims[None, :])
        if FP8:
            k = e4m3_quantized(k, tl.load(k_scale_ptr + kv_head))
            v = e4m3_quantized(v, tl.load(v_scale_ptr + kv_head))
        slot = tl.load(slot_mapping_ptr + seq).to(tl.int64)
        if slot >= 0:
            tl.store(k_cache_ptr + slot * stride_slot + kv_head * HEAD_DIM + dims[None, :], k)
            tl.store(v_cache_ptr + slot * stride_slot + kv_head * HEAD_DIM + dims[None, :], v)
        tl.debug_barrier()
    return q


@triton.jit
def _merge_if_last(arrivals_ptr, part_out_ptr, part_lse_ptr, out_ptr, first_row, num_used, num_splits, stride_oh,
                   sinks_ptr, GROUP: tl.constexpr, GROUP_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
                   SPLITS_BLOCK: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Counts this split's arrival; the last of the num_used splits of its (sequence, KV head) merges all
    their partial outputs by log-sum-exp (the result does not depend on which split came last), the heads'
    sinks (from sinks_ptr, the group's first) joining the denominator, and sets the counter back to zero for
    the next launch. first_row: the group's first head's partial row of split 0.
    The merge walks the splits with every head of the group at once and stores once at the end: a walk over
    the heads, storing each head's output before loading the next one's partials, waited for each load in turn."""
    if is_last_arrival(arrivals_ptr, num_used):
        heads = tl.arange(0, GROUP_BLOCK)
        in_group = heads < GROUP
        dims = tl.arange(0, HEAD_DIM)
        peak = tl.full([GROUP_BLOCK], float("-inf"), dtype=tl.float32)
        total = tl.zeros([GROUP_BLOCK], dtype=tl.float32)
        acc = tl.zeros([GROUP_BLOCK, HEAD_DIM], dtype=tl.float32)
        for split in tl.static_range(SPLITS_BLOCK):  # .cg: the other splits' partials are in L2, not in this L1
            used = in_group & (heads * 0 + split < num_used)
            rows = first_row + heads * num_splits + split
            lse = tl.load(part_lse_ptr + rows, mask=used, other=float("-inf"), cache_modifier=".cg")
            part = tl.load(part_out_ptr + rows[:, None] * HEAD_DIM + dims[None, :], mask=used[:, None], other=0.0,
                           cache_modifier=".cg")
            acc, total, peak = _fold_part(acc, total, peak, part, lse)
        if HAS_SINKS:  # a sink joins the denominator as a key whose value is zero
            sink = tl.load(sinks_ptr + heads, mask=in_group, other=0.0).to(tl.float32) * 1.4426950408889634
            acc, total, peak = _fold_part(acc, total, peak, tl.zeros([GROUP_BLOCK, HEAD_DIM], dtype=tl.float32), sink)
        total = tl.where(total == 0.0, 1.0, total)
        tl.store(out_ptr + heads[:, None] * stride_oh + dims[None, :], (acc / total[:, None]).to(
            out_ptr.dtype.element_ty), mask=in_group[:, None])


@triton.jit
def _fold_part(acc, total, peak, part, lse):
    """Adds a normalised partial output `part` with log2-sum-exp `lse` (per head; -inf: none) to the running
    (acc, total, peak): acc / total is the merge so far, both scaled by 2^-peak."""
    new_peak = tl.maximum(peak, lse)
    base = tl.where(new_peak == float("-inf"), 0.0, new_peak)
    alpha = tl.exp2(peak - base)
    weight = tl.exp2(lse - base)
    return acc * alpha[:, None] + part * weight[:, None], total * alpha + weight, new_peak


@triton.jit(do_not_specialize=["num_seqs"])  # one compiled kernel for any batch: no compiles mid-serving
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr, qk_scale, num_seqs, num_kv_heads,
    window, sinks_ptr, k_scale_ptr, v_scale_ptr, span_ends_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
    stride_vh, stride_ot, stride_oh, stride_bt, stride_span,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr, DOT_PRECISION: tl.constexpr, SEQS_BLOCK: tl.constexpr, FP8: tl.constexpr,
    PTX: tl.constexpr, SPANS: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_previous(USE_PDL)
    release_next(USE_PDL)
    TOKENS_PER_TILE: tl.constexpr = BLOCK_M // GROUP
    # KV heads fastest: the heads of one tile, which share each cache row, run side by side (faster than
    # tiles fastest on a long prefill); one grid axis, since tiles can pass the 65,535 of the others.
    kv_head = tl.program_id(0) % num_kv_heads
    tile = tl.program_id(0) // num_kv_heads
    # Tiles are numbered across the batch, sequence after sequence: find this program's sequence and tile.
    seqs = tl.arange(0, SEQS_BLOCK)
    seq_mask = seqs < num_seqs
    starts = tl.load(cu_seqlens_q_ptr + seqs, mask=seq_mask, other=0)
    ends = tl.load(cu_seqlens_q_ptr + seqs + 1, mask=seq_mask, other=0)
    tiles = (ends - starts + TOKENS_PER_TILE - 1) // TOKENS_PER_TILE
    seq = tl.sum((tl.cumsum(tiles, 0) <= tile).to(tl.int32), 0)
    if seq >= num_seqs:
        return
    first_token = (tile - tl.sum(tl.where(seqs < seq, tiles, 0), 0)) * TOKENS_PER_TILE
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if PAGED:
        seq_len = tl.load(seq_lens_ptr + seq)
    else:
        seq_len = q_len
    prefix = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tokens = first_token + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_mask = (rows < TOKENS_PER_TILE * GROUP) & (tokens < q_len)
    row_pos = prefix + tokens
    dims = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + tokens).to(tl.int64)
    # Each row's last visible key: its own position, or with SPANS the last key of its image when that comes later
    # (an image's rows see each other both ways; a row outside any image has the empty span (0, 0)). The span's
    # start is at or before the row, so causal already covers it. Clamped to the context, which a span never
    # passes (engine/images.py's fit_chunk), so that no key past it is read whatever the spans say.
    row_last = row_pos
    if SPANS:
        span_end = tl.load(span_ends_ptr + q_rows * stride_span, mask=row_mask, other=0).to(tl.int32)
        row_last = tl.minimum(tl.maximum(row_pos, span_end - 1), seq_len - 1)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=row_mask[:, None], other=0.0)
    q = dot_operand(q, FP8)
    if FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)

    # Keys [lo, full_lo): visible to some rows (the window's lower edge), [full_lo, full_hi): to every row,
    # in whole tiles, [full_hi, hi): to some rows (the causal diagonal, and the ends of the rows' images). Keys
    # before lo are never read.
    lo = 0
    full_lo = 0
    if CAUSAL:
        first_pos = prefix + first_token
        rows_end = prefix + tl.minimum(first_token + TOKENS_PER_TILE, q_len)  # past the tile's last row
        if WINDOW:
            lo = tl.maximum(first_pos - window + 1, 0)
            full_lo = tl.maximum(rows_end - window, 0)
        hi = rows_end
        seen_by_all = first_pos + 1  # keys below it: within every row's causal bound
        if SPANS:
            hi = tl.max(tl.where(row_mask, row_last + 1, 0), 0)
            seen_by_all = tl.min(tl.where(row_mask, row_last + 1, hi), 0)
        full_hi = full_lo + tl.maximum(seen_by_all - full_lo, 0) // BLOCK_N * BLOCK_N
    else:
        hi = seq_len
        full_hi = seq_len // BLOCK_N * BLOCK_N
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    if WINDOW:
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_head, v_head, table, q_start, stride_kt, stride_vt,
                                lo, full_lo, row_pos, row_last, qk_scale, window, HEAD_DIM, BLOCK_N, BLOCK_SIZE, PAGED,
                                True, CAUSAL, WINDOW, DOT_PRECISION, PTX)
    acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_head, v_head, table, q_start, stride_kt, stride_vt,
                            full_lo, full_hi, row_pos, row_last, qk_scale, window, HEAD_DIM, BLOCK_N, BLOCK_SIZE, PAGED,
                            False, CAUSAL, WINDOW, DOT_PRECISION, PTX)
    acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_head, v_head, table, q_start, stride_kt, stride_vt,
                            full_hi, hi, row_pos, row_last, qk_scale, window, HEAD_DIM, BLOCK_N, BLOCK_SIZE, PAGED,
                            True, CAUSAL, WINDOW, DOT_PRECISION, PTX)
    if FP8:
        acc = acc * tl.load(v_scale_ptr + kv_head)
    out = _normalised(acc, m_i, l_i, sinks_ptr, heads, row_mask, HAS_SINKS)
    tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def _occupancy(device: torch.device) -> int:
    """Programs that fill the GPU: two waves."""
    return 2 * num_sms(device)


def choose_num_splits(batch_kv_heads: int, max_seqlen_k: int, device: torch.device,
                      min_split_keys: int = MIN_TOKENS_PER_SPLIT) -> int:
    """Splits of the context per (sequence, KV head) for decode: enough programs for two waves on the GPU and
    at least MIN_SPLITS, at least min_split_keys keys per split, a power of two (few compiled variants), at
    most MAX_SPLITS. With UNSPLIT_PROGRAMS_PER_SM (sequence, KV head) pairs per SM or more, one split: the
    programs, started longest context first, fill the GPU to the end without the split's merge and its read
    of the batch's lengths, which cost more than they balance on the throughput workload's spread of lengths
    (bench/RESULTS.md, 2026-11-25). A context many times the batch's mean then bounds the launch by its own
    programs, which two splits only halved."""
    if batch_kv_heads >= UNSPLIT_PROGRAMS_PER_SM * num_sms(device):
        return 1
    target = _occupancy(device)
    wanted = min(max(triton.cdiv(target, batch_kv_heads), MIN_SPLITS), max_seqlen_k // min_split_keys, MAX_SPLITS)
    return 1 if wanted <= 1 else 1 << (wanted.bit_length() - 1)


def _check_head_dim(head_dim: int) -> None:
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256:
        raise ValueError(f"the Triton attention kernels need a power-of-two head_dim in [16, 256], got {head_dim}")


def _check_gqa(num_q_heads: int, num_kv_heads: int) -> int:
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    return num_q_heads // num_kv_heads


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    if (not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.shape != v_cache.shape
            or k_cache.dtype != v_cache.dtype):
        raise ValueError("k_cache and v_cache must be contiguous [num_blocks, block_size, n_kv, D] of one shape and "
                         "dtype")
    block_size = k_cache.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"the Triton attention kernels need a power-of-two block_size, got {block_size}")
    return block_size


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def decode_attention(q, k_cache, v_cache, meta, scale, num_splits=None, window=0, sinks=None, k_scale=None,
                     v_scale=None, tiles=None):
    """paged_attention for a batch of one query token per sequence; num_splits None picks it by occupancy, tiles
    None by the cache's dtype (decode_tiles)."""
    num_tokens, num_q_heads, head_dim = q.shape
    return _decode(q, num_q_heads, head_dim, q.stride(0), q.stride(1), k_cache, v_cache, meta, scale, num_splits,
                   window, sinks, (k_scale, v_scale), tiles)


def qkv_decode_attention(qkv, cos_sin_cache, num_heads, num_kv_heads, q_norm_weight, k_norm_weight, eps, k_cache,
                         v_cache, meta, scale, num_splits=None, window=0, sinks=None, k_scale=None, v_scale=None,
                         tiles=None, positions=None):
    """qkv_prologue (storing the new keys and values in the cache, quantized into an FP8 one) and
    decode_attention in one launch, from the fused projection qkv [T, (n_q + 2 n_kv) D] rotated at positions
    meta.seq_lens - 1, or at `positions` [T] (an M-RoPE model's shifted ones): one launch less per layer."""
    head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    if qkv.stride(1) != 1 or cos_sin_cache.stride(1) != 1 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"qkv_decode_attention needs qkv and a cos_sin_cache of width {head_dim} contiguous in "
                         "their last dimension")
    if k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(f"k_cache has {k_cache.shape[2]} heads of {k_cache.shape[3]}, qkv {num_kv_heads} of "
                         f"{head_dim}")
    prologue = (cos_sin_cache, q_norm_weight, k_norm_weight, eps, meta.slot_mapping, positions)
    return _decode(qkv, num_heads, head_dim, qkv.stride(0), head_dim, k_cache, v_cache, meta, scale, num_splits,
                   window, sinks, (k_scale, v_scale), tiles, prologue)


def decodes_apart(qkv, num_heads, k_cache, meta, window=0, sinks=None) -> bool:
    """Whether decode attention from the fused projection qkv runs in the Gluon kernel (kernels/gluon_decode.py),
    which leaves the prologue to its own launch (kernels.qkv_paged_attention), rather than in
    qkv_decode_attention."""
    head_dim = qkv.shape[1] // (num_heads + 2 * k_cache.shape[2])
    return _gluon_takes(qkv.dtype, num_heads, head_dim, k_cache, meta.seq_lens.shape[0], window, sinks)


def _gluon_takes(query_dtype, num_q_heads, head_dim, k_cache, num_seqs, window, sinks) -> bool:
    """The Gluon kernel takes the batches that fill the GPU with UNSPLIT_PROGRAMS_PER_SM (sequence, KV head)
    pairs per SM, which choose_num_splits never splits: smaller ones are latency-bound, and stay in the fused
    kernel, one launch less per layer."""
    return (num_seqs * k_cache.shape[2] >= UNSPLIT_PROGRAMS_PER_SM * num_sms(k_cache.device)
            and gluon_decode.supports(query_dtype, num_q_heads, head_dim, k_cache, window, sinks))


def _decode(q, num_q_heads, head_dim, stride_qt, stride_qh, k_cache, v_cache, meta, scale, num_splits, window, sinks,
            kv_scales, tiles, prologue=None):
    """The decode launch: q heads at q + token * stride_qt + head * stride_qh; with prologue (cos_sin_cache,
    q and k norm weights or None, eps, slot_mapping, positions or None), q is the fused qkv projection (see
    qkv_decode_attention).
    With a window each sequence's programs read only its last `window` keys, split among them. kv_scales:
    (k_scale, v_scale) of an FP8 cache, (None, None) for another."""
    num_seqs = meta.seq_lens.shape[0]
    num_tokens = q.shape[0]
    if num_tokens != num_seqs:
        raise ValueError(f"decode expects one query token per sequence, got {num_tokens} for {num_seqs}")
    _check_head_dim(head_dim)
    block_size = _check_cache(k_cache, v_cache)
    num_kv_heads = k_cache.shape[2]
    group = _check_gqa(num_q_heads, num_kv_heads)
    tiles = fitted_decode_tiles(tiles or decode_tiles(k_cache.dtype, q.dtype), head_dim, q.element_size(),
                                memory_sizes(q.device)[0])
    if num_splits is None:
        longest_span = min(meta.max_seqlen_k, window) if window else meta.max_seqlen_k
        num_splits = choose_num_splits(num_seqs * num_kv_heads, longest_span, q.device, tiles.min_split_keys)
    if num_splits == 1 and prologue is None and _gluon_takes(q.dtype, num_q_heads, head_dim, k_cache, num_seqs,
                                                             window, sinks):
        return gluon_decode.decode_attention(q, k_cache, v_cache, meta, scale, *kv_scales)
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    split = num_splits > 1
    part_out = part_lse = arrivals = out
    if split:
        part_out = torch.empty((num_seqs, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
        arrivals = arrival_counters(num_seqs * num_kv_heads, q.device)
    cos_sin_cache, q_norm_weight, k_norm_weight, eps, slot_mapping, positions = prologue or (out, None, None, 0.0, out,
                                                                                              None)
    block_tables = meta.block_tables
    ordered = meta.seq_order is not None
    fp8 = k_cache.dtype == FP8
    k_scale, v_scale = kv_scales if fp8 else (out, out)
    registers = tiles.registers(split)
    _decode_kernel[(num_kv_heads, num_splits, num_seqs)](
        q, k_cache, v_cache, block_tables, meta.seq_lens, meta.seq_order if ordered else meta.seq_lens, out,
        part_out, part_lse, arrivals,
        scale * LOG2E, num_splits, window, out if sinks is None else sinks, k_scale, v_scale,
        stride_qt, stride_qh, out.stride(0), out.stride(1), block_tables.stride(0), k_cache.stride(1),
        cos_sin_cache, cos_sin_cache.stride(0), out if q_norm_weight is None else q_norm_weight,
        out if k_norm_weight is None else k_norm_weight, eps, slot_mapping,
        slot_mapping if positions is None else positions,
        GROUP=group, GROUP_BLOCK=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_N=tiles.block_n, BLOCK_SIZE=block_size, SPLIT=split, DOT_PRECISION=_dot_precision(q.dtype),
        LENS_BLOCK=max(256, triton.next_power_of_2(num_seqs)),
        BALANCE=num_seqs * num_kv_heads >= _occupancy(q.device), SPLITS_BLOCK=triton.next_power_of_2(num_splits),
        ORDERED=ordered, PROLOGUE=prologue is not None, HAS_NORM=q_norm_weight is not None, NUM_Q_HEADS=num_q_heads,
        WINDOW=window > 0, HAS_SINKS=sinks is not None, FP8=fp8, PTX=fp8 and ptx_conversion(q),
        HAS_POSITIONS=positions is not None, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **launch_options(q),
        **({"maxnreg": registers} if registers else {}),
    )
    return out


def _prefill_launch(q, k, v, out, cu_seqlens_q, seq_lens, block_tables, max_seqlen_q, scale, causal, window, sinks,
                    stride_kt, stride_kh, stride_vt, stride_vh, block_size, kv_scales=(None, None), image_spans=None):
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2] if block_tables is not None else k.shape[1]
    group = _check_gqa(num_q_heads, num_kv_heads)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0 or max_seqlen_q == 0:
        return out
    # 64 x 32 tiles, 4 warps, 2 stages: faster than 128 x 64 with 8 warps on a long prefill of prompts of
    # varied lengths
    min_block_m = max(16, triton.next_power_of_2(group))
    block_m, block_n = prefill_tiles(max(min_block_m, min(64, triton.next_power_of_2(max_seqlen_q * group))),
                                     min_block_m, head_dim, q.element_size(), memory_sizes(q.device)[0])
    tokens_per_tile = block_m // group
    paged = block_tables is not None
    max_tiles = triton.cdiv(num_tokens, tokens_per_tile) + num_seqs  # each sequence ends at most one tile early
    fp8 = k.dtype == FP8
    k_scale, v_scale = kv_scales if fp8 else (out, out)
    span_ends = cu_seqlens_q if image_spans is None else image_spans[:, 1]
    # SEQS_BLOCK is at least 256, so batches of up to 256 sequences share one compiled kernel.
    _prefill_kernel[(num_kv_heads * max_tiles,)](
        q, k, v, out, cu_seqlens_q, seq_lens if paged else cu_seqlens_q,
        block_tables if paged else cu_seqlens_q, scale * LOG2E, num_seqs, num_kv_heads,
        window, out if sinks is None else sinks, k_scale, v_scale, span_ends,
        q.stride(0), q.stride(1), stride_kt, stride_kh, stride_vt, stride_vh, out.stride(0), out.stride(1),
        block_tables.stride(0) if paged else 0, span_ends.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_SIZE=block_size,
        PAGED=paged, CAUSAL=causal, WINDOW=causal and window > 0, HAS_SINKS=sinks is not None,
        DOT_PRECISION=_dot_precision(q.dtype), SEQS_BLOCK=max(256, triton.next_power_of_2(num_seqs)), FP8=fp8,
        PTX=fp8 and ptx_conversion(q), SPANS=image_spans is not None, num_warps=4, num_stages=2,
        **launch_options(q),
    )
    return out


def prefill_attention(q, k_cache, v_cache, meta, scale, window=0, sinks=None, k_scale=None, v_scale=None):
    """paged_attention for prefill chunks and mixed batches: causal over cached prefix plus own chunk, and with
    meta.image_spans, each image's keys to all of its rows (within their windows)."""
    _check_head_dim(q.shape[2])
    block_size = _check_cache(k_cache, v_cache)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    slot_stride, head_stride = k_cache.stride(1), k_cache.stride(2)
    return _prefill_launch(q, k_cache, v_cache, out, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                           meta.max_seqlen_q, scale, True, window, sinks, slot_stride, head_stride, slot_stride,
                           head_stride, block_size, (k_scale, v_scale), meta.image_spans)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float,
                    window: int = 0, sinks: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None):
    """q [T, n_q, D] against the paged cache described by meta (see AttentionMetadata) -> [T, n_q, D]; window
    and sinks [n_q] as kernels.paged_attention says (no key before a query's window is read); an FP8 cache
    with its k_scale and v_scale [n_kv].

    The keys and values of this step's tokens must already be in the cache (kernels.qkv_prologue stores them).
    """
    if meta.block_tables is None:
        raise ValueError("paged_attention needs meta.block_tables; use varlen_attention without a KV cache")
    if q.stride(2) != 1:
        raise ValueError("paged_attention needs q contiguous in head_dim")
    if meta.is_decode:
        return decode_attention(q, k_cache, v_cache, meta, scale, window=window, sinks=sinks, k_scale=k_scale,
                                v_scale=v_scale)
    return prefill_attention(q, k_cache, v_cache, meta, scale, window, sinks, k_scale, v_scale)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, scale: float, causal: bool, window: int = 0,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention within each sequence of a packed batch: q [T, n_q, D], k/v [T, n_kv, D], cu_seqlens [B+1];
    window (causal only) and sinks as in paged_attention."""
    _check_head_dim(q.shape[2])
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("varlen_attention needs q, k and v contiguous in head_dim")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return _prefill_launch(q, k, v, out, cu_seqlens, None, None, max_seqlen, scale, causal, window, sinks,
                           k.stride(0), k.stride(1), v.stride(0), v.stride(1), 1)
