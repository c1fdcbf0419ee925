"""One seed scheme: a seeded request's tokens depend on its seed, its positions and its own settings only, so it
draws the same tokens alone and beside mates of every kind, whichever sampler path the batch takes (the
one-pass path of temperature-only batches, or the masked path that top-k, top-p and min-p need)."""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampler import Sampler
from engine.sequence import Sequence

NEW = 12
SUBJECTS = {  # the seeded request whose tokens must not move: one-pass alone, masked alone, penalised
    "temperature": SamplingParams(temperature=1.0, max_tokens=NEW, seed=42),
    "top_p": SamplingParams(temperature=1.1, top_p=0.8, max_tokens=NEW, seed=2**63 + 5),
    "penalised": SamplingParams(temperature=0.8, frequency_penalty=0.5, repetition_penalty=1.2, max_tokens=NEW,
                                seed=11),
}
MATES = {  # the kinds of batch-mates, each forcing a sampler path or a plan of its own
    "greedy": SamplingParams(temperature=0, max_tokens=NEW),
    "temperature": SamplingParams(temperature=0.7, max_tokens=NEW),
    "top_k": SamplingParams(temperature=1.0, top_k=5, max_tokens=NEW),
    "top_p": SamplingParams(temperature=1.0, top_p=0.5, max_tokens=NEW),
    "min_p": SamplingParams(temperature=1.0, min_p=0.1, max_tokens=NEW),
    "penalised": SamplingParams(temperature=1.0, presence_penalty=1.5, max_tokens=NEW),
    "seeded": SamplingParams(temperature=1.0, top_k=20, max_tokens=NEW - 5, seed=42),
    "unseeded": SamplingParams(temperature=1.2, max_tokens=3),
}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama.path, dtype="float32")


@pytest.mark.parametrize("subject", sorted(SUBJECTS))
def test_seeded_request_draws_the_same_beside_mates_of_every_kind(llm, subject, prompts_of_lengths):
    prompt, *mate_prompts = prompts_of_lengths([9, 14, 5], seed=12)
    params = SUBJECTS[subject]
    alone = llm.generate([prompt], params)[0]["token_ids"]
    assert len(alone) == NEW
    for name, mate in MATES.items():
        batch = llm.generate([mate_prompts[0], prompt, mate_prompts[1]], [mate, params, mate])
        assert batch[1]["token_ids"] == alone, f"{subject} beside {name} mates"
    again = llm.generate([prompt, *mate_prompts], [params, MATES["top_k"], MATES["temperature"]])
    assert again[0]["token_ids"] == alone
    reseeded = SamplingParams(**{**vars(params), "seed": params.seed + 1})
    assert llm.generate([prompt], reseeded)[0]["token_ids"] != alone  # the seed does matter


def make(prompt, output=(), **params):
    seq = Sequence(0, list(prompt), SamplingParams(**params), 100)
    seq.token_ids.extend(output)
    return seq


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
