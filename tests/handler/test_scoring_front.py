"""/v1/score, /v1/rerank and TEI's /rerank through our front on a tiny random cross-encoder behind
`python -m handler`: sentence-transformers' CrossEncoder scores and the order they imply, each API's reply and
error shapes, errors naming the route's own fields, and /v1/models saying the model scores."""
import json
import urllib.error
import urllib.request

import pytest

pytestmark = pytest.mark.slow  # a handler process behind our front

QUERY = "what is the capital of france"
DOCUMENTS = ["the cat sat on the mat", "paris is the capital of france", "rome is the capital of italy",
             "berlin is a big old city"]


class Reply:
    def __init__(self, status_code: int, body: bytes):
        self.status_code, self._body = status_code, body

    def json(self):
        return json.loads(self._body)


class Http:
    """Just enough of an HTTP client: JSON in, status and JSON out."""

    def __init__(self, base: str):
        self.base = base

    def request(self, path: str, body: dict | None = None) -> Reply:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return Reply(response.status, response.read())
        except urllib.error.HTTPError as error:
            return Reply(error.code, error.read())

    def post(self, path: str, json: dict) -> Reply:
        return self.request(path, json)

    def get(self, path: str) -> Reply:
        return self.request(path)


@pytest.fixture(scope="module")
def http(cross_encoder_service):
    return Http(cross_encoder_service.url.removesuffix("/v1"))


@pytest.fixture(scope="module")
def expected(cross_encoder_service):
    """CrossEncoder's scores of (QUERY, each document) and its raw logits."""
    import torch
    from sentence_transformers import CrossEncoder

    reference = CrossEncoder(str(cross_encoder_service.path), device="cpu", max_length=64)
    pairs = [(QUERY, document) for document in DOCUMENTS]
    return reference.predict(pairs).tolist(), reference.predict(pairs, activation_fn=torch.nn.Identity()).tolist()


def by_score(scores):
    return sorted(range(len(scores)), key=lambda i: -scores[i])


def test_score_gives_cross_encoder_scores(http, expected):
    reply = http.post("/v1/score", json={"model": "tiny-ce", "text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert [item["index"] for item in reply["data"]] == [0, 1, 2, 3] and reply["data"][0]["object"] == "score"
    assert [item["score"] for item in reply["data"]] == pytest.approx(expected[0], abs=1e-5)
    assert reply["usage"]["prompt_tokens"] > 0


def test_rerank_orders_documents_by_cross_encoder_scores(http, expected):
    documents = [DOCUMENTS[0], *({"text": text} for text in DOCUMENTS[1:])]  # Jina's and Cohere's objects too
    reply = http.post("/v1/rerank", json={"query": QUERY, "documents": documents, "top_n": 3}).json()
    order = by_score(expected[0])[:3]
    assert [result["index"] for result in reply["results"]] == order
    assert [result["relevance_score"] for result in reply["results"]] == pytest.approx([expected[0][i] for i in order],
                                                                                      abs=1e-5)
    assert [result["document"]["text"] for result in reply["results"]] == [DOCUMENTS[i] for i in order]


def test_tei_rerank_gives_raw_scores_and_texts(http, expected):
    reply = http.post("/rerank", json={"query": QUERY, "texts": DOCUMENTS, "raw_scores": True,
                                       "return_text": True}).json()
    order = by_score(expected[1])
    assert [item["index"] for item in reply] == order
    assert [item["score"] for item in reply] == pytest.approx([expected[1][i] for i in order], abs=1e-5)
    assert [item["text"] for item in reply] == [DOCUMENTS[i] for i in order]
    plain = http.post("/rerank", json={"query": QUERY, "texts": DOCUMENTS}).json()
    assert "text" not in plain[0] and plain[0]["score"] == pytest.approx(max(expected[0]), abs=1e-5)


def test_errors_name_each_routes_own_fields(http):
    missing = http.post("/v1/rerank", json={"documents": DOCUMENTS})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "query"
    too_long = http.post("/v1/rerank", json={"query": QUERY, "documents": ["the big old city " * 40]})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "documents"
    mismatched = http.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["a", "b", "c"]})
    assert mismatched.status_code == 400 and mismatched.json()["error"]["param"] == "text_1"
    tei = http.post("/rerank", json={"query": QUERY})
    assert tei.status_code == 422 and tei.json()["error_type"] == "validation" and "texts" in tei.json()["error"]
    unknown = http.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS, "rank_fields": ["x"]})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "rank_fields"
    direction = http.post("/rerank", json={"query": QUERY, "texts": DOCUMENTS, "truncation_direction": "Left"})
    assert direction.status_code == 422 and "truncation_direction" in direction.json()["error"]
    generate = http.post("/v1/completions", json={"prompt": "the cat"})
    assert generate.status_code == 400 and "completions" in generate.json()["error"]["message"]


def test_models_say_the_model_scores(http):
    assert http.get("/v1/models").json()["data"][0]["capabilities"] == ["score"]
