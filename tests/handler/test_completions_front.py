"""/v1/completions through our front with the official openai client, on the packaged SmolLM2 behind
`python -m handler`: echo with prompt logprobs, streaming with usage, batches with n, errors as OpenAI 400s naming
the field, and /v1/models saying what the model does."""
import openai
import pytest

pytestmark = pytest.mark.slow  # SmolLM2 served by the handler behind our front

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(smollm2_service):
    with openai.OpenAI(base_url=smollm2_service.url, api_key="unused", max_retries=0, timeout=300) as client:
        yield client


def test_echo_and_logprobs_cover_prompt_and_output(client, smollm2_tokenizer):
    reply = client.completions.create(model="smollm2", prompt=PROMPT, echo=True, logprobs=2, max_tokens=4,
                                      temperature=0)
    choice = reply.choices[0]
    assert reply.object == "text_completion" and choice.text.startswith(PROMPT)
    prompt_tokens = len(smollm2_tokenizer(PROMPT)["input_ids"])
    assert reply.usage.prompt_tokens == prompt_tokens and reply.usage.completion_tokens == 4
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset) == prompt_tokens + 4
    assert logprobs.token_logprobs[0] is None and all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert "".join(logprobs.tokens) == choice.text
    plain = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=4, temperature=0)
    assert plain.choices[0].text == choice.text[len(PROMPT):] and plain.choices[0].logprobs is None


def test_streaming_gives_the_same_text_and_usage_last(client):
    whole = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=8, temperature=0)
    chunks = list(client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_a_batch_of_token_id_prompts_with_n(client, smollm2_tokenizer):
    prompts = [smollm2_tokenizer(text)["input_ids"] for text in ("One, two,", "Paris is")]
    reply = client.completions.create(model="smollm2", prompt=prompts, n=2, max_tokens=3, temperature=0)
    texts = [choice.text for choice in sorted(reply.choices, key=lambda c: c.index)]
    assert sorted(choice.index for choice in reply.choices) == [0, 1, 2, 3]
    assert texts[0] == texts[1] and texts[2] == texts[3] and reply.usage.completion_tokens == 12


@pytest.mark.parametrize("kwargs, param", [({"best_of": 2}, "best_of"), ({"suffix": "!"}, "suffix"),
                                           ({"logprobs": 9}, "logprobs")])
def test_unsupported_fields_are_400s_naming_them(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=2, **kwargs)
    assert refused.value.body["param"] == param


def test_models_say_what_the_model_does(client):
    model = client.models.list().data[0]
    assert model.capabilities == ["chat", "completions", "embeddings"]
