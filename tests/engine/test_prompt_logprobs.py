"""Prompt logprobs (SamplingParams.prompt_logprobs) equal transformers' log-softmax of its logits at the position
before each prompt token, whole prompts, chunked prefill, a prompt whose blocks are in the prefix cache,
preemption and prompt chunks in steps that verify other requests' draft tokens alike; requests that do not ask
get none and keep their prefix-cache hits."""
import math

import pytest
import torch

from engine import LLM, SamplingParams
from random_decoders import TINY
from speculative_testing import CorruptedOracle

TOP = 3


@torch.inference_mode()
def reference(ref, prompt: list[int]) -> list:
    """transformers' entries: None for the first token, then (logprob, top ids, top logprobs) for each other."""
    logprobs = torch.log_softmax(ref.hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    entries = [None]
    for position, token in enumerate(prompt[1:]):
        top, ids = logprobs[position].topk(TOP)
        entries.append((logprobs[position, token].item(), ids.tolist(), top.tolist()))
    return entries


def assert_entries_match(got: list, want: list) -> None:
    assert len(got) == len(want) and got[0] is None
    for (logprob, ids, tops), (ref_logprob, ref_ids, ref_tops) in zip(got[1:], want[1:]):
        assert math.isclose(logprob, ref_logprob, abs_tol=1e-4)
        assert ids == ref_ids
        assert tops == pytest.approx(ref_tops, abs=1e-4)


ASKING = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=TOP)


@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 8}, {"num_kv_blocks": 7,
                                                                          "max_num_batched_tokens": 24},
                                      {"speculative": "ngram:k=3", "max_num_batched_tokens": 32}],
                         ids=["whole", "chunked", "preempted", "beside-verification"])
def test_prompt_logprobs_equal_transformers(tiny_llama, prompts_of_lengths, settings):
    prompts = prompts_of_lengths([2, 17, 40, 50], seed=4)
    new = 24  # with 7 blocks (112 slots) the batch does not fit: requests are preempted, some mid-prompt
    greedy = [tiny_llama.greedy(prompt, new) for prompt in prompts]
    llm = LLM(tiny_llama.path, dtype="float32", **settings)
    if "speculative" in settings:  # every decoding request verifies drafts while the others' prompts are chunked
        llm.core.speculator.adaptive = False
        llm.core.speculator.drafter = CorruptedOracle(greedy, TINY["vocab_size"])
    asking, plain = (SamplingParams(temperature=0, max_tokens=new, prompt_logprobs=TOP),
                     SamplingParams(temperature=0, max_tokens=new))
    outputs = llm.generate(prompts, [asking, plain, asking, asking])
    assert [out["token_ids"] for out in outputs] == greedy
    assert outputs[1]["prompt_logprobs"] is None
    for i in (0, 2, 3):
        assert_entries_match(outputs[i]["prompt_logprobs"], reference(tiny_llama, prompts[i]))
    if "num_kv_blocks" in settings:
        assert llm.core.stats()["num_preemptions"] > 0


def test_a_cached_prompt_is_computed_again_for_its_logprobs(tiny_llama, prompts_of_lengths):
    prompt = prompts_of_lengths([45], seed=7)[0]
    llm = LLM(tiny_llama.path, dtype="float32")
    plain = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([prompt], plain)  # its blocks are in the prefix cache now
    hits = llm.core.block_manager.num_hit_tokens
    asked = llm.generate([prompt], ASKING)[0]
    assert llm.core.block_manager.num_hit_tokens == hits, "the request that needs the prompt's logits hits nothing"
    assert_entries_match(asked["prompt_logprobs"], reference(tiny_llama, prompt))
    llm.generate([prompt], plain)
    assert llm.core.block_manager.num_hit_tokens > hits, "a request that does not ask still hits"
