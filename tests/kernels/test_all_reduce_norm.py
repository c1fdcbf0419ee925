"""The norm fused with the sum over tensor-parallel ranks (kernels/triton_all_reduce_norm.py), its ranks played one
after another in one process: every rank's exchange buffers are plain tensors here, and a rank runs once the
others' rows and arrival flags are where they would be had those ranks got there first. The flags' hand-over
between ranks running at once, over peer memory, is checked on GPUs by bench/all_reduce_check.py."""
import pytest
import torch
from kernel_testing import DEVICE, DTYPES, assert_close

from kernels import reference
from kernels.triton_all_reduce_norm import Exchange, all_reduce_rms_norm

pytestmark = pytest.mark.usefixtures("poisoned_outputs")
MAX_ROWS, PITCH = 4, 32
ARRIVED, FREE = 0, 1


def exchanges(world: int, dtype) -> list[Exchange]:
    rows = tuple(torch.zeros(MAX_ROWS, PITCH, dtype=dtype, device=DEVICE) for _ in range(world))
    flags = tuple(torch.zeros(2, MAX_ROWS, world, dtype=torch.int32, device=DEVICE) for _ in range(world))
    for f in flags:
        f[FREE] = 1
    return [Exchange(rank, rows, flags) for rank in range(world)]


def rank_ordered_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    total = torch.zeros_like(parts[0], dtype=torch.float32)
    for part in parts:
        total += part.float()
    return total.to(parts[0].dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 32), (3, 24)])
def test_two_ranks_get_the_same_norm_of_the_sum_and_leave_the_flags_idle(tokens, hidden, dtype):
    rank0, rank1 = exchanges(2, dtype)
    parts = [torch.randn(tokens, hidden, device=DEVICE).to(dtype) for _ in range(2)]
    residual = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    weight = torch.randn(hidden, device=DEVICE).to(dtype)
    rank1.rows[1][:tokens, :hidden] = parts[1]  # rank 1 got there first: its rows staged, its arrival told
    rank0.flags[0][ARRIVED, :tokens, 1] = 1
    out0, residual0 = all_reduce_rms_norm(parts[0], residual, weight, 1e-6, rank0)
    assert rank1.flags[1][ARRIVED, :tokens, 0].tolist() == [1] * tokens  # rank 0 told rank 1 it arrived
    out1, residual1 = all_reduce_rms_norm(parts[1], residual, weight, 1e-6, rank1)

    expected, expected_residual = reference.add_rms_norm(rank_ordered_sum(parts), residual, weight, 1e-6)
    assert_close(residual0, expected_residual, dtype)
    assert_close(out0, expected, dtype)
    assert torch.equal(out0, out1) and torch.equal(residual0, residual1)
    assert torch.equal(rank0.rows[0][:tokens, :hidden], parts[0])  # each rank staged its own rows
    # Each arrival a rank waited on was taken back. Rank 1's arrival at rank 0 stays set: it was told twice, once by
    # the test standing in for an early rank 1. Rank 1 gave rank 0's rows back after reading them; rank 1's own rows
    # stay taken, since rank 0 read them (and gave them back) before rank 1 staged them again.
    assert rank1.flags[1][ARRIVED].sum() == 0 and rank0.flags[0][ARRIVED, :tokens, 1].tolist() == [1] * tokens
    assert rank0.flags[0][FREE, :, 1].tolist() == [1] * MAX_ROWS
    assert rank1.flags[1][FREE, :, 0].tolist() == [0] * tokens + [1] * (MAX_ROWS - tokens)
    assert rank0.flags[0][ARRIVED, tokens:].sum() == 0  # rows past the step's are untouched


def test_every_rank_sums_in_rank_order_without_a_residual():
    """Three ranks: the float32 sum's rounding depends on its order, so every rank adds rank 0's rows first."""
    world, tokens, hidden = 3, 2, 32
    ranks = exchanges(world, torch.float32)
    parts = [torch.randn(tokens, hidden, device=DEVICE) * scale for scale in (1e4, 1.0, -1e4)]
    weight = torch.randn(hidden, device=DEVICE)
    outs = []
    for rank in ranks:
        for other in range(world):
            if other != rank.rank:
                rank.rows[other][:tokens] = parts[other]
                rank.flags[rank.rank][ARRIVED, :tokens, other] = 1
                rank.flags[rank.rank][FREE, :tokens, other] = 1
        outs.append(all_reduce_rms_norm(parts[rank.rank], None, weight, 1e-6, rank))
    assert_close(outs[0], reference.rms_norm(rank_ordered_sum(parts), weight, 1e-6), torch.float32)
    assert all(torch.equal(out, outs[0]) for out in outs)


def test_a_rank_takes_its_rows_free_flags_before_staging_them():
    """Until its peer has read them (and given the flags back), the rows a rank staged may not be staged over."""
    rank0, rank1 = exchanges(2, torch.float32)
    x = torch.randn(2, PITCH, device=DEVICE)
    rank1.rows[1][:2] = x
    rank0.flags[0][ARRIVED, :2, 1] = 1
    all_reduce_rms_norm(x, None, torch.ones(PITCH, device=DEVICE), 1e-6, rank0)
    assert rank0.flags[0][FREE, :2, 1].tolist() == [0, 0]  # taken by rank 0, to be given back by rank 1
    assert rank0.flags[0][FREE, 2:, 1].tolist() == [1] * (MAX_ROWS - 2)


@pytest.mark.parametrize("shape,dtype,fits", [
    ((1, 32), torch.float32, True), ((MAX_ROWS, 24), torch.float32, True), ((MAX_ROWS + 1, 32), torch.float32, False),
    ((1, PITCH + 1), torch.float32, False), ((1, 32), torch.float16, False), ((0, 32), torch.float32, False)])
def test_what_fits_an_exchange(shape, dtype, fits):
    assert exchanges(2, torch.float32)[0].fits(torch.zeros(shape, dtype=dtype)) is fits
