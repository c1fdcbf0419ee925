"""Sampling in one pass over the logits: every token the engine draws (greedy rows take the argmax).

Each row's token is argmax(logits / temperature + G) with G standard Gumbel noise, which draws from
softmax(logits / temperature) exactly (the Gumbel-max trick); tokens whose logit is -inf (those top-k, top-p
or min-p dropped) are never drawn, and the rest keep their odds. A row whose temperature is below
GREEDY_TEMPERATURE (0 included) takes argmax(logits).
One program reads its row once and writes one id, where a torch path (softmax, noise, division, argmax)
makes many passes over a [rows, vocab] float32 tensor.
The noise is Philox keyed by one 64-bit seed per row and the token's column, so a row's draw depends only
on its seed, never on the batch around it.
"""
import torch
import triton
import triton.language as tl

from kernels.reference import GREEDY_TEMPERATURE

BLOCK = 4096


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, stride_row, temperature_ptr, seeds_ptr, out_ptr, vocab_size,
                          GREEDY_BELOW: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature < GREEDY_BELOW
    inverse = 1.0 / tl.where(greedy, 1.0, temperature)
    seed = tl.load(seeds_ptr + row)
    base = logits_ptr + row.to(tl.int64) * stride_row
    best = tl.full([], float("-inf"), tl.float32)
    best_id = tl.full([], 0, tl.int64)
    for start in range(0, vocab_size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vocab_size
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        uniform = tl.maximum(tl.rand(seed, cols), 1e-12)  # [0, 1): keep log(0) out
        score = tl.where(greedy, x, x * inverse - tl.log(-tl.log(uniform)))
        score = tl.where(mask, score, float("-inf"))
        block_best = tl.max(score, 0)
        block_id = (tl.argmax(score, 0) + start).to(tl.int64)
        take = block_best > best
        best = tl.where(take, block_best, best)
        best_id = tl.where(take, block_id, best_id)
    tl.store(out_ptr + row, best_id)


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """logits [N, V] (unit stride along V), temperature [N] float32 (below GREEDY_TEMPERATURE: greedy), seeds [N]
    int64 -> ids [N] int64."""
    if logits.stride(1) != 1:
        raise ValueError("gumbel_argmax needs logits contiguous along the vocabulary")
    num_rows, vocab_size = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows:
        _gumbel_argmax_kernel[(num_rows,)](logits, logits.stride(0), temperature, seeds, out, vocab_size,
                                           GREEDY_BELOW=GREEDY_TEMPERATURE,
                                           BLOCK=min(BLOCK, triton.next_power_of_2(vocab_size)), num_warps=8)
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
