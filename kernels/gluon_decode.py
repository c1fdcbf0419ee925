"""Decode attention over an FP8 (e4m3) KV cache in Gluon, Triton's lower-level language, where a kernel places each
value in a lane's registers itself. Taken for the large unsplit decode batches of a head_dim-128 cache (`supports`);
kernels/triton_attention.py runs every other case.

A program is one (sequence, KV head), with W warps: warp w reads the pages of 16 keys at w, w + W, ..., keeps its
own online softmax, and the warps merge once at the end, so the loop has no barrier and no shared memory. A page
goes from global memory straight into the MMAs' operands with 16-byte loads, and the next one is loaded into
registers while the current one is folded:
- scores transposed, S^T = K Q^T (m16n8k16: 16 keys by up to 8 query heads of the group), so the padded queries
  take 8 MMA columns, not 16 rows;
- the head dimension relabelled: the MMA's k index reads the cache dimension `_key_dim` gives, so the bytes a lane
  loads are the ones its key operand holds, and the queries are read in that order;
- O^T = V^T P^T: the values' operand is a permutation of the loaded registers (`_value_dim` relabels the output's
  rows, which are stored back in the cache's order); P^T comes from the scores' registers, each 8x8 block
  transposed across the warp by `movmatrix`;
- the running maximum and the rescaling are per output column, the layout the scores' columns already have.

The interpreter does not run Gluon: CI compiles this kernel for sm_90 and reads its loop (bench/sass_report.py
--gluon, tests/bench/test_sass_report.py); on a GPU, tests/kernels/test_gluon_decode.py compares it with the
reference. bench/gluon_decode_speed.py times it.
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from kernels import gpu_features
from kernels.dependent_launch import launch_options
from kernels.split_arrivals import num_sms

LOG2E = 1.4426950408889634
HEAD_DIM = gl.constexpr(128)
PAGE = gl.constexpr(16)  # keys a warp folds per step: one m16n8k16 of scores
MAX_GROUP = 8  # query heads per KV head: the scores' 8 MMA columns
# (sequence, KV head) pairs per multiprocessor from which 2 warps per pair beat 4 end to end: with fewer pairs each
# needs more of its keys in flight. 4-warp programs capped at 128 registers fit 4 per SM instead of 3, without
# spills (bench/RESULTS.md, 2026-11-26).
TWO_WARP_PAIRS_PER_SM = 7
FOUR_WARP_MAX_REGISTERS = 128
FP8 = torch.float8_e4m3fn


def supports(query_dtype: torch.dtype, num_q_heads: int, head_dim: int, k_cache: torch.Tensor, window: int,
             sinks) -> bool:
    """Whether this kernel can take a decode launch: compiled (not interpreted) for a GPU with e4m3 conversions and
    movmatrix where HFENDPOINT_GPU_FEATURES leaves Gluon on (kernels/gpu_features.py), an FP8 cache of head_dim
    128 in blocks of a multiple of 16 keys, 16-bit queries, at most 8 query heads per KV head, no window or
    sinks."""
    num_kv_heads = k_cache.shape[2]
    return (k_cache.dtype == FP8 and query_dtype in (torch.bfloat16, torch.float16)
            and head_dim == HEAD_DIM.value and k_cache.shape[1] % PAGE.value == 0
            and num_q_heads % num_kv_heads == 0 and num_q_heads // num_kv_heads <= MAX_GROUP
            and window == 0 and sinks is None and gpu_features.has("gluon", k_cache))


def decode_attention(q, k_cache, v_cache, meta, scale, k_scale, v_scale, warps=None, max_registers=0):
    """paged_attention for one query token per sequence, every context whole in one program (see supports);
    warps per program None picks them and their register cap by the batch, else max_registers caps a thread's
    registers (0: the compiler's choice); bench/gluon_decode_speed.py tries others."""
    num_tokens, num_q_heads, _ = q.shape
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    if warps is None:
        warps, max_registers = ((2, 0) if num_tokens * num_kv_heads >= TWO_WARP_PAIRS_PER_SM * num_sms(q.device)
                                else (4, FOUR_WARP_MAX_REGISTERS))
    ordered = meta.seq_order is not None
    _decode_kernel[(num_kv_heads, num_tokens)](
        q, k_cache.view(torch.int32), v_cache.view(torch.int32), meta.block_tables, meta.seq_lens,
        meta.seq_order if ordered else meta.seq_lens, out, scale * LOG2E, k_scale, v_scale, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), meta.block_tables.stride(0), k_cache.stride(1) // 4,
        GROUP=num_q_heads // num_kv_heads, BLOCK_SIZE=k_cache.shape[1], ORDERED=ordered, W=warps, num_warps=warps,
        **launch_options(q), **({"maxnreg": max_registers} if max_registers else {}))
    return out


@gluon.constexpr_function
def _mma(warps):
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1, 1], instr_shape=[1, 16, 8])


@gluon.constexpr_function
def _key_words(warps):
    """[warps, 16 keys, 32 words of 4 bytes]: a lane loads 32 bytes of two keys (g and g + 8)."""
    return gl.BlockedLayout([1, 1, 8], [1, 8, 4], [warps, 1, 1], [2, 1, 0])


@gluon.constexpr_function
def _value_words(warps):
    """[warps, 16 keys, 32 words]: a lane loads 16 bytes of four keys (2c, 2c + 1, 2c + 8, 2c + 9)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 8, 0]],
        lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 4], [0, 0, 8], [0, 0, 16]],
        warp_bases=[[1 << bit, 0, 0] for bit in range(warps.bit_length() - 1)], block_bases=[], shape=[warps, 16, 32])


@gluon.jit
def _wait_for_previous(USE_PDL: gl.constexpr):
    """kernels/dependent_launch.py's contract, which Gluon has no builtin for."""
    if USE_PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)


@gluon.jit
def _release_next(USE_PDL: gl.constexpr):
    if USE_PDL:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def _key_dim(k):
    """The cache dimension that index k of the scores' MMA reads: bits 1-2 of k are the lane's 32-byte quarter of
    the key, the others its registers."""
    return (k & 1) + ((k >> 3) & 1) * 2 + ((k >> 4) & 1) * 4 + ((k >> 5) & 1) * 8 + ((k >> 6) & 1) * 16 \
        + ((k >> 1) & 1) * 32 + ((k >> 2) & 1) * 64


@gluon.jit
def _value_dim(m):
    """The cache dimension of row m of O^T: bits 0-2 of m are the lane's 16-byte eighth of the value, the others
    its registers."""
    return ((m >> 3) & 1) + ((m >> 4) & 1) * 2 + ((m >> 5) & 1) * 4 + ((m >> 6) & 1) * 8 + (m & 1) * 16 \
        + ((m >> 1) & 1) * 32 + ((m >> 2) & 1) * 64


@gluon.jit
def _float16(words):
    """[..., n] int32 words of 4 e4m3 bytes -> [..., 4 n] float16 (exact), two values per conversion."""
    b0, b1, b2, b3 = gl.inline_asm_elementwise(
        "{ .reg .b32 a, b; .reg .b16 lo, hi; mov.b32 {lo, hi}, $4; cvt.rn.f16x2.e4m3x2 a, lo; "
        "cvt.rn.f16x2.e4m3x2 b, hi; mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }",
        "=h,=h,=h,=h,r", [words], dtype=(gl.float16, gl.float16, gl.float16, gl.float16), is_pure=True, pack=1)
    x = gl.join(gl.join(b0, b2), gl.join(b1, b3))  # [..., j, t] is byte 2 j + t
    return gl.reshape(x, [x.shape[0], x.shape[1], x.shape[2] * 4])


@gluon.jit
def _keys_operand(words, W: gl.constexpr):
    """[W, 16 keys, 32 words] -> K [W, 16, 128] in the scores' A layout, its k index relabelled (_key_dim)."""
    k = gl.reshape(_float16(words), [W, 16, 2, 2, 2, 2, 2, 2, 2])  # the dimension's bits, highest first
    k = gl.permute(k, [0, 1, 4, 5, 6, 7, 2, 3, 8])
    return gl.convert_layout(gl.reshape(k, [W, 16, HEAD_DIM]), gl.DotOperandLayout(0, _mma(W), 2))


@gluon.jit
def _values_operand(words, W: gl.constexpr):
    """[W, 16 keys, 32 words] -> V^T [W, 128, 16] in the output's A layout, its rows relabelled (_value_dim)."""
    v = gl.reshape(_float16(words), [W, 16, 2, 2, 2, 2, 2, 2, 2])
    v = gl.permute(v, [0, 5, 6, 7, 8, 2, 3, 4, 1])
    return gl.convert_layout(gl.reshape(v, [W, HEAD_DIM, 16]), gl.DotOperandLayout(0, _mma(W), 2))


@gluon.jit
def _probabilities_operand(p, W: gl.constexpr):
    """P^T [W, 16 keys, 8 queries] in the scores' layout -> float16 in the output MMA's B layout: each 8x8 block
    transposed across the warp (movmatrix) and relabelled, which moves nothing else."""
    t = gl.inline_asm_elementwise("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r", [p.to(gl.float16)],
                                  dtype=gl.float16, is_pure=True, pack=2)
    t = gl.permute(gl.reshape(t, [W, 2, 8, 8]), [0, 1, 3, 2])
    return gl.convert_layout(gl.reshape(t, [W, 16, 8]), gl.DotOperandLayout(1, _mma(W), 2), assert_trivial=True)


@gluon.jit
def _load_pages(k_head, v_head, table, start, hi, stride_slot, BLOCK_SIZE: gl.constexpr, W: gl.constexpr):
    """Warp w's page of keys and values from start + 16 w (masked at hi), as words in the operands' load layouts."""
    k = _load_page_words(k_head, table, start, hi, stride_slot, _key_words(W), BLOCK_SIZE, W)
    v = _load_page_words(v_head, table, start, hi, stride_slot, _value_words(W), BLOCK_SIZE, W)
    return k, v


@gluon.jit
def _load_page_words(head, table, start, hi, stride_slot, LAYOUT: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                     W: gl.constexpr):
    """[W, 16 keys, 32 words] of the cache at head in LAYOUT. A page lies in one block (BLOCK_SIZE is a multiple
    of 16), so a warp reads one block-table entry."""
    warp = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, LAYOUT)))
    key = gl.arange(0, PAGE, layout=gl.SliceLayout(0, gl.SliceLayout(2, LAYOUT)))
    word = gl.arange(0, HEAD_DIM // 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, LAYOUT)))
    first = start + warp * PAGE
    row = gl.load(table + first // BLOCK_SIZE, mask=first < hi, other=0).to(gl.int64) * BLOCK_SIZE + first % BLOCK_SIZE
    inside = (first[:, None] + key[None, :]) < hi
    return gl.load(head + ((row[:, None] + key[None, :]) * stride_slot)[:, :, None] + word[None, None, :],
                   mask=inside[:, :, None], other=0)


@gluon.jit
def _fold(acc, m_i, l_i, q, k_words, v_words, start, hi, qk_scale, W: gl.constexpr):
    """Each warp's page into its running O^T (acc), maximum per query column (m_i) and per-lane sums (l_i)."""
    MMA: gl.constexpr = _mma(W)
    s = mma_v2(_keys_operand(k_words, W), q, gl.zeros([W, PAGE, 8], gl.float32, MMA)) * qk_scale
    warp = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, MMA)))
    key = gl.arange(0, PAGE, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA)))
    s = gl.where((start + warp[:, None] * PAGE + key[None, :] < hi)[:, :, None], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)  # a warp that has seen no key yet: -inf - -inf is NaN
    alpha = gl.exp2(m_i - m_sub)
    p = gl.exp2(s - m_sub[:, None, :])
    l_i = l_i * alpha[:, None, :] + p
    acc = mma_v2(_values_operand(v_words, W), _probabilities_operand(p, W), acc * alpha[:, None, :])
    return acc, m_new, l_i


@gluon.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, seq_order_ptr, out_ptr,
                   qk_scale, k_scale_ptr, v_scale_ptr, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                   stride_slot, GROUP: gl.constexpr, BLOCK_SIZE: gl.constexpr, ORDERED: gl.constexpr,
                   W: gl.constexpr, USE_PDL: gl.constexpr):
    _wait_for_previous(USE_PDL)
    _release_next(USE_PDL)
    MMA: gl.constexpr = _mma(W)
    Q_OP: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    kv_head = gl.program_id(0)
    seq = gl.program_id(1)
    if ORDERED:  # longest context first (the engine's order), so the last programs are short
        seq = gl.load(seq_order_ptr + seq)
    hi = gl.load(seq_lens_ptr + seq)
    qk_scale = qk_scale * gl.load(k_scale_ptr + kv_head)
    # Q^T [W, 128, 8]: every warp holds the group's queries, in the keys' order of dimensions
    warp = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, Q_OP)))
    k = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, gl.SliceLayout(2, Q_OP)))
    head = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, Q_OP)))
    offsets = (kv_head * GROUP + head)[None, None, :] * stride_qh + _key_dim(k)[None, :, None] + warp[:, None, None] * 0
    q = gl.load(q_ptr + seq.to(gl.int64) * stride_qt + offsets, mask=(head < GROUP)[None, None, :], other=0.0)
    q = q.to(gl.float16)
    table = block_tables_ptr + seq.to(gl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head * (HEAD_DIM // 4)  # the cache as int32 words
    v_head = v_cache_ptr + kv_head * (HEAD_DIM // 4)
    acc = gl.zeros([W, HEAD_DIM, 8], gl.float32, MMA)
    m_i = gl.full([W, 8], float("-inf"), gl.float32, gl.SliceLayout(1, MMA))
    l_i = gl.zeros([W, PAGE, 8], gl.float32, MMA)
    k_next, v_next = _load_pages(k_head, v_head, table, 0, hi, stride_slot, BLOCK_SIZE, W)
    for start in range(0, hi, PAGE * W):
        k_words = k_next
        v_words = v_next
        k_next, v_next = _load_pages(k_head, v_head, table, start + PAGE * W, hi, stride_slot, BLOCK_SIZE, W)
        acc, m_i, l_i = _fold(acc, m_i, l_i, q, k_words, v_words, start, hi, qk_scale, W)
    # The warps merged: each column's maximum over them, each warp's part rescaled to it.
    m_all = gl.max(m_i, 0)
    rescale = gl.exp2(m_i - gl.where(m_all == float("-inf"), 0.0, m_all)[None, :])
    weight = rescale / gl.sum(gl.sum(l_i, 1) * rescale, 0)[None, :]
    o = gl.sum(acc * weight[:, None, :], 0) * gl.load(v_scale_ptr + kv_head)  # [128, 8]
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, gl.SliceLayout(0, MMA)))
    cols = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, MMA)))
    out = out_ptr + seq.to(gl.int64) * stride_ot + (kv_head * GROUP + cols)[None, :] * stride_oh \
        + _value_dim(dims)[:, None]
    gl.store(out, o.to(out_ptr.dtype.element_ty), mask=(cols < GROUP)[None, :])
