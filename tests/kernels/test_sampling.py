"""The one-pass Gumbel-max sampler (Triton, and its torch reference): greedy rows take the argmax, draws
follow softmax(logits / temperature), and a row's draw is a function of its seed alone."""
import pytest
import torch
from kernel_testing import DEVICE

from kernels import reference
from kernels.split_arrivals import num_sms
from kernels.triton_sampling import apply_token_bitmask, gumbel_argmax

IMPLEMENTATIONS = {"triton": gumbel_argmax, "reference": reference.gumbel_argmax}


@pytest.mark.slow  # thousands of rows through the interpreted kernel
@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
def test_draws_follow_the_tempered_softmax(name):
    """2,000 rows of one distribution, each with its own seed: the frequencies match the probabilities."""
    sample = IMPLEMENTATIONS[name]
    rows, temperature = 2000, 0.7
    logits = torch.tensor([1.0, 2.0, 0.5, 2.5, -1.0, 1.5], device=DEVICE).repeat(rows, 1)
    seeds = torch.randint(0, 2**63 - 1, (rows,), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    ids = sample(logits, torch.full((rows,), temperature, device=DEVICE), seeds)
    frequency = torch.bincount(ids.cpu(), minlength=6).float() / rows
    expected = torch.softmax(logits[0].cpu() / temperature, -1)
    assert (frequency - expected).abs().max() < 0.035  # about 4 standard deviations at these counts


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
def test_masked_tokens_are_never_drawn_and_the_rest_keep_their_odds(name):
    """The sampler's top-k / top-p / min-p path sets dropped tokens to -inf: they are never drawn, and the others
    follow the tempered softmax renormalised over what is kept."""
    sample = IMPLEMENTATIONS[name]
    rows, temperature = 1000, 1.3
    logits = torch.tensor([1.0, float("-inf"), 0.5, 2.5, float("-inf"), 1.5], device=DEVICE).repeat(rows, 1)
    seeds = torch.randint(0, 2**63 - 1, (rows,), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    ids = sample(logits, torch.full((rows,), temperature, device=DEVICE), seeds)
    frequency = torch.bincount(ids.cpu(), minlength=6).float() / rows
    expected = torch.softmax(logits[0].cpu() / temperature, -1)
    assert frequency[1] == frequency[4] == 0
    assert (frequency - expected).abs().max() < 0.06  # about 4 standard deviations at these counts


@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
def test_greedy_rows_seeds_and_a_vocabulary_over_several_blocks(name):
    """Temperature 0 is the argmax wherever it lies; the same seed gives the same draw in any batch; a
    vocabulary wider than one block is searched whole."""
    sample = IMPLEMENTATIONS[name]
    vocab = 9000  # three blocks of 4096 in the Triton kernel
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    logits[0, 8999] = logits[1, 5] = 50.0
    temperature = torch.tensor([0.0, 0.0, 1.0, 1.0], device=DEVICE)
    seeds = torch.tensor([11, 12, 13, 13], device=DEVICE)
    ids = sample(logits, temperature, seeds).tolist()
    assert ids[:2] == [8999, 5]
    alone = sample(logits[2:3], temperature[2:3], seeds[2:3]).item()
    assert ids[2] == alone
    draws = {sample(logits[2:3], temperature[2:3], torch.tensor([seed], device=DEVICE)).item() for seed in range(40)}
    assert len(draws) > 20  # near-flat logits at temperature 1: different seeds, different tokens


@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
def test_all_greedy_rows_take_the_first_of_equal_maxima_across_splits(name):
    """temperature None: every row greedy (the sampler's all-greedy batches). A few rows cut their vocabulary
    into splits (three blocks here, on any GPU); a maximum that recurs in several resolves to its first column,
    as torch.argmax does."""
    sample = IMPLEMENTATIONS[name]
    logits = torch.randn(3, 9000, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    logits[0, [70, 4100, 8990]] = logits[1, 8999] = logits[2, [4097, 5000]] = 9.0
    assert sample(logits, None, None).tolist() == [70, 8999, 4097]
    assert sample(logits[:1], None, None).tolist() == [70]
    bf16 = logits.bfloat16()
    assert sample(bf16, None, None).tolist() == bf16.argmax(-1).tolist()


@pytest.mark.slow  # hundreds of rows through the interpreted kernel
def test_a_draw_is_the_same_whether_its_row_is_split_or_whole():
    """A row alone is searched by several programs; in a batch that fills the GPU, by one: the same draw."""
    rows = 2 * num_sms(torch.device(DEVICE))
    logits = torch.randn(rows, 9000, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    temperature = torch.linspace(0.0, 1.5, rows, device=DEVICE)
    seeds = torch.arange(rows, device=DEVICE) * 7919
    whole = gumbel_argmax(logits, temperature, seeds)
    for row in (0, 1, rows // 2, rows - 1):
        assert gumbel_argmax(logits[row:row + 1], temperature[row:row + 1], seeds[row:row + 1]).item() == whole[row]


def test_rejects_strided_vocabulary():
    logits = torch.randn(8, 2, device=DEVICE).t()
    with pytest.raises(ValueError, match="contiguous along the vocabulary"):
        gumbel_argmax(logits, torch.ones(2, device=DEVICE), torch.zeros(2, dtype=torch.int64, device=DEVICE))


@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
def test_bf16_logits_draw_as_their_float32_copy(name):
    """The engine passes a bf16 model's logits uncopied: each row draws what it draws from float32 logits."""
    sample = IMPLEMENTATIONS[name]
    logits = torch.randn(6, 5000, generator=torch.Generator().manual_seed(3)).to(DEVICE).bfloat16()
    temperature = torch.tensor([0.0, 0.3, 0.7, 1.0, 1.5, 0.0], device=DEVICE)
    seeds = torch.arange(100, 106, device=DEVICE)
    assert torch.equal(sample(logits, temperature, seeds), sample(logits.float(), temperature, seeds))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("vocab", [40, 9000])
def test_token_bitmask_bans_exactly_the_cleared_bits_of_the_chosen_rows(dtype, vocab):
    """Triton and the reference agree with a per-token loop; rows not named keep every logit."""
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(5, vocab, generator=generator).to(dtype).to(DEVICE)
    allowed = torch.rand(2, vocab, generator=generator) < 0.3
    words = torch.zeros(2, -(-vocab // 32), dtype=torch.int64)
    for token in range(vocab):
        words[:, token // 32] |= allowed[:, token].long() << (token % 32)
    bitmask = (words - (words >= 2**31).long() * 2**32).to(torch.int32).to(DEVICE)  # as int32 words
    rows = torch.tensor([3, 0], device=DEVICE)
    expected = logits.clone()
    expected[3][~allowed[0].to(DEVICE)] = float("-inf")
    expected[0][~allowed[1].to(DEVICE)] = float("-inf")
    for apply in (apply_token_bitmask, reference.apply_token_bitmask):
        masked = logits.clone()
        apply(masked, bitmask, rows)
        assert torch.equal(masked, expected)


@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
def test_temperatures_below_the_greedy_threshold_take_the_argmax(name):
    """1 / 1e-40 overflows float32: such rows (and any below kernels.GREEDY_TEMPERATURE) are greedy rows."""
    sample = IMPLEMENTATIONS[name]
    logits = torch.randn(5, 3000, generator=torch.Generator().manual_seed(5)).to(DEVICE) * 4
    temperature = torch.tensor([1e-40, 1e-7, 9.99e-6, 0.0, 1e-30], device=DEVICE)
    for seed in range(3):
        seeds = torch.arange(seed, seed + 5, device=DEVICE)
        assert sample(logits, temperature, seeds).tolist() == logits.argmax(-1).tolist()
