"""tokenize + embeddings on an encoder (all-MiniLM-L6-v2) give sentence-transformers' vectors; inputs past
the model's limit are refused unless truncate_prompt_tokens asks to keep their last tokens (vLLM's meaning)."""

import asyncio

import numpy as np
import pytest
from model_packages import minilm_dir_or_skip

from engine import EngineConfig, Worker
from handler.chat import RequestError
from handler.service import EngineUnavailable, Service
from handler.settings import HandlerSettings
from handler.tokenizer import load_tokenizer

LONG_TEXT = "word " * 150 + "the last words " * 50  # 302 tokens with [CLS] and [SEP]; the model takes 256


@pytest.fixture(scope="module")
def minilm():
    path = minilm_dir_or_skip()
    worker = Worker(EngineConfig.from_env(path, {"HFENDPOINT_DEVICE": "cpu"}))
    yield path, Service(worker, load_tokenizer(path), "all-MiniLM-L6-v2")
    worker.shutdown()


def test_tokens_and_vectors_match_sentence_transformers(minilm):
    from sentence_transformers import SentenceTransformer

    path, service = minilm
    texts = ["The capital of France is Paris.", "word " * 200]

    async def embed():
        tokens = (await service.tokenize({"input": texts}))["tokens"]
        return tokens, (await service.embeddings({"input": tokens}))["embeddings"]

    tokens, vectors = asyncio.run(embed())
    reference = SentenceTransformer(path, device="cpu")
    expected_tokens = reference.tokenize(texts)["input_ids"]
    assert tokens == [[t for t in row if t != 0] for row in expected_tokens.tolist()], "[CLS] ... [SEP]"
    assert np.abs(np.array(vectors) - reference.encode(texts, normalize_embeddings=True)).max() < 1e-4


def test_an_input_past_the_limit_is_refused_naming_it_and_the_limit(minilm):
    _, service = minilm
    for call, data in ((service.tokenize, {"input": ["short", LONG_TEXT]}),
                       (service.embeddings, {"input": [[101, 102], [101] + [1000] * 300 + [102]]})):
        with pytest.raises(RequestError, match=r"input\[1\] is \d+ tokens, more than the model's maximum of 256") as e:
            asyncio.run(call(data))
        assert (e.value.status, e.value.param, e.value.code) == (400, "input", "context_length_exceeded")


@pytest.mark.parametrize("keep", [-1, 10])
def test_truncate_prompt_tokens_keeps_the_last_tokens_and_the_special_ones(minilm, keep):
    path, service = minilm
    full = service.tokenizer(LONG_TEXT)["input_ids"]
    kept = 256 if keep == -1 else keep
    expected = full[:1] + full[1:-1][-(kept - 2):] + full[-1:]  # [CLS], the last words, [SEP]
    tokens = asyncio.run(service.tokenize({"input": [LONG_TEXT, "short"], "truncate_prompt_tokens": keep}))["tokens"]
    assert tokens == [expected, service.tokenizer("short")["input_ids"]]


def test_truncate_prompt_tokens_on_token_lists_keeps_the_last_ones_and_says_how_many(minilm):
    _, service = minilm
    ids = [101] + list(range(2000, 2300)) + [102]

    async def embed(data):
        return await service.embeddings(data)

    cut = asyncio.run(embed({"input": [ids, [101, 102]], "truncate_prompt_tokens": 50}))
    assert cut["usage"] == {"prompt_tokens": 52, "total_tokens": 52}
    assert np.allclose(cut["embeddings"][0], asyncio.run(embed({"input": [ids[-50:]]}))["embeddings"][0], atol=1e-6)
    plain = asyncio.run(embed({"input": [[101, 102]]}))
    assert "usage" not in plain, "without truncate_prompt_tokens (the production daemon's case) the reply is as before"


@pytest.mark.parametrize("bad, limit", [(0, "256"), (-2, "256"), (257, "256"), ("10", "the model's limit"),
                                        (True, "the model's limit"), (2.5, "the model's limit")])
def test_a_bad_truncate_prompt_tokens_is_refused(minilm, bad, limit):
    _, service = minilm
    with pytest.raises(RequestError, match=f"truncate_prompt_tokens must be -1 .* from 1 to {limit}, got") as raised:
        asyncio.run(service.tokenize({"input": ["x"], "truncate_prompt_tokens": bad}))
    assert raised.value.param == "truncate_prompt_tokens"


def test_an_embedding_model_refuses_chat(minilm):
    async def chat():
        return [chunk async for chunk in minilm[1].chat_completions({"messages": [{"content": "hi"}]})]

    with pytest.raises(RequestError, match="embedding model"):
        asyncio.run(chat())


def test_a_stopped_engine_answers_503(minilm):
    path, _ = minilm
    worker = Worker(EngineConfig.from_env(path, {"HFENDPOINT_DEVICE": "cpu"}))
    service = Service(worker, load_tokenizer(path), "all-MiniLM-L6-v2")
    worker.shutdown()
    with pytest.raises(EngineUnavailable, match="the engine cannot serve requests: the engine has shut down") as raised:
        asyncio.run(service.embeddings({"input": [[101, 102]]}))
    assert (raised.value.status, raised.value.code) == (503, "engine_unavailable")


def test_a_text_too_long_in_characters_is_refused_before_tokenizing(minilm, monkeypatch):
    """Its tokenizer gives no proven bound (its normalizer may delete text): past the fallback characters per token
    of the model's limit, a text is refused without being tokenized."""
    _, service = minilm
    monkeypatch.setattr("handler.service.embedding_token_ids", lambda *args: pytest.fail("tokenized"))
    with pytest.raises(RequestError, match=r"input\[1\] is 5000000 characters, more than the 256 tokens") as raised:
        asyncio.run(service.tokenize({"input": ["short", "x" * 5_000_000]}))
    assert (raised.value.param, raised.value.code) == ("input", "context_length_exceeded")


def test_truncating_a_long_text_tokenizes_only_its_end(minilm):
    path, service = minilm
    text = "many words here " * 20_000
    full = service.tokenizer(text)["input_ids"]
    expected = full[:1] + full[1:-1][-254:] + full[-1:]
    tokens = asyncio.run(service.tokenize({"input": [text], "truncate_prompt_tokens": -1}))["tokens"]
    assert tokens == [expected]


def test_auto_truncate_truncates_without_being_asked(minilm):
    path, service = minilm
    auto = Service(service.worker, load_tokenizer(path), "all-MiniLM-L6-v2", HandlerSettings(auto_truncate=True))
    tokens = asyncio.run(auto.tokenize({"input": [LONG_TEXT]}))["tokens"]
    assert len(tokens[0]) == 256
    reply = asyncio.run(auto.embeddings({"input": [[101] + [1000] * 300 + [102]]}))
    assert reply["usage"]["prompt_tokens"] == 256 and len(reply["embeddings"]) == 1
