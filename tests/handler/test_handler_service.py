"""`python -m handler` serving SmolLM2 on CPU behind our front, driven by the real openai client."""

import asyncio
import json
import math
import re
import time
import urllib.error
import urllib.request

import openai
import pytest

pytestmark = pytest.mark.slow  # SmolLM2 served by the handler behind our front

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = ["What is the capital of France?", "Name three colors.", "Say hello in Spanish.", "What is 2 + 2?"]
SMOLLM2_HIDDEN_SIZE = 576


@pytest.fixture(scope="module")
def client(smollm2_service):
    with openai.OpenAI(base_url=smollm2_service.url, api_key="unused", max_retries=0, timeout=300) as client:
        yield client


def complete(client, messages, **kwargs):
    return client.chat.completions.create(model="smollm2", messages=messages, temperature=0, **kwargs)


def stream(client, messages, **kwargs):
    chunks = list(complete(client, messages, stream=True, **kwargs))
    return "".join(c.choices[0].delta.content or "" for c in chunks), chunks


def test_capital_of_france_streaming_and_not(client):
    reply = complete(client, CAPITAL, max_tokens=32)
    text = reply.choices[0].message.content
    assert "Paris" in text
    assert reply.choices[0].finish_reason == "stop"
    usage = reply.usage
    assert usage.prompt_tokens > 0 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    streamed, chunks = stream(client, CAPITAL, max_tokens=32)
    assert streamed == text
    reasons = [c.choices[0].finish_reason for c in chunks]
    assert reasons[-1] == "stop" and set(reasons[:-1]) == {None}
    assert all(c.choices[0].delta.content for c in chunks[:-1]), "no empty chunks before the last"


def test_max_tokens_ends_with_length_after_exactly_that_many_tokens(client):
    reply = complete(client, CAPITAL, max_tokens=5)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 5


@pytest.mark.parametrize("streaming", [False, True])
def test_stop_string_cuts_the_text_right_before_it(client, streaming):
    text = complete(client, CAPITAL, max_tokens=32).choices[0].message.content
    words = text.split()
    assert len(words) >= 4, f"need a few words of greedy output to pick a stop string from: {text!r}"
    stop = " ".join(words[len(words) // 2 - 1: len(words) // 2 + 1])  # two words: spans a token boundary
    if streaming:
        cut, chunks = stream(client, CAPITAL, max_tokens=32, stop=[stop])
        finish_reason = chunks[-1].choices[0].finish_reason
    else:
        reply = complete(client, CAPITAL, max_tokens=32, stop=stop)
        cut, finish_reason = reply.choices[0].message.content, reply.choices[0].finish_reason
    assert cut == text[: text.index(stop)]
    assert finish_reason == "stop"


def test_64_concurrent_streams_match_their_sequential_answers(client, smollm2_service):
    expected = {p: complete(client, [{"role": "user", "content": p}], max_tokens=12).choices[0].message.content
                for p in PROMPTS}

    async def one(aclient, prompt):
        response = await aclient.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=12, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in response])

    async def run_all():
        async with openai.AsyncOpenAI(base_url=smollm2_service.url, api_key="unused", max_retries=0,
                                      timeout=300) as aclient:
            return await asyncio.gather(*(one(aclient, PROMPTS[i % len(PROMPTS)]) for i in range(64)))

    texts = asyncio.run(run_all())
    assert texts == [expected[PROMPTS[i % len(PROMPTS)]] for i in range(64)]


def test_client_disconnect_frees_the_kv_blocks(client, smollm2_service):
    idle = smollm2_service.call("stats")
    assert idle["running"] == 0
    response = client.chat.completions.create(
            model="smollm2", messages=CAPITAL, max_tokens=400, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(response)
    next(chunks), next(chunks)
    busy = smollm2_service.call("stats")
    assert busy["running"] == 1 and busy["num_free_blocks"] < idle["num_free_blocks"]
    response.close()  # the HTTP client goes away: the daemon sends `cancel`, the handler aborts the request
    deadline = time.monotonic() + 30
    while (stats := smollm2_service.call("stats"))["num_free_blocks"] != idle["num_free_blocks"]:
        assert time.monotonic() < deadline, f"blocks not freed after the disconnect: {stats} (idle: {idle})"
        time.sleep(0.05)
    assert stats["running"] == 0 and stats["waiting"] == 0


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("request_kwargs, param, problem", [
    ({"messages": [{"role": "user", "content": "word " * 600}]}, "messages", "maximum context length of 512"),
    ({"messages": CAPITAL, "temperature": -1}, "temperature", "temperature must be a number >= 0, got -1"),
    ({"messages": CAPITAL, "temperature": "hot"}, "temperature", "temperature must be a number >= 0, got 'hot'"),
    ({"messages": CAPITAL, "top_p": 1.5}, "top_p", "top_p must be a number in (0, 1], got 1.5"),
    ({"messages": CAPITAL, "max_tokens": 0}, "max_tokens", "max_tokens must be an integer >= 1, got 0"),
    ({"messages": []}, "messages", "messages must be a non-empty list of messages, got []"),
    ({"messages": "hi"}, "messages", "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages", "messages[0].role must be one of"),
    ({"messages": CAPITAL, "max_tokens": 600}, "max_tokens", "max_tokens"),
    ({"messages": CAPITAL, "n": 17}, "n", "n must be between 1 and 16"),
    ({"messages": [{"role": "user", "content": "x" * 21_000_000}]}, "messages", "characters, at least"),
    ({"messages": CAPITAL, "extra_body": {"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}},
     "chat_template_kwargs.chat_template",
     "chat_template_kwargs.chat_template: this server does not run chat templates sent with requests"),
    ({"messages": CAPITAL, "stop": ["y" * 30_000]}, "stop", "a stop string is at most 1024 characters"),
    ({"messages": CAPITAL, "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                      "schema": {"$ref": "#"}}}},
     "response_format", "no JSON value satisfies this schema"),
    ({"messages": CAPITAL, "logit_bias": {"x": 1}}, "logit_bias", "is not a token id"),
])
def test_bad_requests_get_a_400_naming_the_field_and_the_next_succeeds(client, stream, request_kwargs, param, problem):
    with pytest.raises(openai.BadRequestError) as error:
        result = client.chat.completions.create(model="smollm2",
                                                **{"temperature": 0, "stream": stream, **request_kwargs})
        list(result) if stream else None
    assert (error.value.status_code, error.value.type, error.value.param) == (400, "invalid_request_error", param)
    assert problem in error.value.message
    assert "Paris" in complete(client, CAPITAL, max_tokens=16).choices[0].message.content


def test_nan_is_a_400_naming_the_field(smollm2_service):
    """JSON has no NaN, but Python's and JavaScript's encoders write one; the openai client refuses to send it."""
    body = b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'
    request = urllib.request.Request(f"{smollm2_service.url}/chat/completions", body,
                                     {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=60)
    assert raised.value.code == 400
    error = json.loads(raised.value.read())["error"]
    assert error["param"] == "temperature" and "temperature must be a number >= 0, got nan" in error["message"]


def test_a_prompt_past_the_context_says_so_as_openai_does(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "word " * 600}])
    assert error.value.code == "context_length_exceeded"


def test_replies_and_the_model_list_carry_the_served_name(client):
    assert [m.id for m in client.models.list().data] == ["smollm2-test"]
    assert complete(client, CAPITAL, max_tokens=2).model == "smollm2-test"
    assert {c.model for c in stream(client, CAPITAL, max_tokens=2)[1]} == {"smollm2-test"}
    assert client.embeddings.create(model="smollm2", input="x").model == "smollm2-test"


def test_each_request_ends_with_an_access_line_on_stdout(client, smollm2_service):
    reply = complete(client, [{"role": "user", "content": "Name a color. (access line test)"}], max_tokens=5)
    pattern = (rf"^\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ INFO handler\.access: chat-\d+ chat_completions status=200 "
               rf"prompt_tokens={reply.usage.prompt_tokens} completion_tokens={reply.usage.completion_tokens} "
               rf"ttft=\d+\.\d+s total=\d+\.\d+s$")
    with pytest.raises(openai.BadRequestError):
        complete(client, CAPITAL, max_tokens=0)
    deadline = time.monotonic() + 10
    while not (re.search(pattern, text := smollm2_service.handler_stdout.read_text(), re.MULTILINE)
               and "chat_completions status=400" in text):
        assert time.monotonic() < deadline, f"no access line matching {pattern!r} in:\n{text}"
        time.sleep(0.05)


def test_embeddings_have_the_hidden_size_unit_norm_and_are_deterministic(client):
    texts = ["The capital of France is Paris.", "Cats sleep a lot.", "The capital of France is Paris."]
    vectors = [d.embedding for d in client.embeddings.create(model="smollm2", input=texts).data]
    assert [len(v) for v in vectors] == [SMOLLM2_HIDDEN_SIZE] * 3
    assert all(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-4 for v in vectors)
    assert vectors[0] == pytest.approx(vectors[2], abs=1e-5)
    assert vectors[0] != pytest.approx(vectors[1], abs=1e-2)
    again = client.embeddings.create(model="smollm2", input=texts[:1]).data[0].embedding
    assert again == pytest.approx(vectors[0], abs=1e-5)


def test_bad_embedding_inputs_are_rejected(client, smollm2_service):
    with pytest.raises(openai.BadRequestError, match="vocabulary") as raised:
        client.embeddings.create(model="smollm2", input=[[1, 2, 10**9]])
    assert raised.value.param == "input"
    with pytest.raises(openai.BadRequestError, match=r"input\[1\] is 513 tokens, more than the model's maximum of 512"):
        client.embeddings.create(model="smollm2", input=[[1], [1] * 513])
    assert smollm2_service.call("tokenize", {"input": ["hi"]})["tokens"] == [smollm2_service.call(
        "tokenize", {"input": ["hi", "there"]})["tokens"][0]]


@pytest.mark.parametrize("temperature", [1e-40, 1e-7])
def test_tiny_temperatures_answer_the_greedy_text(client, temperature):
    """1e-40 is a float32 subnormal: dividing logits by it gave NaNs (empty text, or with top_k repeated junk)."""
    greedy = complete(client, CAPITAL, max_tokens=12).choices[0].message.content
    for extra in ({}, {"top_k": 5}, {"top_p": 0.9, "min_p": 0.1}):
        reply = client.chat.completions.create(model="smollm2", messages=CAPITAL, max_tokens=12,
                                               temperature=temperature, extra_body=extra)
        assert reply.choices[0].message.content == greedy, extra
