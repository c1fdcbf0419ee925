"""Triton mixture-of-experts: the router's top-k choice and the routed experts' MLPs, in five launches after
the router's GEMM (three launches in all for a step that routes directly, below).

1. `select_experts`: per token, the top-k experts of the router logits and their softmax weights.
2. `_align_kernel` (one program): the token-expert pairs ("rows": row r is token r // k's slot r % k) sorted
   by expert on the device, each expert's rows padded to whole blocks of BLOCK_M. It writes the sorted rows
   (padding rows hold the row count, an index past the end) and each block's expert (NUM_EXPERTS and above:
   an unused block). Buffers are sized from the token count, k, the expert count and BLOCK_M alone, so the
   launch captures in a CUDA graph and nothing reads a count back to the host.
3. `_gate_up_kernel`: a grouped GEMM over every block of every expert. Each program takes one block's rows
   and a tile of the expert's intermediate features, computes the gate and up products side by side, adds the
   biases and applies the activation (SiLU-and-mul, or gpt-oss's clamped SwiGLU) before storing.
4. `_down_kernel`: the same grouping for the down projection; its epilogue adds the bias, scales each row by
   its top-k weight and stores the row at its token-slot position. A sum over the k slots of each token ends it.

A step of a single token (DIRECT_MAX_TOKENS; over MXFP4 experts, of up to DIRECT_MXFP4_MAX_TOKENS) routes directly
(routes_directly, routed_experts): `route` computes the router GEMM and the top-k in one launch (its last program to
finish picks the experts), no sort runs (each of a token's k rows is a block of its own, its expert read from the
top-k ids: a token's k experts are distinct, so each is read once per token), and the down GEMM's epilogue adds the
k rows' weighted products itself (the last of a column tile's k programs to finish sums their float32 parts in slot
order): router, gate/up and down, three launches.

Expert weights are stacked: w_gate_up [E, 2I, H] (gate rows 0..I-1, then up rows; models/moe.py reorders
gpt-oss's interleaved checkpoint at load), w_down [E, H, I]; biases [E, 2I] and [E, H]. Either may be MXFP4
(kernels/mxfp4.py: gpt-oss's experts as published): the GEMMs then read the packed 4-bit codes and their scales
and multiply them in registers, with tl.dot_scaled for bf16 and fp16 activations (on Hopper, which has no FP4
MMA, Triton upcasts the codes for a bf16 MMA: what MXFP4 saves there is bytes read) and, for float32 ones, one
pair of dots per 32-column scale group. A directly routed step has one row per block: it skips the MMA, whose
upcast is sized for 16 rows, and decodes the codes on the CUDA cores (_mxfp4_row_dot).
"""
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.dependent_launch import launch_options, release_next, wait_for_previous
from kernels.mxfp4 import GROUP_SIZE, Mxfp4Weight
from kernels.split_arrivals import arrival_counters, is_last_arrival
from kernels.triton_linear import decode_linear

ACTIVATIONS = ("silu", "clamped_swiglu")
# Activations tl.dot_scaled multiplies with MXFP4 weights; float32 ones take the MXFP4 GEMMs' per-group path.
SCALED_DOT_FORMATS = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class GemmTiles:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoeTiles:
    """BLOCK_M (rows of one expert per program, and the padding unit of the sort) and each GEMM's tiles."""
    block_m: int
    gate_up: GemmTiles
    down: GemmTiles


# (most tokens, tiles): the first row whose bound covers the step's token count. Decode-sized steps route a
# few rows to each expert, so their blocks are small and their column tiles narrow (more programs per
# expert weight read); prefill steps give each expert many rows and take wide tiles.
TILE_TABLE = (
    (64, MoeTiles(16, GemmTiles(32, 128, 4, 4), GemmTiles(32, 128, 4, 4))),
    (512, MoeTiles(32, GemmTiles(64, 128, 4, 3), GemmTiles(64, 128, 4, 3))),
    (math.inf, MoeTiles(64, GemmTiles(128, 64, 8, 3), GemmTiles(128, 64, 8, 3))),
)


# Steps of at most this many tokens are routed directly (route, fused_moe): the router GEMM and the top-k in one
# launch, no sort by expert (each token's k rows are the GEMMs' blocks: one token's k experts are distinct, so no
# expert is read twice), and the down GEMM sums each token's k rows itself. MXFP4 experts route directly up to
# DIRECT_MXFP4_MAX_TOKENS: though tokens that share an expert each read it, their one-row products
# (_mxfp4_row_dot) beat the sorted path's tl.dot_scaled, which upcasts every code for 16 rows. The benches'
# --direct-max-tokens set both, to time other bounds (0: the sorted path at batch 1 too).
DIRECT_MAX_TOKENS = 1
DIRECT_MXFP4_MAX_TOKENS = 8
ROUTE_BLOCK_E = 16  # route's tile: experts by a run of K
ROUTE_MIN_K, ROUTE_MAX_K = 128, 512  # a run of K: a power of 2 between these, its weight tile held in registers
ROUTE_PROGRAMS = 64  # route splits K until its programs reach about this many


# A directly routed step over MXFP4 experts multiplies its one row without an MMA (_mxfp4_row_dot): BLOCK_M 1.
DIRECT_MXFP4_TILES = MoeTiles(1, GemmTiles(16, 256, 4, 2), GemmTiles(16, 256, 4, 2))


def routes_directly(num_tokens: int, mxfp4: bool) -> bool:
    """Whether a step of num_tokens tokens skips the sort by expert (DIRECT_MAX_TOKENS, DIRECT_MXFP4_MAX_TOKENS)."""
    return 0 < num_tokens <= (DIRECT_MXFP4_MAX_TOKENS if mxfp4 else DIRECT_MAX_TOKENS)


def choose_tiles(num_tokens: int, mxfp4: bool = False) -> MoeTiles:
    if mxfp4 and routes_directly(num_tokens, True):
        return DIRECT_MXFP4_TILES
    return next(tiles for bound, tiles in TILE_TABLE if num_tokens <= bound)


def is_mxfp4(w_gate_up: torch.Tensor | Mxfp4Weight, w_down: torch.Tensor | Mxfp4Weight) -> bool:
    return isinstance(w_gate_up, Mxfp4Weight) and isinstance(w_down, Mxfp4Weight)


def max_blocks(num_rows: int, num_experts: int, block_m: int) -> int:
    """The most blocks `num_rows` rows can fill: each expert with rows wastes less than one block."""
    return num_rows // block_m + min(num_experts, num_rows)


# ---- routing -----------------------------------------------------------------------------------------

@triton.jit
def _store_top_k(logits, experts, ids_ptr, weights_ptr, token, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr):
    """Token `token`'s k largest logits (float32 [EXPERTS_POW2], -inf past the experts) in descending order: their
    experts into ids_ptr and their softmax probabilities (over the k when RENORMALIZE) into weights_ptr. Each
    expert's rank (how many logits beat it, ties to the lower expert) comes from one comparison of every pair, so
    the k slots cost a single reduction rather than k argmaxes in a row, which a decode step waits on. A NaN logit
    ranks as -inf, so the ranks stay a permutation and the ids k distinct experts (padding ranks last)."""
    logits = tl.where(logits == logits, logits, -float("inf"))
    probs = tl.exp(logits - tl.max(logits, 0))
    theirs, their_experts = logits[None, :], experts[None, :]
    beats = (theirs > logits[:, None]) | ((theirs == logits[:, None]) & (their_experts < experts[:, None]))
    rank = tl.sum(beats.to(tl.int32), 1)
    chosen = rank < TOP_K
    total = tl.sum(tl.where(chosen, probs, 0.0), 0) if RENORMALIZE else tl.sum(probs, 0)
    tl.store(ids_ptr + token * TOP_K + rank, experts, mask=chosen)
    tl.store(weights_ptr + token * TOP_K + rank, probs / total, mask=chosen)


@triton.jit
def _select_experts_kernel(logits_ptr, ids_ptr, weights_ptr, stride_l, NUM_EXPERTS: tl.constexpr,
                           EXPERTS_POW2: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                           USE_PDL: tl.constexpr):
    wait_for_previous(USE_PDL)
    release_next(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, EXPERTS_POW2)
    logits = tl.load(logits_ptr + token * stride_l + experts, mask=experts < NUM_EXPERTS,
                     other=-float("inf")).to(tl.float32)
    _store_top_k(logits, experts, ids_ptr, weights_ptr, token, TOP_K, RENORMALIZE)


def top_k_warps(num_experts: int) -> int:
    """Warps for _store_top_k's comparison of every pair of experts: about 32 pairs a thread, up to 8 warps."""
    return max(1, min(8, triton.next_power_of_2(num_experts) ** 2 // 1024))


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (ids [T, k] int32, weights [T, k] float32): the k largest logits in descending
    order and their softmax probabilities over all experts, or over the k chosen when renormalize."""
    num_tokens, num_experts = router_logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"select_experts: top_k={top_k} must be between 1 and the {num_experts} experts")
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=router_logits.device)
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=router_logits.device)
    if num_tokens:
        logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
        _select_experts_kernel[(num_tokens,)](
            logits, ids, weights, logits.stride(0), NUM_EXPERTS=num_experts,
            EXPERTS_POW2=triton.next_power_of_2(num_experts), TOP_K=top_k, RENORMALIZE=renormalize,
            num_warps=top_k_warps(num_experts), **launch_options(logits))
    return ids, weights


@triton.jit
def _route_kernel(x_ptr, w_ptr, bias_ptr, part_ptr, arrivals_ptr, ids_ptr, weights_ptr, num_tokens, stride_x, K,
                  NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr, TOP_K: tl.constexpr,
                  RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK_E: tl.constexpr, K_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr):
    """The router GEMM and the top-k of a few tokens in one launch: each program sums BLOCK_E experts' logits
    over one of SPLIT_K runs of K for every token into float32 parts; the last program to arrive adds the parts
    in split order (and the bias), rounds each logit to x's dtype as the router's linear layer stores it, and
    picks every token's experts. A program's weight tile is loaded before it waits for the kernel before it (no
    kernel writes it: kernels/dependent_launch.py), so only x's read is left to the step's chain."""
    pid = tl.program_id(0)
    split, experts = pid % SPLIT_K, (pid // SPLIT_K) * BLOCK_E + tl.arange(0, BLOCK_E)
    ks = split * K_PER_SPLIT + tl.arange(0, K_PER_SPLIT)
    expert_mask, k_mask = experts < NUM_EXPERTS, ks < K
    w = tl.load(w_ptr + experts[:, None] * K + ks[None, :], mask=expert_mask[:, None] & k_mask[None, :], other=0.0)
    wait_for_previous(USE_PDL)
    release_next(USE_PDL)
    for token in range(num_tokens):
        x = tl.load(x_ptr + token * stride_x + ks, mask=k_mask, other=0.0)
        acc = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1)
        tl.store(part_ptr + (split * num_tokens + token) * NUM_EXPERTS + experts, acc, mask=expert_mask)
    if is_last_arrival(arrivals_ptr, tl.num_programs(0)):
        all_experts = tl.arange(0, EXPERTS_POW2)
        mask = all_experts < NUM_EXPERTS
        for token in range(num_tokens):
            logits = tl.zeros([EXPERTS_POW2], dtype=tl.float32)
            for part in range(SPLIT_K):
                logits += tl.load(part_ptr + (part * num_tokens + token) * NUM_EXPERTS + all_experts, mask=mask,
                                  other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                logits += tl.load(bias_ptr + all_experts, mask=mask, other=0.0).to(tl.float32)
            logits = tl.where(mask, logits.to(x_ptr.dtype.element_ty).to(tl.float32), -float("inf"))
            _store_top_k(logits, all_experts, ids_ptr, weights_ptr, token, TOP_K, RENORMALIZE)


def route(hidden: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor | None, top_k: int,
          renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """select_experts(hidden router_weight^T + router_bias, top_k, renormalize) in one launch, for the few tokens of
    a step routed directly (DIRECT_MAX_TOKENS): the top-k runs in the GEMM's last program, once per token."""
    (num_tokens, hidden_size), num_experts = hidden.shape, router_weight.shape[0]
    if not 0 < top_k <= num_experts:
        raise ValueError(f"route: top_k={top_k} must be between 1 and the {num_experts} experts")
    if router_weight.shape[1] != hidden_size or not router_weight.is_contiguous():
        raise ValueError(f"route: the router weight must be a contiguous [experts, {hidden_size}], got "
                         f"{tuple(router_weight.shape)}")
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=hidden.device)
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=hidden.device)
    expert_tiles = triton.cdiv(num_experts, ROUTE_BLOCK_E)
    wanted_splits = max(1, ROUTE_PROGRAMS // expert_tiles)
    k_per_split = min(ROUTE_MAX_K, max(ROUTE_MIN_K, triton.next_power_of_2(triton.cdiv(hidden_size, wanted_splits))))
    split_k = triton.cdiv(hidden_size, k_per_split)
    parts = torch.empty((split_k, num_tokens, num_experts), dtype=torch.float32, device=hidden.device)
    _route_kernel[(expert_tiles * split_k,)](
        hidden, router_weight, router_bias if router_bias is not None else router_weight, parts,
        arrival_counters(1, hidden.device), ids, weights, num_tokens, hidden.stride(0), hidden_size,
        NUM_EXPERTS=num_experts, EXPERTS_POW2=triton.next_power_of_2(num_experts), TOP_K=top_k,
        RENORMALIZE=renormalize, HAS_BIAS=router_bias is not None, BLOCK_E=ROUTE_BLOCK_E, K_PER_SPLIT=k_per_split,
        SPLIT_K=split_k, num_warps=max(4, top_k_warps(num_experts)), **launch_options(hidden))
    return ids, weights


# ---- sorting rows by expert --------------------------------------------------------------------------

@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, cursor_ptr, num_rows, num_blocks,
                  NUM_EXPERTS: tl.constexpr, BINS: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCK_CHUNK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous(USE_PDL)
    release_next(USE_PDL)
    bins = tl.arange(0, BINS)
    counts = tl.zeros([BINS], dtype=tl.int32)
    for start in range(0, num_rows, CHUNK):  # rows per expert; rows past the end count in bin NUM_EXPERTS
        offsets = start + tl.arange(0, CHUNK)
        experts = tl.load(ids_ptr + offsets, mask=offsets < num_rows, other=NUM_EXPERTS)
        counts += tl.histogram(experts, BINS)
    blocks = tl.where(bins < NUM_EXPERTS, tl.cdiv(counts, BLOCK_M), 0)
    blocks_end = tl.cumsum(blocks, 0)
    tl.atomic_xchg(cursor_ptr + bins, (blocks_end - blocks) * BLOCK_M)  # each expert's first sorted slot
    for start in range(0, num_blocks, BLOCK_CHUNK):  # a block's expert: the experts whose blocks end before it
        block = start + tl.arange(0, BLOCK_CHUNK)
        owner = tl.sum((blocks_end[None, :] <= block[:, None]).to(tl.int32), 1)
        tl.store(block_expert_ptr + block, owner, mask=block < num_blocks)
    for start in range(0, num_blocks * BLOCK_M, CHUNK):
        slots = start + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + slots, tl.full([CHUNK], 0, tl.int32) + num_rows, mask=slots < num_blocks * BLOCK_M)
    tl.debug_barrier()  # the cursors and padding are in place before any row takes its slot
    for start in range(0, num_rows, CHUNK):
        offsets = start + tl.arange(0, CHUNK)
        mask = offsets < num_rows
        experts = tl.load(ids_ptr + offsets, mask=mask, other=0)
        slots = tl.atomic_add(cursor_ptr + experts, 1, mask=mask)  # rows of one expert in any order
        tl.store(sorted_ptr + slots, offsets, mask=mask)


def align_rows(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted rows [num_blocks * block_m] int32, block experts [num_blocks] int32), with
    num_blocks = max_blocks(T * k, num_experts, block_m): each expert's rows in whole blocks, the padding rows
    T * k, and unused blocks' expert >= num_experts. The order of an expert's rows within its blocks is
    arbitrary (each row's result does not depend on its neighbours)."""
    ids = topk_ids.reshape(-1)
    if ids.dtype != torch.int32:
        ids = ids.to(torch.int32)
    num_rows = ids.numel()
    num_blocks = max_blocks(num_rows, num_experts, block_m)
    bins = triton.next_power_of_2(num_experts + 1)
    sorted_rows = torch.empty(num_blocks * block_m, dtype=torch.int32, device=ids.device)
    block_experts = torch.empty(num_blocks, dtype=torch.int32, device=ids.device)
    cursors = torch.empty(bins, dtype=torch.int32, device=ids.device)
    chunk = min(max(triton.next_power_of_2(num_rows), 16), 1024)
    _align_kernel[(1,)](ids, sorted_rows, block_experts, cursors, num_rows, num_blocks, NUM_EXPERTS=num_experts,
                        BINS=bins, BLOCK_M=block_m, CHUNK=chunk, BLOCK_CHUNK=max(16, 4096 // bins),
                        num_warps=4 if chunk <= 256 else 8, **launch_options(ids))
    return sorted_rows, block_experts


# ---- grouped GEMMs --------------------------------------------------------------------------------------

@triton.jit
def _column_tile(N, BLOCK_N: tl.constexpr):
    """This program's block of sorted slots and its BLOCK_N output columns with their mask: a block's column
    tiles are neighbouring programs."""
    pid = tl.program_id(0)
    num_col_tiles = tl.cdiv(N, BLOCK_N)
    cols = (pid % num_col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    return pid // num_col_tiles, cols, cols < N


@triton.jit
def _block_rows(sorted_ptr, block, num_rows, BLOCK_M: tl.constexpr, DIRECT: tl.constexpr):
    """A block's slots, the (token, choice) rows they hold, and which hold one (padding holds num_rows). DIRECT:
    block b is row b alone, in slot b (the first of BLOCK_M rows, the others masked off)."""
    if DIRECT:
        offsets = tl.arange(0, BLOCK_M)
        slots = block + offsets * 0
        return slots, slots, offsets == 0
    slots = block * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ptr + slots)
    return slots, rows, rows < num_rows


@triton.jit
def _e2m1_values(codes, DTYPE: tl.constexpr):
    """4-bit E2M1 codes (int32: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6) as DTYPE values, exact: float32
    bits built from the code (no conversion from an integer), then narrowed."""
    magnitude = codes & 7
    exponent = tl.where(magnitude < 2, 126, (magnitude >> 1) + 126)  # 0.5 = 2^-1; 1, 1.5 = 2^0 (1 + m/2); ...
    mantissa = tl.where(magnitude < 2, 0, (magnitude & 1) << 22)
    bits = tl.where(magnitude == 0, 0, (exponent << 23) | mantissa) | ((codes & 8) << 28)
    return bits.to(tl.float32, bitcast=True).to(DTYPE)


@triton.jit
def _mxfp4_group_dot(x_rows, x_mask, blocks_ptr, scales_ptr, rows, row_mask, k, K, DOT_PRECISION: tl.constexpr):
    """The float32 activations' MXFP4 product (tl.dot_scaled takes bf16 and fp16 ones only): x [BLOCK_M, 32] (row
    pointers x_rows [BLOCK_M, 1], columns k .. k + 31) times weight rows `rows` [BLOCK_N] (int64) of an MXFP4
    weight with K columns, over that one scale group: [BLOCK_M, BLOCK_N] float32. The low
    nibbles hold the group's even columns and the high ones its odd columns, so the group is two dots over 16
    columns each, x read the same way, and its scales multiply the sum: no shuffle of the codes."""
    pairs = tl.arange(0, 16)
    in_k = (k + 2 * pairs < K)[None, :]  # the group lies wholly inside K or wholly past it
    packed = tl.load(blocks_ptr + rows[:, None] * (K // 2) + (k // 2 + pairs)[None, :],
                     mask=row_mask[:, None] & in_k, other=0).to(tl.int32)
    # a group past K reads the last group's scales (in bounds) and multiplies a zero sum by them
    exponents = tl.load(scales_ptr + rows * (K // 32) + tl.minimum(k, K - 32) // 32, mask=row_mask, other=0)
    x_even = tl.load(x_rows + k + 2 * pairs[None, :], mask=x_mask & in_k, other=0.0)
    x_odd = tl.load(x_rows + k + 1 + 2 * pairs[None, :], mask=x_mask & in_k, other=0.0)
    dtype = x_even.dtype
    sums = tl.dot(x_even, tl.trans(_e2m1_values(packed & 0xF, dtype)), input_precision=DOT_PRECISION)
    sums = tl.dot(x_odd, tl.trans(_e2m1_values(packed >> 4, dtype)), sums, input_precision=DOT_PRECISION)
    return sums * tl.exp2(exponents.to(tl.float32) - 127.0)[None, :]


@triton.jit
def _e2m1_pairs_over_2_14(words, SHIFT: tl.constexpr):
    """The two 4-bit E2M1 codes at bits SHIFT and SHIFT + 16 of int32 words as float32 values times 2^-14, exact:
    each code's magnitude bits moved into the exponent and mantissa of a float16 in its half of the word (0.5,
    whose exponent bits are 0, a subnormal one) and its sign bit into the sign, both halves in the same operations."""
    halves = (((words >> SHIFT) & 0x00070007) << 9) | (((words >> (SHIFT + 3)) & 0x00010001) << 15)
    low = halves.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    high = (halves >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return low, high


@triton.jit
def _code_pair_products(sums, words, SHIFT: tl.constexpr, x_pair):
    """sums + the products of the codes at bits SHIFT and SHIFT + 16 of each word with their columns of x_pair
    [..., 2] (the first code's, the second's)."""
    low, high = _e2m1_pairs_over_2_14(words, SHIFT)
    x_low, x_high = tl.split(x_pair)
    sums += low * x_low[None, :, :]
    return sums + high * x_high[None, :, :]


@triton.jit
def _mxfp4_row_dot(x_row, blocks_ptr, scales_ptr, rows, row_mask, k0, K, BLOCK_K: tl.constexpr):
    """One activation row (x_row: a pointer to its first column) times weight rows `rows` [BLOCK_N] (int64) of an
    MXFP4 weight with K columns, over columns k0 .. k0 + BLOCK_K - 1: [BLOCK_N] float32. No MMA: the codes are read
    as int32 words (word w: the codes of columns 8w .. 8w + 7, code n at bits 4n), decoded two at a time
    (_e2m1_pairs_over_2_14) and multiplied on the CUDA cores; each 32-column group is summed, then scaled."""
    GROUPS: tl.constexpr = BLOCK_K // 32
    groups = k0 // 32 + tl.arange(0, GROUPS)
    in_k = groups < K // 32
    words = groups[:, None] * 4 + tl.arange(0, 4)[None, :]  # [GROUPS, 4]: a group's 16 bytes
    row_words = tl.multiple_of(rows * (K // 8), 4)  # K is whole groups
    packed = tl.load(blocks_ptr.to(tl.pointer_type(tl.int32)) + row_words[:, None, None] + words[None, :, :],
                     mask=row_mask[:, None, None] & in_k[None, :, None], other=0)
    # each word's eight columns of x, read at once, split by code n = 4a + 2b + c (on c, then b): x_n [GROUPS, 4, 2]
    # holds the columns of codes n and n + 4 (a = 0, 1), which _e2m1_pairs_over_2_14 decodes together
    x = tl.load(x_row + 8 * words[:, :, None] + tl.arange(0, 8)[None, None, :], mask=in_k[:, None, None], other=0.0)
    x_c0, x_c1 = tl.split(tl.reshape(x.to(tl.float32), (GROUPS, 4, 2, 2, 2)))
    x_0, x_2 = tl.split(x_c0)
    x_1, x_3 = tl.split(x_c1)
    sums = _code_pair_products(tl.zeros(packed.shape, dtype=tl.float32), packed, 0, x_0)
    sums = _code_pair_products(sums, packed, 4, x_1)
    sums = _code_pair_products(sums, packed, 8, x_2)
    sums = _code_pair_products(sums, packed, 12, x_3)
    exponents = tl.load(scales_ptr + rows[:, None] * (K // 32) + groups[None, :],
                        mask=row_mask[:, None] & in_k[None, :], other=0)
    return tl.sum(tl.sum(sums, 2) * 16384.0 * tl.exp2(exponents.to(tl.float32) - 127.0), 1)


@triton.jit
def _mxfp4_scaled_dot(acc, x, blocks_ptr, scales_ptr, rows, row_mask, k0, K, BLOCK_K: tl.constexpr,
                      X_FORMAT: tl.constexpr):
    """acc + x [BLOCK_M, BLOCK_K] (columns k0 ..) times weight rows `rows` [BLOCK_N] (int64) of an MXFP4 weight
    with K columns, by tl.dot_scaled (X_FORMAT: x's, "bf16" or "fp16")."""
    byte_cols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    packed = tl.load(blocks_ptr + rows[:, None] * (K // 2) + byte_cols[None, :],
                     mask=row_mask[:, None] & (byte_cols < K // 2)[None, :], other=0)
    groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    exponents = tl.load(scales_ptr + rows[:, None] * (K // 32) + groups[None, :],
                        mask=row_mask[:, None] & (groups < K // 32)[None, :], other=0)
    return tl.dot_scaled(x, None, X_FORMAT, tl.trans(packed), exponents, "e2m1", acc=acc)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, scales_ptr, bias_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_rows, stride_x,
                    INTER, K, TOP_K: tl.constexpr, NUM_EXPERTS: tl.constexpr, CLAMPED_SWIGLU: tl.constexpr, ALPHA,
                    LIMIT, HAS_BIAS: tl.constexpr, MXFP4: tl.constexpr, X_FORMAT: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    DIRECT: tl.constexpr, USE_PDL: tl.constexpr):
    """out[slot, n] = act(x[token] . gate[n] + b, x[token] . up[n] + b) for a block's sorted slots. MXFP4: w_ptr
    holds the packed blocks and scales_ptr their scales (kernels/mxfp4.py). DIRECT: a block is one row, in slot
    row, and block_expert_ptr holds the top-k ids (_block_rows)."""
    block, cols, col_mask = _column_tile(INTER, BLOCK_N)
    wait_for_previous(USE_PDL)
    expert = tl.load(block_expert_ptr + block)
    if expert < NUM_EXPERTS:
        slots, rows, row_mask = _block_rows(sorted_ptr, block, num_rows, BLOCK_M, DIRECT)
        ks = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + (rows // TOP_K).to(tl.int64)[:, None] * stride_x + ks[None, :]
        gate_ptrs = w_ptr + expert.to(tl.int64) * 2 * INTER * K + cols[:, None] * K + ks[None, :]
        up_ptrs = gate_ptrs + INTER * K
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        gate_rows = expert.to(tl.int64) * 2 * INTER + cols
        x_rows = x_ptr + (rows // TOP_K).to(tl.int64)[:, None] * stride_x
        token_row = x_ptr + (block // TOP_K).to(tl.int64) * stride_x  # DIRECT: the block's one row's token
        for k0 in range(0, K, BLOCK_K):
            if MXFP4 and DIRECT:
                gate += _mxfp4_row_dot(token_row, w_ptr, scales_ptr, gate_rows, col_mask, k0, K, BLOCK_K)[None, :]
                up += _mxfp4_row_dot(token_row, w_ptr, scales_ptr, gate_rows + INTER, col_mask, k0, K, BLOCK_K)[None, :]
            elif MXFP4 and X_FORMAT != "":
                x = tl.load(x_ptrs, mask=row_mask[:, None] & (k0 + ks < K)[None, :], other=0.0)
                gate = _mxfp4_scaled_dot(gate, x, w_ptr, scales_ptr, gate_rows, col_mask, k0, K, BLOCK_K, X_FORMAT)
                up = _mxfp4_scaled_dot(up, x, w_ptr, scales_ptr, gate_rows + INTER, col_mask, k0, K, BLOCK_K,
                                       X_FORMAT)
            elif MXFP4:
                for group in tl.static_range(BLOCK_K // 32):
                    k = k0 + group * 32
                    gate += _mxfp4_group_dot(x_rows, row_mask[:, None], w_ptr, scales_ptr, gate_rows, col_mask, k,
                                             K, DOT_PRECISION)
                    up += _mxfp4_group_dot(x_rows, row_mask[:, None], w_ptr, scales_ptr, gate_rows + INTER,
                                           col_mask, k, K, DOT_PRECISION)
            elif EVEN_K:
                x = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
                w_gate = tl.load(gate_ptrs, mask=col_mask[:, None], other=0.0)
                w_up = tl.load(up_ptrs, mask=col_mask[:, None], other=0.0)
            else:
                k_mask = (k0 + ks < K)[None, :]
                x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask, other=0.0)
                w_gate = tl.load(gate_ptrs, mask=col_mask[:, None] & k_mask, other=0.0)
                w_up = tl.load(up_ptrs, mask=col_mask[:, None] & k_mask, other=0.0)
            if not MXFP4:
                gate = tl.dot(x, tl.trans(w_gate), gate, input_precision=DOT_PRECISION)
                up = tl.dot(x, tl.trans(w_up), up, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K
            gate_ptrs += BLOCK_K
            up_ptrs += BLOCK_K
        release_next(USE_PDL)
        if HAS_BIAS:
            bias = bias_ptr + expert.to(tl.int64) * 2 * INTER + cols
            gate += tl.load(bias, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            up += tl.load(bias + INTER, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if CLAMPED_SWIGLU:  # gpt-oss: gate clamped above, up on both sides, then (up + 1) * gate * sigmoid(a gate)
            gate = tl.minimum(gate, LIMIT)
            up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
            y = (up + 1.0) * gate / (1.0 + tl.exp(-ALPHA * gate))
        else:
            y = gate / (1.0 + tl.exp(-gate)) * up
        out_ptrs = out_ptr + slots.to(tl.int64)[:, None] * INTER + cols[None, :]
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _down_rows(x_ptr, w_ptr, scales_ptr, bias_ptr, expert, slots, row_mask, cols, col_mask, N, K,
               HAS_BIAS: tl.constexpr, MXFP4: tl.constexpr, X_FORMAT: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
               DIRECT: tl.constexpr):
    """x[slot] . down[n] + b for the slots' rows and BLOCK_N columns of one expert: [BLOCK_M, BLOCK_N] float32;
    MXFP4 and DIRECT as in _gate_up_kernel."""
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + slots.to(tl.int64)[:, None] * K + ks[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * N * K + cols[:, None] * K + ks[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_rows = x_ptr + slots.to(tl.int64)[:, None] * K
    for k0 in range(0, K, BLOCK_K):
        if MXFP4 and DIRECT:  # every slot is the block's one row
            acc += _mxfp4_row_dot(x_ptr + tl.min(slots, 0).to(tl.int64) * K, w_ptr, scales_ptr,
                                  expert.to(tl.int64) * N + cols, col_mask, k0, K, BLOCK_K)[None, :]
        elif MXFP4 and X_FORMAT != "":
            x = tl.load(x_ptrs, mask=row_mask[:, None] & (k0 + ks < K)[None, :], other=0.0)
            acc = _mxfp4_scaled_dot(acc, x, w_ptr, scales_ptr, expert.to(tl.int64) * N + cols, col_mask, k0, K,
                                    BLOCK_K, X_FORMAT)
        elif MXFP4:
            for group in tl.static_range(BLOCK_K // 32):
                acc += _mxfp4_group_dot(x_rows, row_mask[:, None], w_ptr, scales_ptr,
                                        expert.to(tl.int64) * N + cols, col_mask, k0 + group * 32, K,
                                        DOT_PRECISION)
        elif EVEN_K:
            x = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=col_mask[:, None], other=0.0)
        else:
            k_mask = (k0 + ks < K)[None, :]
            x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask, other=0.0)
            w = tl.load(w_ptrs, mask=col_mask[:, None] & k_mask, other=0.0)
        if not MXFP4:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert.to(tl.int64) * N + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _down_kernel(x_ptr, w_ptr, scales_ptr, bias_ptr, weights_ptr, out_ptr, part_ptr, arrivals_ptr, sorted_ptr,
                 block_expert_ptr, num_rows, N, K, NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, MXFP4: tl.constexpr, X_FORMAT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 DIRECT: tl.constexpr, USE_PDL: tl.constexpr):
    """out[row, n] = weight[row] * (x[slot] . down[n] + b) for a block's sorted slots (x: the activations).
    DIRECT (blocks as in _gate_up_kernel's): each row's weighted product goes to its float32 part [N] and the
    last of a token's k rows to arrive at a column tile adds the k parts in slot order into out[token]."""
    block, cols, col_mask = _column_tile(N, BLOCK_N)
    # The routing was written before the gate/up GEMM this kernel follows: read before the wait, it costs the step
    # no round trip (kernels/dependent_launch.py).
    expert = tl.load(block_expert_ptr + block)
    slots, rows, row_mask = _block_rows(sorted_ptr, block, num_rows, BLOCK_M, DIRECT)
    routing_weight = tl.load(weights_ptr + rows, mask=row_mask, other=0.0)
    wait_for_previous(USE_PDL)
    if expert < NUM_EXPERTS:
        acc = _down_rows(x_ptr, w_ptr, scales_ptr, bias_ptr, expert, slots, row_mask, cols, col_mask, N, K, HAS_BIAS,
                         MXFP4, X_FORMAT, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION, DIRECT)
        release_next(USE_PDL)
        acc *= routing_weight[:, None]
        if DIRECT:
            tl.store(part_ptr + block.to(tl.int64) * N + cols, tl.sum(tl.where(row_mask[:, None], acc, 0.0), 0),
                     mask=col_mask)
            token, col_tiles = block // TOP_K, tl.cdiv(N, BLOCK_N)
            if is_last_arrival(arrivals_ptr + token * col_tiles + tl.program_id(0) % col_tiles, TOP_K):
                total = tl.zeros((BLOCK_N,), dtype=tl.float32)
                for slot in range(TOP_K):
                    total += tl.load(part_ptr + (token * TOP_K + slot).to(tl.int64) * N + cols, mask=col_mask,
                                     other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + token.to(tl.int64) * N + cols, total.to(out_ptr.dtype.element_ty), mask=col_mask)
        else:
            out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def _gemm_options(tiles: GemmTiles, k: int, dtype: torch.dtype, weight: torch.Tensor | Mxfp4Weight) -> dict:
    """The GEMM's launch options, and its weight's arguments: (w_ptr, scales_ptr) and MXFP4."""
    mxfp4 = isinstance(weight, Mxfp4Weight)
    if mxfp4 and tiles.block_k % GROUP_SIZE:
        raise ValueError(f"fused_moe: BLOCK_K {tiles.block_k} must be a multiple of the MXFP4 group size "
                         f"{GROUP_SIZE}")
    return dict(w_ptr=weight.blocks if mxfp4 else weight, scales_ptr=weight.scales if mxfp4 else weight, MXFP4=mxfp4,
                X_FORMAT=SCALED_DOT_FORMATS.get(dtype, ""),
                BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, EVEN_K=k % tiles.block_k == 0,
                DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32", num_warps=tiles.num_warps,
                num_stages=tiles.num_stages)


def fused_moe(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              w_gate_up: torch.Tensor | Mxfp4Weight, w_down: torch.Tensor | Mxfp4Weight,
              b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None, activation: str = "silu",
              swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0, tiles: MoeTiles | None = None) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]) for each token t: [T, H] in hidden's dtype.
    Either weight may be MXFP4 (read packed, dequantized in registers). tiles: the kernels' tiles
    (choose_tiles by default). A step that routes_directly skips the sort: each row is its own block."""
    check_moe_arguments(hidden, topk_ids, topk_weights, w_gate_up, w_down, b_gate_up, b_down, activation)
    num_tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    if not num_tokens:
        return torch.zeros_like(hidden)
    mxfp4 = is_mxfp4(w_gate_up, w_down)
    tiles = tiles or choose_tiles(num_tokens, mxfp4)
    if routes_directly(num_tokens, mxfp4):
        sorted_rows, block_experts = None, topk_ids.reshape(-1).to(torch.int32).contiguous()
    else:
        sorted_rows, block_experts = align_rows(topk_ids, w_gate_up.shape[0], tiles.block_m)
    activations = expert_activations(hidden, sorted_rows, block_experts, w_gate_up, b_gate_up, top_k, activation,
                                     swiglu_alpha, swiglu_limit, tiles.block_m, tiles.gate_up)
    out = weighted_expert_outputs(activations, sorted_rows, block_experts, w_down, b_down, topk_weights,
                                  tiles.block_m, tiles.down)
    if sorted_rows is None or top_k == 1:
        return out
    return out.view(num_tokens, top_k, hidden_size).sum(1)


def routed_experts(hidden: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor | None, top_k: int,
                   renormalize: bool, w_gate_up: torch.Tensor | Mxfp4Weight, w_down: torch.Tensor | Mxfp4Weight,
                   b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None, activation: str = "silu",
                   swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0) -> torch.Tensor:
    """A routed MLP from the hidden states: the router and its top-k (route() for a step that routes_directly, else
    the router's linear layer and select_experts), then fused_moe."""
    if routes_directly(hidden.shape[0], is_mxfp4(w_gate_up, w_down)):
        topk_ids, topk_weights = route(hidden, router_weight, router_bias, top_k, renormalize)
    else:
        topk_ids, topk_weights = select_experts(decode_linear(hidden, router_weight, router_bias), top_k, renormalize)
    return fused_moe(hidden, topk_ids, topk_weights, w_gate_up, w_down, b_gate_up, b_down, activation, swiglu_alpha,
                     swiglu_limit)


def expert_activations(hidden: torch.Tensor, sorted_rows: torch.Tensor | None, block_experts: torch.Tensor,
                       w_gate_up: torch.Tensor | Mxfp4Weight, b_gate_up: torch.Tensor | None, top_k: int,
                       activation: str, swiglu_alpha: float, swiglu_limit: float, block_m: int,
                       tiles: GemmTiles) -> torch.Tensor:
    """The gate/up GEMM with the activation: [num_blocks * block_m, I], row s for sorted slot s (padding
    slots unwritten). Without sorted_rows (direct routing), block_experts holds the top-k ids [T * k] and the
    result is [T * k, I], row r for row r."""
    (num_tokens, hidden_size), (num_experts, two_inter, _) = hidden.shape, w_gate_up.shape
    inter, num_blocks = two_inter // 2, block_experts.numel()
    slots = num_blocks if sorted_rows is None else num_blocks * block_m
    activations = torch.empty((slots, inter), dtype=hidden.dtype, device=hidden.device)
    _gate_up_kernel[(num_blocks * triton.cdiv(inter, tiles.block_n),)](
        x_ptr=hidden, bias_ptr=b_gate_up if b_gate_up is not None else hidden, out_ptr=activations,
        sorted_ptr=block_experts if sorted_rows is None else sorted_rows, block_expert_ptr=block_experts,
        num_rows=num_tokens * top_k, stride_x=hidden.stride(0), INTER=inter, K=hidden_size, TOP_K=top_k,
        NUM_EXPERTS=num_experts, CLAMPED_SWIGLU=activation == "clamped_swiglu", ALPHA=swiglu_alpha,
        LIMIT=swiglu_limit, HAS_BIAS=b_gate_up is not None, BLOCK_M=block_m, DIRECT=sorted_rows is None,
        **_gemm_options(tiles, hidden_size, hidden.dtype, w_gate_up), **launch_options(hidden))
    return activations


def weighted_expert_outputs(activations: torch.Tensor, sorted_rows: torch.Tensor | None, block_experts: torch.Tensor,
                            w_down: torch.Tensor | Mxfp4Weight, b_down: torch.Tensor | None, topk_weights: torch.Tensor,
                            block_m: int, tiles: GemmTiles) -> torch.Tensor:
    """The down GEMM with bias and top-k weight: [T * k, H], row r for token r // k's slot r % k; without
    sorted_rows (direct routing: expert_activations'), each token's k rows already summed: [T, H]."""
    (num_experts, hidden_size, inter), (num_tokens, top_k) = w_down.shape, topk_weights.shape
    weights = topk_weights.reshape(-1)
    if weights.dtype != torch.float32:
        weights = weights.float()
    direct = sorted_rows is None
    out = torch.empty((num_tokens if direct else num_tokens * top_k, hidden_size), dtype=activations.dtype,
                      device=activations.device)
    col_tiles = triton.cdiv(hidden_size, tiles.block_n)
    parts, arrivals = out, out
    if direct:
        parts = torch.empty((num_tokens * top_k, hidden_size), dtype=torch.float32, device=activations.device)
        arrivals = arrival_counters(num_tokens * col_tiles, activations.device)
    _down_kernel[(block_experts.numel() * col_tiles,)](
        x_ptr=activations, bias_ptr=b_down if b_down is not None else activations, weights_ptr=weights,
        out_ptr=out, part_ptr=parts, arrivals_ptr=arrivals, sorted_ptr=block_experts if direct else sorted_rows,
        block_expert_ptr=block_experts, num_rows=num_tokens * top_k, N=hidden_size, K=inter,
        NUM_EXPERTS=num_experts, TOP_K=top_k, HAS_BIAS=b_down is not None, BLOCK_M=block_m, DIRECT=direct,
        **_gemm_options(tiles, inter, activations.dtype, w_down), **launch_options(activations))
    return out


def check_moe_arguments(hidden, topk_ids, topk_weights, w_gate_up, w_down, b_gate_up, b_down, activation) -> None:
    """ValueError naming the argument whose shape or kind does not fit the others."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_moe: activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")
    if hidden.dim() != 2 or len(w_gate_up.shape) != 3 or len(w_down.shape) != 3:
        raise ValueError("fused_moe: hidden must be [T, H], w_gate_up [E, 2I, H] and w_down [E, H, I]")
    num_experts, two_inter, hidden_size = w_gate_up.shape
    expected = {
        "topk_weights": (topk_weights.shape, tuple(topk_ids.shape)),
        "topk_ids": (topk_ids.shape[:1], (hidden.shape[0],)),
        "w_gate_up": (w_gate_up.shape[2:], (hidden.shape[1],)),
        "w_down": (w_down.shape, (num_experts, hidden_size, two_inter // 2)),
        "b_gate_up": (None if b_gate_up is None else b_gate_up.shape, (num_experts, two_inter)),
        "b_down": (None if b_down is None else b_down.shape, (num_experts, hidden_size)),
    }
    for name, (shape, wanted) in expected.items():
        if shape is not None and tuple(shape) != tuple(wanted):
            raise ValueError(f"fused_moe: {name} has shape {tuple(shape)}, expected {tuple(wanted)}")
    if two_inter % 2 or topk_ids.dim() != 2:
        raise ValueError("fused_moe: w_gate_up needs an even row count (gate rows, then up rows) and topk_ids [T, k]")
    if not (w_gate_up.is_contiguous() and w_down.is_contiguous()):
        raise ValueError("fused_moe: the expert weights must be contiguous")
