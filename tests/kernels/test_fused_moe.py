"""The Triton mixture of experts (routing, the sort by expert, the grouped GEMMs) against the torch reference's
loop over experts, with uneven expert loads, experts that get no token, top-k 1, 2 and 8, one token, biases
on and off, and both activations; and experts in MXFP4 against the reference on their dequantized values."""
import math

import pytest
import torch
from kernel_testing import DEVICE, DTYPES, TOLERANCE, assert_close, cuda_only

from kernels import reference, triton_moe
from kernels.mxfp4 import Mxfp4Weight
from kernels.triton_moe import (
    GemmTiles,
    MoeTiles,
    align_rows,
    fused_moe,
    max_blocks,
    route,
    routed_experts,
    select_experts,
)

pytestmark = pytest.mark.usefixtures("poisoned_outputs")

SMALL_TILES = MoeTiles(16, GemmTiles(16, 16, 4, 2), GemmTiles(16, 16, 4, 2))


def skewed_routing(num_tokens, num_experts, top_k, empty=2):
    """Router choices where the first two experts take most tokens and the last `empty` experts none."""
    logits = torch.randn(num_tokens, num_experts, device=DEVICE)
    logits[:, :2] += 3.0
    if empty:
        logits[:, -empty:] = -1e4
    return reference.select_experts(logits, top_k, renormalize=True)


def expert_weights(num_experts, hidden, inter, dtype, bias):
    w_gate_up = (torch.randn(num_experts, 2 * inter, hidden, device=DEVICE) / hidden**0.5).to(dtype)
    w_down = (torch.randn(num_experts, hidden, inter, device=DEVICE) / inter**0.5).to(dtype)
    b_gate_up = torch.randn(num_experts, 2 * inter, device=DEVICE).to(dtype) if bias else None
    b_down = torch.randn(num_experts, hidden, device=DEVICE).to(dtype) if bias else None
    return w_gate_up, w_down, b_gate_up, b_down


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("num_experts,top_k", [(4, 1), (8, 2), (6, 6), (64, 8), (128, 8)])
def test_select_experts_matches_reference(num_experts, top_k, renormalize):
    logits = torch.randn(5, num_experts, device=DEVICE)
    ids, weights = select_experts(logits, top_k, renormalize)
    expected_ids, expected_weights = reference.select_experts(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and torch.equal(ids, expected_ids)
    assert_close(weights, expected_weights, torch.float32)


@pytest.mark.parametrize("renormalize", [False, True])
def test_select_experts_breaks_ties_to_the_lower_expert(renormalize):
    """Router logits rounded to bfloat16 tie often: tied experts are taken lowest first, each once."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0], [2.0] * 6], device=DEVICE)
    ids, weights = select_experts(logits, 4, renormalize)
    assert ids.tolist() == [[1, 2, 4, 5], [0, 1, 2, 3]]
    expected = torch.softmax(logits, 1).gather(1, ids.long())
    assert_close(weights, expected / expected.sum(1, keepdim=True) if renormalize else expected, torch.float32)


def test_select_experts_picks_distinct_experts_from_nan_logits():
    """An overflowed router (NaN logits) still names k distinct, valid experts: the kernels after it index
    weights by them."""
    logits = torch.tensor([[float("nan"), 1.0, float("nan"), 2.0, 0.0, float("nan")], [float("nan")] * 6],
                          device=DEVICE)
    ids, _ = select_experts(logits, 4, True)
    assert ids[0].tolist() == [3, 1, 4, 0]
    assert sorted(ids[1].tolist()) == [0, 1, 2, 3]


def test_select_experts_rejects_top_k_above_experts():
    with pytest.raises(ValueError, match="top_k=5"):
        select_experts(torch.randn(2, 4, device=DEVICE), 5, True)


@pytest.mark.parametrize("num_tokens,hidden,num_experts,top_k,bias", [
    (1, 64, 8, 2, False),  # one K split, one tile of experts
    (3, 96, 6, 6, True),  # K not a multiple of the split's BLOCK_K; every expert chosen
    (2, 320, 20, 4, True),  # K in three splits, experts in two tiles (one partial)
])
def test_route_matches_linear_and_select_experts(num_tokens, hidden, num_experts, top_k, bias):
    """The router GEMM with the top-k in its last program: the ids of select_experts on the router's linear
    layer (its logits rounded to x's dtype as that layer stores them), and their weights."""
    x = torch.randn(num_tokens, hidden, device=DEVICE)
    w = torch.randn(num_experts, hidden, device=DEVICE)
    b = torch.randn(num_experts, device=DEVICE) if bias else None
    ids, weights = route(x, w, b, top_k, renormalize=bias)
    expected_ids, expected_weights = reference.select_experts(reference.linear(x, w, b), top_k, renormalize=bias)
    assert torch.equal(ids, expected_ids)
    assert_close(weights, expected_weights, torch.float32)


@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m", [(1, 8, 2, 16), (9, 6, 2, 16), (40, 8, 8, 16),
                                                                  (33, 16, 1, 32), (300, 4, 2, 16)])
def test_align_rows_sorts_every_row_into_its_experts_blocks(num_tokens, num_experts, top_k, block_m):
    ids, _ = skewed_routing(num_tokens, num_experts, top_k, empty=1)
    num_rows = num_tokens * top_k
    sorted_rows, block_experts = align_rows(ids, num_experts, block_m)
    num_blocks = max_blocks(num_rows, num_experts, block_m)
    assert sorted_rows.shape == (num_blocks * block_m,) and block_experts.shape == (num_blocks,)
    rows = sorted_rows.view(num_blocks, block_m).long().cpu()
    owners = block_experts.long().cpu()
    flat = ids.reshape(-1).long().cpu()
    real = rows < num_rows
    assert (rows[~real] == num_rows).all()  # padding points past the end
    assert sorted(rows[real].tolist()) == list(range(num_rows))  # every row exactly once
    used = owners < num_experts
    assert not real[~used].any()  # unused blocks hold padding only
    assert (flat[rows[real]] == owners[:, None].expand_as(rows)[real]).all()  # a block's rows are its expert's
    counts = torch.bincount(flat, minlength=num_experts)
    blocks_per_expert = torch.bincount(owners[used], minlength=num_experts)
    assert torch.equal(blocks_per_expert, -(-counts // block_m))  # as few blocks as each expert needs
    assert (owners[used].diff() >= 0).all() and (owners[~used] >= num_experts).all()
    assert used[: int(used.sum())].all()  # used blocks first


def test_align_rows_buffers_depend_only_on_sizes():
    """A CUDA graph replays the same buffers whatever the routing: sizes follow T, k, E and BLOCK_M alone."""
    spread = torch.arange(12, device=DEVICE, dtype=torch.int32).view(6, 2) % 8
    crowded = torch.tensor([[0, 1]] * 6, device=DEVICE, dtype=torch.int32)
    shapes = {tuple(t.shape for t in align_rows(ids, 8, 16)) for ids in (spread, crowded)}
    assert len(shapes) == 1


CASES = [  # (tokens, hidden, inter, experts, top_k, tiles)
    (1, 32, 16, 8, 2, SMALL_TILES),                                       # one token
    (1, 32, 16, 8, 8, SMALL_TILES),                                       # top-8 of 8
    (7, 48, 32, 6, 1, SMALL_TILES),                                       # top-1; K not a multiple of BLOCK_K=32
    (20, 32, 24, 8, 2, MoeTiles(16, GemmTiles(16, 32, 4, 2), GemmTiles(16, 32, 4, 2))),  # ragged I and K tiles
    (37, 64, 32, 16, 8, SMALL_TILES),                                     # several blocks per busy expert
    (24, 32, 16, 4, 2, MoeTiles(32, GemmTiles(32, 16, 4, 2), GemmTiles(32, 16, 4, 2))),
    *cuda_only((256, 2048, 768, 128, 8, None), (2048, 2048, 768, 128, 8, None), (64, 2880, 1440, 32, 4, None)),
]


@pytest.mark.parametrize("activation", ["silu", "clamped_swiglu"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden,inter,num_experts,top_k,tiles", CASES)
def test_fused_moe_matches_reference(num_tokens, hidden, inter, num_experts, top_k, tiles, dtype, bias, activation):
    ids, weights = skewed_routing(num_tokens, num_experts, top_k, empty=min(2, num_experts - top_k))
    x = torch.randn(num_tokens, hidden, device=DEVICE).to(dtype)
    experts = expert_weights(num_experts, hidden, inter, dtype, bias)
    kwargs = dict(activation=activation, swiglu_alpha=1.702, swiglu_limit=1.5)  # a limit the values cross
    expected = reference.fused_moe(x.float(), ids, weights, *(w if w is None else w.float() for w in experts),
                                   **kwargs)
    assert_moe_close(fused_moe(x, ids, weights, *experts, tiles=tiles, **kwargs), expected, dtype)


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("num_tokens,top_k,dtype,bias,activation", [
    (1, 8, torch.float32, False, "silu"),
    (3, 2, torch.float16, True, "clamped_swiglu"),  # tokens sharing experts, each still read per row
])
def test_direct_and_sorted_routing_agree_with_reference(num_tokens, top_k, dtype, bias, activation, direct,
                                                        monkeypatch):
    """A step routed directly (no sort; the down GEMM sums each token's k rows) and the same step sorted by
    expert both give the reference's output."""
    monkeypatch.setattr(triton_moe, "DIRECT_MAX_TOKENS", num_tokens if direct else 0)
    ids, weights = skewed_routing(num_tokens, 8, top_k, empty=0)
    x = torch.randn(num_tokens, 48, device=DEVICE).to(dtype)
    experts = expert_weights(8, 48, 32, dtype, bias)
    kwargs = dict(activation=activation, swiglu_alpha=1.702, swiglu_limit=1.5)
    expected = reference.fused_moe(x.float(), ids, weights, *(w if w is None else w.float() for w in experts),
                                   **kwargs)
    assert_moe_close(fused_moe(x, ids, weights, *experts, tiles=SMALL_TILES, **kwargs), expected, dtype)


@pytest.mark.parametrize("num_tokens", [1, 5])
def test_routed_experts_matches_reference(num_tokens):
    """The whole routed MLP from the router weights: routed directly at one token, sorted at five."""
    x = torch.randn(num_tokens, 64, device=DEVICE)
    router = torch.randn(8, 64, device=DEVICE)
    experts = expert_weights(8, 64, 32, torch.float32, bias=True)
    args = (x, router, None, 2, True, *experts)
    assert_close(routed_experts(*args), reference.routed_experts(*args), torch.float32)


def assert_moe_close(actual, expected, dtype):
    """Within three roundings to dtype: the kernels store the activations and each slot's output in the
    input dtype before the sum over the k slots."""
    tol = 3 * TOLERANCE[dtype] if dtype != torch.float32 else TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


def test_fused_moe_reads_strided_hidden_rows():
    x = torch.randn(5, 64, device=DEVICE)[:, :32]
    ids, weights = skewed_routing(5, 4, 2, empty=0)
    experts = expert_weights(4, 32, 16, torch.float32, bias=True)
    expected = reference.fused_moe(x, ids, weights, *experts)
    assert_close(fused_moe(x, ids, weights, *experts, tiles=SMALL_TILES), expected, torch.float32)


def test_fused_moe_rejects_mismatched_weights():
    x = torch.randn(3, 32, device=DEVICE)
    ids, weights = skewed_routing(3, 4, 2, empty=0)
    w_gate_up, w_down, _, _ = expert_weights(4, 32, 16, torch.float32, bias=False)
    with pytest.raises(ValueError, match="w_down has shape"):
        fused_moe(x, ids, weights, w_gate_up, w_down[:, :, :8].contiguous())
    with pytest.raises(ValueError, match="activation 'gelu'"):
        fused_moe(x, ids, weights, w_gate_up, w_down, activation="gelu")



def mxfp4_weight(num_experts, rows, cols, generator):
    """Random MXFP4 codes (every E2M1 value, both signs; their root mean square is near 3) under per-group
    scales spread over four powers of two around 1 / (3 sqrt(cols)), so that outputs stay near unit size."""
    blocks = torch.randint(0, 256, (num_experts, rows, cols // 2), dtype=torch.uint8, generator=generator)
    center = 127 - round(math.log2(3 * cols**0.5))
    scales = torch.randint(center - 2, center + 2, (num_experts, rows, cols // 32), dtype=torch.uint8,
                           generator=generator)
    return Mxfp4Weight(blocks.to(DEVICE), scales.to(DEVICE))


MXFP4_TILES = MoeTiles(16, GemmTiles(16, 32, 4, 2), GemmTiles(16, 64, 4, 2))
MXFP4_CASES = [  # (tokens, hidden, inter, experts, top_k, tiles)
    (1, 64, 32, 8, 2, MXFP4_TILES),  # one token; the down GEMM's K (32) within one BLOCK_K of 64
    (1, 96, 64, 6, 2, None),  # one token on its own tiles (BLOCK_M 1): K of 3 and 2 groups in a BLOCK_K of 8
    (5, 96, 64, 6, 2, None),  # a few tokens routed directly, sharing experts
    (21, 96, 64, 6, 2, MXFP4_TILES),  # K=96: a gate/up BLOCK_K of 32 even, the down's 64 ragged
    *cuda_only((1, 2880, 2880, 32, 4, None), (64, 2880, 2880, 32, 4, None), (512, 2880, 1440, 32, 4, None),
               (4096, 2880, 2880, 32, 4, None)),  # gpt-oss-20b's experts (and a TP=2 rank's)
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden,inter,num_experts,top_k,tiles", MXFP4_CASES)
def test_mxfp4_fused_moe_matches_dequantized_reference(num_tokens, hidden, inter, num_experts, top_k, tiles, dtype):
    """gpt-oss's experts kept in MXFP4: the kernels' in-register dequantization against the reference on the
    dequantized weights, with gpt-oss's biases and clamped SwiGLU."""
    generator = torch.Generator().manual_seed(num_tokens)
    ids, weights = skewed_routing(num_tokens, num_experts, top_k, empty=min(2, num_experts - top_k))
    x = torch.randn(num_tokens, hidden, device=DEVICE).to(dtype)
    w_gate_up = mxfp4_weight(num_experts, 2 * inter, hidden, generator)
    w_down = mxfp4_weight(num_experts, hidden, inter, generator)
    b_gate_up, b_down = (torch.randn(num_experts, n, device=DEVICE).to(dtype) for n in (2 * inter, hidden))
    kwargs = dict(activation="clamped_swiglu", swiglu_alpha=1.702, swiglu_limit=1.5)
    expected = reference.fused_moe(x.float(), ids, weights, w_gate_up.dequantize(torch.float32),
                                   w_down.dequantize(torch.float32), b_gate_up.float(), b_down.float(), **kwargs)
    assert torch.equal(reference.fused_moe(x.float(), ids, weights, w_gate_up, w_down, b_gate_up.float(),
                                           b_down.float(), **kwargs), expected)  # the reference dispatches alike
    actual = fused_moe(x, ids, weights, w_gate_up, w_down, b_gate_up, b_down, tiles=tiles, **kwargs)
    assert_moe_close(actual, expected, dtype)


def test_mxfp4_fused_moe_needs_whole_groups_per_tile():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, device=DEVICE)
    ids, weights = skewed_routing(3, 4, 2, empty=0)
    w_gate_up, w_down = mxfp4_weight(4, 64, 64, generator), mxfp4_weight(4, 64, 32, generator)
    with pytest.raises(ValueError, match="BLOCK_K 16 must be a multiple of the MXFP4 group size 32"):
        fused_moe(x, ids, weights, w_gate_up, w_down, tiles=SMALL_TILES)
