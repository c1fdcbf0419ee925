"""The `score` handler call on tiny random cross-encoders (BERT and RoBERTa classifiers) gives sentence-transformers'
CrossEncoder scores, raw logits with raw_scores, cuts long pairs only when asked, and refuses bad input naming the
field; a cross-encoder says it scores and refuses chat and embeddings."""
import asyncio

import pytest
import torch
from cross_encoders import save_cross_encoder

from engine import EngineConfig, Worker
from front.scoring import rerank_results
from handler.chat import RequestError
from handler.service import Service
from handler.tokenizer import load_tokenizer
from schema.scoring import RerankBody

QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital of france", "the cat sat on the mat", "rome is the capital of italy",
             "berlin is a big old city", "the dog"]


@pytest.fixture(scope="module", params=["bert", "roberta"])
def cross_encoder(request, tmp_path_factory):
    """(service, CrossEncoder, the model's limit in tokens)."""
    from sentence_transformers import CrossEncoder

    path = tmp_path_factory.mktemp(f"cross-encoder-{request.param}")
    save_cross_encoder(path, request.param)
    worker = Worker(EngineConfig.from_env(str(path), {"HFENDPOINT_DEVICE": "cpu"}))
    limit = worker.max_embedding_tokens
    yield Service(worker, load_tokenizer(str(path)), "tiny-ce"), CrossEncoder(str(path), device="cpu",
                                                                           max_length=limit), limit
    worker.shutdown()


def score(service, data):
    return asyncio.run(service.score(data))


def test_scores_and_ranking_equal_cross_encoder(cross_encoder):
    service, reference, _ = cross_encoder
    reply = score(service, {"text_1": QUERY, "text_2": DOCUMENTS})
    expected = reference.predict([(QUERY, document) for document in DOCUMENTS])
    assert reply["scores"] == pytest.approx(expected.tolist(), abs=1e-5)
    assert len(set(round(s, 3) for s in reply["scores"])) == len(DOCUMENTS), "the scores tell documents apart"
    top_three = rerank_results(reply["scores"], DOCUMENTS, RerankBody(QUERY, DOCUMENTS, top_n=3))
    ranking = [result["index"] for result in top_three]
    assert ranking == sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])[:3]
    raw = score(service, {"text_1": [QUERY] * 2, "text_2": DOCUMENTS[:2], "raw_scores": True})["scores"]
    logits = reference.predict([(QUERY, document) for document in DOCUMENTS[:2]], activation_fn=torch.nn.Identity())
    assert raw == pytest.approx(logits.tolist(), abs=1e-5)
    assert reply["usage"]["prompt_tokens"] == sum(len(reference.tokenizer(QUERY, d)["input_ids"]) for d in DOCUMENTS)


def test_a_pair_past_the_limit_is_refused_unless_truncate_cuts_it(cross_encoder):
    service, reference, limit = cross_encoder
    long_document = " ".join(["the big old city"] * limit)
    with pytest.raises(RequestError) as refused:
        score(service, {"text_1": QUERY, "text_2": [long_document]})
    assert refused.value.param == "text_2" and refused.value.code == "context_length_exceeded"
    cut = score(service, {"text_1": QUERY, "text_2": [long_document, DOCUMENTS[0]], "truncate": True})["scores"]
    assert cut == pytest.approx(reference.predict([(QUERY, long_document), (QUERY, DOCUMENTS[0])]).tolist(), abs=1e-5)


@pytest.mark.parametrize("data, param", [
    ({"text_2": ["a"]}, "text_1"),
    ({"text_1": "a"}, "text_2"),
    ({"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1"),
    ({"text_1": "a", "text_2": []}, "text_2"),
    ({"text_1": "a", "text_2": [1]}, "text_2"),
    ({"text_1": "a", "text_2": "b", "raw_scores": "yes"}, "raw_scores"),
])
def test_bad_score_requests_name_the_field(cross_encoder, data, param):
    service, _, _ = cross_encoder
    with pytest.raises(RequestError) as refused:
        score(service, data)
    assert refused.value.param == param


def test_a_cross_encoder_scores_and_does_nothing_else(cross_encoder):
    service, _, _ = cross_encoder
    assert asyncio.run(service.models(None))["capabilities"] == ["score"]

    async def chat():
        return [chunk async for chunk in service.chat_completions({"messages": [{"role": "user", "content": "hi"}]})]
    for call in (chat(), service.embeddings({"input": [[2, 5, 3]]})):
        with pytest.raises(RequestError):
            asyncio.run(call)
