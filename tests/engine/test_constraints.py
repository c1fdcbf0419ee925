"""Grammar-constrained decoding, logprobs, logit_bias and shared prompts in the engine, on a tiny random Llama
against transformers.

Greedy decoding under a grammar equals transformers' greedy decoding with the same grammar's mask applied by
hand (xgrammar's own apply_token_bitmask_inplace on transformers' logits): the grammar changes which tokens may
win, never how they are computed. Also under the overlap (steps launched ahead, sampled once the step before
is applied), chunked prefill, preemption and prefix-cache hits, and in a batch with unconstrained rows."""
import pytest
import torch
import xgrammar

from engine import LLM, SamplingParams
from handler.grammar import GrammarConstraint

VOCAB = 384
STOP = 0
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
          "required": ["name", "tags"], "additionalProperties": False}
NEW = 40
PROMPT_LENGTHS = [3, 17, 33, 50]


def tiny_vocabulary() -> list[str]:
    """Token strings for the tiny model's ids: JSON punctuation, letters, digits, and pairs of letters."""
    singles = list('{}[]",: ') + [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("0123456789")
    pairs = [a + b for a in "abcdefghijklmnopqrst" for b in "aeiouy xyzrstlnm"]
    return ["</s>"] + (singles + pairs + ['", "', '": ', '{"', '"}', '["', '"]'] * VOCAB)[:VOCAB - 1]


@pytest.fixture(scope="module")
def grammar():
    info = xgrammar.TokenizerInfo(tiny_vocabulary(), vocab_size=VOCAB, stop_token_ids=[STOP])
    return xgrammar.GrammarCompiler(info).compile_json_schema(SCHEMA, any_whitespace=False)


def masked_greedy(ref, prompt: list[int], grammar, max_new: int) -> list[int]:
    """transformers' greedy decoding with the grammar's mask applied to its logits by xgrammar itself."""
    matcher = xgrammar.GrammarMatcher(grammar)
    bitmask = xgrammar.allocate_token_bitmask(1, VOCAB)
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(max_new):
            logits = ref.hf_model(torch.tensor([tokens])).logits[:, -1].float()
            matcher.fill_next_token_bitmask(bitmask)
            xgrammar.apply_token_bitmask_inplace(logits, bitmask)
            token = int(logits.argmax())
            tokens.append(token)
            assert matcher.accept_token(token)
            if token == STOP or matcher.is_terminated():
                break
    return tokens[len(prompt):]


def generate(llm, prompts, grammar, constrained=None, params=None):
    params = params or SamplingParams(temperature=0, max_tokens=NEW, stop_token_ids=[STOP])
    constrained = constrained or [True] * len(prompts)
    constraints = [GrammarConstraint(grammar) if c else None for c in constrained]
    return [out["token_ids"] for out in llm.generate(prompts, params, constraints=constraints)]


@pytest.fixture(scope="module")
def expected(tiny_llama, grammar, prompts):
    return [masked_greedy(tiny_llama, prompt, grammar, NEW) for prompt in prompts]


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.slow  # six engines, each generating twice
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("setting", [{}, {"max_num_batched_tokens": 8}, {"num_kv_blocks": 7}])
def test_greedy_under_a_grammar_equals_greedy_with_the_mask_applied_by_hand(
        tiny_llama, grammar, prompts, expected, overlap, setting):
    llm = LLM(tiny_llama.path, dtype="float32", **setting)
    llm.core.overlap = overlap
    deferred, launch = [], llm.core.runner.launch
    llm.core.runner.launch = lambda *args: deferred.append((step := launch(*args)).deferred) or step
    assert generate(llm, prompts, grammar) == expected
    assert any(deferred) == overlap, "launched ahead, constrained steps sample once the step before is applied"
    if "num_kv_blocks" in setting:
        assert llm.core.scheduler.num_preemptions > 0
    assert generate(llm, prompts, grammar) == expected, "again, the prompts from the prefix cache"
    stats = llm.core.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_the_grammar_changes_the_output_and_leaves_unconstrained_neighbours_alone(
        tiny_llama, grammar, prompts, expected):
    """Dropping the mask would fail the test above: the model's own greedy choices break the grammar."""
    llm = LLM(tiny_llama.path, dtype="float32")
    llm.core.overlap = True
    free = [tiny_llama.greedy(prompt, NEW) for prompt in prompts]
    assert all(own != constrained for own, constrained in zip(free, expected))
    mixed = generate(llm, prompts, grammar, constrained=[True, False, True, False])
    assert mixed == [expected[0], free[1], expected[2], free[3]]


def test_a_grammar_that_completes_ends_the_request_with_stop(tiny_llama, grammar, prompts, expected):
    llm = LLM(tiny_llama.path, dtype="float32")
    finished = [tokens for tokens in expected if tokens[-1] == STOP]
    assert finished, "some constrained replies complete within the token budget"
    seq_outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, stop_token_ids=[STOP]),
                               constraints=[GrammarConstraint(grammar) for _ in prompts])
    for out, tokens in zip(seq_outputs, expected):
        assert out["token_ids"] == tokens


def test_greedy_logprobs_are_transformers_log_softmax_with_the_bias(tiny_llama, prompts):
    prompt = prompts[1]
    reference = tiny_llama.greedy(prompt, 6)
    banned = reference[0]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=5, logit_bias={banned: -100.0, 7: 3.0})
    llm = LLM(tiny_llama.path, dtype="float32")
    out, neighbour = llm.generate([prompt, prompts[0]], [params, SamplingParams(temperature=0, max_tokens=6)])
    assert neighbour["logprobs"] == [] and neighbour["token_ids"] == tiny_llama.greedy(prompts[0], 6)
    tokens, logprobs = out["token_ids"], out["logprobs"]
    assert tokens[0] != banned and len(logprobs) == len(tokens) == 6
    with torch.inference_mode():
        for i, (token, (logprob, top_ids, top_logprobs)) in enumerate(zip(tokens, logprobs)):
            logits = tiny_llama.hf_model(torch.tensor([prompt + tokens[:i]])).logits[0, -1].float()
            logits[banned] -= 100
            logits[7] += 3
            expected = torch.log_softmax(logits, -1)
            assert token == int(expected.argmax()) == top_ids[0]
            assert logprob == pytest.approx(float(expected[token]), abs=1e-4)
            assert top_ids == expected.topk(5).indices.tolist()
            assert top_logprobs == pytest.approx(expected.topk(5).values.tolist(), abs=1e-4)


def test_choices_sharing_a_prompt_take_its_blocks_from_the_prefix_cache(tiny_llama, prompts):
    llm = LLM(tiny_llama.path, dtype="float32")
    core = llm.core
    prompt = prompts[3]  # 50 tokens: three full blocks of 16
    params = [SamplingParams(temperature=1.0, max_tokens=8, seed=seed) for seed in (1, 2, 3)]
    leader = core.make_sequence("a/0", prompt, params[0])
    siblings = [core.make_sequence(f"a/{i}", prompt, params[i], shares_prompt_with=leader) for i in (1, 2)]
    for seq in [leader, *siblings]:
        core.add(seq)
    while core.has_work():
        core.step()
    assert [seq.num_cached_tokens for seq in siblings] == [48, 48]
    assert len({tuple(seq.output_token_ids) for seq in [leader, *siblings]}) == 3, "seeds 1, 2, 3 draw differently"
