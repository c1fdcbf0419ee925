"""The sampler's math on fixed logits, checked against hand computation."""
import torch

from engine.sampler import Sampler, outside_top_k_top_p
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def make(prompt, output=(), **params):
    seq = Sequence(0, list(prompt), SamplingParams(**params), 100)
    seq.token_ids.extend(output)
    return seq


def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, 3.0]])
    seq = make([0, 1], [2, 2, 3], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    # token 0 (prompt, positive): 2 / 2; token 1 (prompt, negative): -1 * 2; token 2 (output twice):
    # 0.5 / 2 - 0.5 * 2 - 0.25; token 3 (output once): 1 / 2 - 0.5 - 0.25; token 4 unseen: unchanged
    expected = torch.tensor([[1.0, -2.0, -1.0, -0.25, 3.0]])
    assert torch.allclose(Sampler(torch.device("cpu")).apply_penalties(logits, [seq]), expected)


def test_penalties_apply_only_to_requests_that_ask():
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    plain, penalised = make([2]), make([2], frequency_penalty=2.0)
    penalised.token_ids.append(2)
    out = Sampler(torch.device("cpu")).apply_penalties(logits, [plain, penalised])
    assert out[0].tolist() == [1.0, 2.0, 3.0] and out[1].tolist() == [1.0, 2.0, 1.0]
    assert logits[1, 2] == 3.0  # the caller's logits are untouched


def test_penalty_counts_follow_a_batch_across_steps():
    """The steps of one batch count only the tokens each request added since the last: the same penalised
    logits as counting every token afresh, from one PenaltyCounts kept for the batch."""
    seqs = [make([0, 1], [2], repetition_penalty=1.5, frequency_penalty=0.5), make([3], temperature=0),
            make([4, 4], presence_penalty=1.0, frequency_penalty=-0.25)]
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(torch.device("cpu"))
    kept = []
    for step_tokens in ([3, 1, 5], [2, 2, 4], [5, 0, 4], [0, 0, 0]):
        incremental = sampler.apply_penalties(logits, seqs)
        assert torch.equal(incremental, Sampler(torch.device("cpu")).apply_penalties(logits, seqs))
        kept.append(sampler.plan.penalty_counts)
        for seq, token in zip(seqs, step_tokens):
            seq.token_ids.append(token)
    assert all(counts is kept[0] for counts in kept)
    assert kept[0].counted == [4, 3]  # the two penalised rows' output tokens when last counted


def test_top_k_top_p_masks():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]] * 4)
    dropped = outside_top_k_top_p(probs, top_k=torch.tensor([0.0, 3.0, 1.0, 0.0]),
                                  top_p=torch.tensor([0.8, 1.0, 1.0, 1.0]))
    assert (~dropped).int().tolist() == [[0, 1, 0, 1], [0, 1, 1, 1], [0, 1, 0, 0], [1, 1, 1, 1]]


def test_top_p_of_one_keeps_the_tail_that_rounding_would_cut():
    """The mass before the last tokens of a long tail can round up to the whole sum: top_p = 1 still keeps them."""
    probs = torch.softmax(torch.cat((torch.tensor([30.0]), torch.zeros(1000))), 0)[None]
    assert (probs.cumsum(-1) - probs)[0, -1] >= probs.sum()  # rounding has reached the sum before the end
    assert not outside_top_k_top_p(probs, torch.tensor([0.0]), torch.tensor([1.0])).any()


def test_sampling_respects_masks_and_greedy_rows():
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]])).repeat(4, 1)
    seqs = [make([0], temperature=1.0, top_k=2), make([0], temperature=1.0, min_p=0.5),
            make([0], temperature=0), make([0], temperature=1.0, top_p=0.4)]
    sampler = Sampler(torch.device("cpu"), seed=0)
    draws = torch.stack([sampler(logits, seqs) for _ in range(200)])
    assert set(draws[:, 0].tolist()) == {1, 3}  # top 2
    assert set(draws[:, 1].tolist()) == {1, 3}  # 0.3 >= 0.5 * 0.5
    assert set(draws[:, 2].tolist()) == {1}  # greedy
    assert set(draws[:, 3].tolist()) == {1}  # nucleus of 0.4 is the top token alone
    assert 0.35 < (draws[:, 0] == 3).float().mean() < 0.65  # 0.3 / 0.8 renormalised


def test_seeded_request_draws_are_independent_of_neighbours():
    logits = torch.randn(3, 50)
    a1, a2 = make([0], seed=123), make([0], seed=123)
    first = Sampler(torch.device("cpu"))(logits[:1], [a1])
    second = Sampler(torch.device("cpu"))(logits[[1, 0, 2]], [make([0]), a2, make([0], seed=7)])
    assert first[0] == second[1]
    assert Sampler(torch.device("cpu"))(logits[:1], [a1]).item() == Sampler(torch.device("cpu"))(
        logits[:1], [a2]).item()  # the same seed at the same position


def test_batch_plan_is_rebuilt_when_the_batch_changes():
    """The sampler keeps one batch's parameters on the device while the batch repeats; any other batch,
    even of the same size, gets its own."""
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    plain, penalised = make([0], temperature=0), make([0], [2], temperature=0, frequency_penalty=2.0)
    assert sampler(logits, [plain]).tolist() == [2]
    plan = sampler.plan
    assert sampler(logits, [plain]).tolist() == [2] and sampler.plan is plan
    assert sampler(logits, [penalised]).tolist() == [1]  # 3 - 2 * 1 < 2
    hot = make([0], temperature=1.0, top_k=2, seed=3)
    assert sampler(logits.expand(2, 3), [penalised, hot]).tolist()[0] == 1 and sampler.plan.seeded_rows == [1]


def test_one_pass_draw_of_a_seeded_request_is_keyed_by_position():
    """A temperature-only batch takes the one-pass path; a seeded request's draw depends on its seed and the
    position drawn, so a step launched one token ahead draws what the synchronous step would have."""
    logits = torch.randn(1, 400, generator=torch.Generator().manual_seed(2))
    sampler = Sampler(torch.device("cpu"))
    seq, longer = make([0, 1], seed=5, temperature=1.0), make([0, 1], [9], seed=5, temperature=1.0)
    assert not sampler.plan_for([seq]).uses_masks
    draws_ahead = [sampler(logits, [seq], ahead=1).item() for _ in range(3)]
    assert draws_ahead == [sampler(logits, [longer]).item()] * 3
    positions = {sampler(logits, [seq], ahead=n).item() for n in range(30)}
    assert len(positions) > 10


def test_bf16_logits_sample_as_their_float32_copy():
    """A bf16 model's logits go to the sampler as they are: every path (greedy, one pass, the full path with
    min_p / top_k, penalties) draws exactly what it draws from their float32 copy."""
    logits = (torch.randn(48, 1000, generator=torch.Generator().manual_seed(1)) * 2).bfloat16()
    batches = {
        "greedy": lambda: [make([0], temperature=0) for _ in range(48)],
        "one pass": lambda: [make([0], temperature=0.7, seed=row if row % 2 else None) for row in range(48)],
        "full": lambda: [make([0], temperature=1.3, min_p=0.01, top_k=400, seed=row) for row in range(48)],
        "penalised": lambda: [make([0, 5], [7, 7], repetition_penalty=1.3, frequency_penalty=0.4, temperature=0.9,
                                   seed=row) for row in range(48)],
    }
    for name, batch in batches.items():
        as_bf16 = Sampler(torch.device("cpu"), seed=0)(logits, batch())
        as_float32 = Sampler(torch.device("cpu"), seed=0)(logits.float(), batch())
        assert torch.equal(as_bf16, as_float32), name


def test_the_sampler_keys_both_paths_by_seed_and_position():
    """At the sampler: a seeded row draws what it draws alone, whether its batch takes the one-pass path or the
    masked one, and the draw moves with the position."""
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(4))
    subject = make([1, 2, 3], temperature=1.0, seed=99)
    alone = Sampler(torch.device("cpu"))(logits[:1], [subject]).item()
    for mate in ({"temperature": 0.5}, {"top_k": 3}, {"top_p": 0.3}, {"min_p": 0.2}, {"temperature": 0}):
        sampler = Sampler(torch.device("cpu"))
        batch = [make([5], **mate), subject, make([6], **mate)]
        assert sampler(logits[[1, 0, 2]], batch)[1].item() == alone, mate
    draws = {Sampler(torch.device("cpu"))(logits[:1], [subject], ahead=n).item() for n in range(30)}
    assert len(draws) > 10


TINY_TEMPERATURES = (1e-40, 1e-7, 9.99e-6)  # 1e-40: a float32 subnormal, whose inverse overflows to infinity
MASKS = ({}, {"top_k": 5}, {"top_p": 0.9}, {"min_p": 0.05}, {"top_k": 40, "top_p": 0.5, "min_p": 0.01, "seed": 3})


def test_tiny_temperatures_are_greedy_on_every_path():
    """A temperature below GREEDY_TEMPERATURE picks the argmax, whether the batch is all greedy, drawn in one pass
    (beside a hot row) or on the full path with top_k / top_p / min_p: never the NaNs of logits / 1e-40."""
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(4)) * 3
    tiny = [dict(temperature=t, **mask) for t in TINY_TEMPERATURES for mask in MASKS]
    assert all(SamplingParams(**params).greedy for params in tiny) and not SamplingParams(temperature=1e-5).greedy
    batches = {
        "all greedy": [make([0], **params) for params in tiny],
        "one pass": [make([0], temperature=t) for t in TINY_TEMPERATURES] + [make([0], temperature=1.0)],
        "full": [make([0], **params) for params in tiny] + [make([0], temperature=1.0, top_k=3)],
    }
    for name, seqs in batches.items():
        rows = len(seqs) - (name != "all greedy")  # the hot row closing a mixed batch draws as it likes
        for _ in range(3):
            sampled = Sampler(torch.device("cpu"))(logits[:len(seqs)], seqs)
            assert sampled[:rows].tolist() == logits[:rows].argmax(-1).tolist(), name
