"""Speculative decoding on two tensor-parallel ranks (CPU, gloo): verification steps, their rejected drafts
and freed blocks give the tokens one rank gives without drafts."""
import pytest

from engine import LLM, SamplingParams
from speculative_testing import CorruptedOracle
from tp_testing import prompts

pytestmark = pytest.mark.slow  # tensor-parallel ranks in processes of their own

GREEDY = SamplingParams(temperature=0, max_tokens=16)


def test_two_ranks_verifying_drafts_generate_what_one_does_without(tp_model_path):
    path = tp_model_path("qwen3")
    batch = prompts([3, 17, 40, 61], vocab=320)
    expected = [out["token_ids"] for out in LLM(path, device="cpu").generate(batch, GREEDY)]
    two = LLM(path, device="cpu", tensor_parallel_size=2, speculative="ngram:k=4")
    try:
        two.core.speculator.adaptive = False
        two.core.speculator.drafter = CorruptedOracle(expected, 320)
        assert [out["token_ids"] for out in two.generate(batch, GREEDY)] == expected
        stats = two.core.stats()
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_drafted_tokens"]
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
    finally:
        two.shutdown()
