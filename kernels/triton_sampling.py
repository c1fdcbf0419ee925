"""Sampling in one pass over the logits, for batches that ask only for temperature (and greedy rows).

Each row's token is argmax(logits / temperature + G) with G standard Gumbel noise, which draws from
softmax(logits / temperature) exactly (the Gumbel-max trick); a row of temperature 0 takes argmax(logits).
One program reads its row once and writes one id, where the torch path (softmax, noise, division, argmax)
makes many passes over a [rows, vocab] float32 tensor.
The noise is Philox keyed by one 64-bit seed per row and the token's column, so a row's draw depends only
on its seed, never on the batch around it.
"""
import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, stride_row, temperature_ptr, seeds_ptr, out_ptr, vocab_size,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0)
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature == 0.0
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
    """logits [N, V] (unit stride along V), temperature [N] float32 (0: greedy), seeds [N] int64 -> ids [N] int64."""
    if logits.stride(1) != 1:
        raise ValueError("gumbel_argmax needs logits contiguous along the vocabulary")
    num_rows, vocab_size = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows:
        _gumbel_argmax_kernel[(num_rows,)](logits, logits.stride(0), temperature, seeds, out, vocab_size,
                                           BLOCK=min(BLOCK, triton.next_power_of_2(vocab_size)), num_warps=8)
    return out
