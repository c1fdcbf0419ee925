"""Sampling in one pass over the logits: every token the engine draws (greedy rows take the argmax).

Each row's token is argmax(logits / temperature + G) with G standard Gumbel noise, which draws from
softmax(logits / temperature) exactly (the Gumbel-max trick); tokens whose logit is -inf (those top-k, top-p
or min-p dropped) are never drawn, and the rest keep their odds. A row whose temperature is below
GREEDY_TEMPERATURE (0 included) takes argmax(logits).
The row is read once, by one program or, at small batches, by several that each take a run of it (the last to
finish picks the best), where a torch path (softmax, noise, division, argmax) makes many passes over a
[rows, vocab] float32 tensor.
The noise is Philox keyed by one 64-bit seed per row and the token's column, so a row's draw depends only
on its seed, never on the batch around it.
"""
import torch
import triton
import triton.language as tl

from kernels.dependent_launch import launch_options, release_next, wait_for_previous
from kernels.reference import GREEDY_TEMPERATURE
from kernels.split_arrivals import arrival_counters, is_last_arrival, num_sms

BLOCK = 4096
MAX_SPLITS = 64


@triton.jit(do_not_specialize=["split_len", "splits"])  # one compiled kernel for any batch: no compiles mid-serving
def _gumbel_argmax_kernel(logits_ptr, stride_row, temperature_ptr, seeds_ptr, out_ptr, part_score_ptr, part_id_ptr,
                          arrivals_ptr, vocab_size, split_len, GREEDY_BELOW: tl.constexpr, ALL_GREEDY: tl.constexpr,
                          BLOCK: tl.constexpr, MAX_SPLITS: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (row, split) searches the split's run of the row; with several splits the last of a row's to
    arrive takes the best of their bests, the lowest id among equals, as one program's walk would."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    greedy = True
    inverse = 1.0
    seed = 0
    if not ALL_GREEDY:  # the step's uploaded settings, read before the wait (kernels/dependent_launch.py)
        temperature = tl.load(temperature_ptr + row)
        greedy = temperature < GREEDY_BELOW
        inverse = 1.0 / tl.where(greedy, 1.0, temperature)
        seed = tl.load(seeds_ptr + row)
    wait_for_previous(USE_PDL)
    release_next(USE_PDL)
    base = logits_ptr + row.to(tl.int64) * stride_row
    best = tl.full([], float("-inf"), tl.float32)
    best_id = tl.full([], 0, tl.int64)
    end = tl.minimum((split + 1) * split_len, vocab_size)
    for start in range(split * split_len, end, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < end
        score = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if not ALL_GREEDY:
            uniform = tl.maximum(tl.rand(seed, cols), 1e-12)  # [0, 1): keep log(0) out
            score = tl.where(greedy, score, score * inverse - tl.log(-tl.log(uniform)))
        score = tl.where(mask, score, float("-inf"))
        block_best = tl.max(score, 0)
        block_id = (tl.argmax(score, 0) + start).to(tl.int64)
        take = block_best > best
        best = tl.where(take, block_best, best)
        best_id = tl.where(take, block_id, best_id)
    if splits == 1:
        tl.store(out_ptr + row, best_id)
    else:
        tl.store(part_score_ptr + row * splits + split, best)
        tl.store(part_id_ptr + row * splits + split, best_id)
        if is_last_arrival(arrivals_ptr + row, splits):
            parts = tl.arange(0, MAX_SPLITS)
            used = parts < splits
            first = row * splits
            scores = tl.load(part_score_ptr + first + parts, mask=used, other=float("-inf"), cache_modifier=".cg")
            ids = tl.load(part_id_ptr + first + parts, mask=used, other=vocab_size, cache_modifier=".cg")
            tl.store(out_ptr + row, tl.min(tl.where(scores == tl.max(scores, 0), ids, vocab_size), 0))


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor | None, seeds: torch.Tensor | None) -> torch.Tensor:
    """logits [N, V] (unit stride along V), temperature [N] float32 (below GREEDY_TEMPERATURE: greedy), seeds [N]
    int64 -> ids [N] int64; temperature and seeds None: every row greedy. A row's vocabulary is cut into splits,
    one program each, while the rows leave the GPU's multiprocessors idle: a batch-1 step waits on its draw."""
    if logits.stride(1) != 1:
        raise ValueError("gumbel_argmax needs logits contiguous along the vocabulary")
    num_rows, vocab_size = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if not num_rows:
        return out
    block = min(BLOCK, triton.next_power_of_2(vocab_size))
    blocks = triton.cdiv(vocab_size, block)
    split_len = triton.cdiv(blocks, min(blocks, MAX_SPLITS, max(1, 2 * num_sms(logits.device) // num_rows))) * block
    splits = triton.cdiv(vocab_size, split_len)
    part_score = part_id = arrivals = out
    if splits > 1:
        part_score = torch.empty(num_rows * splits, dtype=torch.float32, device=logits.device)
        part_id = torch.empty(num_rows * splits, dtype=torch.int64, device=logits.device)
        arrivals = arrival_counters(num_rows, logits.device)
    greedy = temperature is None
    _gumbel_argmax_kernel[(num_rows, splits)](
        logits, logits.stride(0), out if greedy else temperature, out if greedy else seeds, out, part_score, part_id,
        arrivals, vocab_size, split_len, GREEDY_BELOW=GREEDY_TEMPERATURE, ALL_GREEDY=greedy, BLOCK=block,
        MAX_SPLITS=MAX_SPLITS, num_warps=8, **launch_options(logits))
    return out


@triton.jit
def _token_bitmask_kernel(logits_ptr, stride_row, bitmask_ptr, bitmask_stride, rows_ptr, vocab_size,
                          BLOCK: tl.constexpr):
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab_size
    words = tl.load(bitmask_ptr + tl.program_id(0) * bitmask_stride + cols // 32, mask=inside, other=-1)
    allowed = (words >> (cols % 32)) & 1
    row = tl.load(rows_ptr + tl.program_id(0))
    banned = tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_row + cols, banned, mask=inside & (allowed == 0))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf where bit t % 32 of bitmask[i, t // 32] (int32 [R, ceil(V / 32)]) is
    clear; rows [R] int64. Only the disallowed entries are written."""
    if logits.stride(1) != 1:
        raise ValueError("apply_token_bitmask needs logits contiguous along the vocabulary")
    vocab_size = logits.shape[1]
    block = min(BLOCK, triton.next_power_of_2(vocab_size))
    if len(rows):
        _token_bitmask_kernel[(len(rows), triton.cdiv(vocab_size, block))](
            logits, logits.stride(0), bitmask, bitmask.stride(0), rows, vocab_size, BLOCK=block)
