"""The `completions` handler call (legacy completions, docs/completions.md) in process, on a tiny random Llama
with SmolLM2's tokenizer: echo with prompt logprobs equal to transformers' for the same tokens, output logprobs,
batches of text and token-id prompts, n, stop strings, usage, and errors naming the field."""
import asyncio
import math

import pytest
import torch
from transformers import LlamaConfig

from engine import EngineConfig, Worker
from handler.chat import RequestError
from handler.service import Service
from random_decoders import TINY, save_random_decoder

PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_tokenizer):
    """(service, transformers model, tokenizer): the model reads SmolLM2's vocabulary, never emits its end token."""
    path = tmp_path_factory.mktemp("tiny-llama-smollm2-vocab")
    config = LlamaConfig(**{**TINY, "vocab_size": len(smollm2_tokenizer)}, tie_word_embeddings=True)
    hf_model = save_random_decoder(config, path, random_biases_and_norms=False)
    smollm2_tokenizer.save_pretrained(path)
    worker = Worker(EngineConfig.from_env(str(path), {"HFENDPOINT_DEVICE": "cpu", "HFENDPOINT_DTYPE": "float32"}))
    yield Service(worker, smollm2_tokenizer, "tiny"), hf_model, smollm2_tokenizer
    worker.shutdown()


def run(service, data) -> list[dict]:
    async def collect():
        return [chunk async for chunk in service.completions(data)]
    return asyncio.run(collect())


def gathered(chunks) -> dict[int, dict]:
    """Each choice's text, legacy logprobs lists and finish reason, from the reply chunks."""
    choices = {}
    for chunk in chunks:
        choice = choices.setdefault(chunk["index"], {"text": "", "logprobs": None, "finish_reason": None})
        choice["text"] += chunk["text"]
        if chunk.get("logprobs"):
            choice["logprobs"] = choice["logprobs"] or {key: [] for key in chunk["logprobs"]}
            for key, values in chunk["logprobs"].items():
                choice["logprobs"][key] += values
        choice["finish_reason"] = chunk.get("choice_finish_reason") or chunk.get("finish_reason") \
            or choice["finish_reason"]
    return choices


@torch.inference_mode()
def transformers_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits: row p is the distribution of token p + 1."""
    return torch.log_softmax(hf_model(torch.tensor([token_ids])).logits[0].float(), dim=-1)


def test_echo_with_logprobs_gives_transformers_numbers_for_prompt_and_output(tiny):
    service, hf_model, tokenizer = tiny
    chunks = run(service, {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 5, "temperature": 0})
    assert [c for c in chunks if "finish_reason" in c] == [chunks[-1]], "the last chunk alone ends the request"
    choice = gathered(chunks)[0]
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    assert chunks[-1]["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 5,
                                   "total_tokens": len(prompt_ids) + 5}
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(prompt_ids) + 5
    assert choice["text"].startswith(PROMPT) and "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["text_offset"][:2] == [0, len(logprobs["tokens"][0])]
    output_ids = tokenizer(choice["text"][len(PROMPT):], add_special_tokens=False)["input_ids"]  # as generated
    all_ids = prompt_ids + output_ids
    reference = transformers_logprobs(hf_model, all_ids)
    for position, (token, logprob, top) in enumerate(zip(all_ids[1:], logprobs["token_logprobs"][1:],
                                                         logprobs["top_logprobs"][1:])):
        assert math.isclose(logprob, reference[position, token].item(), abs_tol=1e-4), position
        best = reference[position].topk(2)
        assert sorted(top.values(), reverse=True)[:2] == pytest.approx(best.values.tolist(), abs=1e-4)
        assert top[logprobs["tokens"][position + 1]] == logprob, "the token's own logprob is among the alternatives"
    greedy = reference[len(prompt_ids) - 1:-1].argmax(-1).tolist()
    assert output_ids == greedy, "temperature 0 continues with transformers' argmax"


def test_batches_of_text_and_token_ids_with_n_number_their_choices_as_openai(tiny):
    service, _, tokenizer = tiny
    texts = ["One two three", "Once upon a time"]
    ids = [tokenizer(text)["input_ids"] for text in texts]
    for prompt in (texts, ids):
        chunks = run(service, {"prompt": prompt, "n": 2, "max_tokens": 4, "temperature": 0})
        choices = gathered(chunks)
        assert sorted(choices) == [0, 1, 2, 3]
        alone = [gathered(run(service, {"prompt": text, "max_tokens": 4, "temperature": 0}))[0]["text"]
                 for text in texts]
        assert [choices[i]["text"] for i in range(4)] == [alone[0], alone[0], alone[1], alone[1]]
        assert all(choices[i]["finish_reason"] == "length" for i in range(4))
        assert chunks[-1]["usage"]["completion_tokens"] == 16
        assert chunks[-1]["usage"]["prompt_tokens"] == sum(map(len, ids))
    echoed = gathered(run(service, {"prompt": ids[0], "echo": True, "max_tokens": 1}))[0]
    assert echoed["text"].startswith(tokenizer.decode(ids[0])) and echoed["logprobs"] is None


def test_a_stop_string_ends_the_text_right_before_it(tiny):
    service, _, _ = tiny
    free = gathered(run(service, {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}))[0]["text"]
    stop = free[len(free) // 2:len(free) // 2 + 3]
    stopped = gathered(run(service, {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stop": [stop]}))[0]
    assert stopped["text"] == free[:free.index(stop)] and stopped["finish_reason"] == "stop"


@pytest.mark.parametrize("data, param", [
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "logprobs": 6}, "logprobs"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["x", [1, 2]]}, "prompt"),
    ({"prompt": [1, 10**9]}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "max_tokens": 10**6}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "messages": []}, "messages"),
])
def test_bad_requests_are_refused_naming_the_field(tiny, data, param):
    service, _, _ = tiny
    with pytest.raises(RequestError) as refused:
        run(service, data)
    assert refused.value.param == param and refused.value.status == 400
