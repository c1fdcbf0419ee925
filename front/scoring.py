"""vLLM's POST /v1/score and /v1/rerank (Jina's and Cohere's rerank shape) and TEI's POST /rerank, mapped onto the
handler's `score` call (docs/scoring.md), and its scores back into each API's reply.

Each route's body is checked by its Struct in schema/scoring.py (a RequestError naming the field); the handler
scores pairs (`text_1`, `text_2`): a rerank's query is text_1 and its documents text_2, and a handler error naming
text_1 or text_2 is renamed to the route's own field.
"""
from daemon_protocol import RequestError
from schema import decode
from schema.scoring import RerankBody, ScoreBody, TeiRerankBody

RERANK_PARAMS = {"text_1": "query", "text_2": "documents"}
TEI_PARAMS = {"text_1": "query", "text_2": "texts"}


def score_call(body: dict) -> dict:
    """vLLM's /v1/score: text_1 and text_2, each a string or a list of strings."""
    score = decode(body, ScoreBody)
    refuse_vllm_truncation(score)
    return {"text_1": score.text_1, "text_2": score.text_2, "truncate": score.truncate}


def rerank_call(body: dict) -> tuple[dict, list[str], RerankBody]:
    """vLLM's rerank: the handler call, the documents' texts and the request."""
    rerank = decode(body, RerankBody)
    refuse_vllm_truncation(rerank)
    texts = [document if isinstance(document, str) else document.text for document in rerank.documents]
    return {"text_1": rerank.query, "text_2": texts, "truncate": rerank.truncate,
            "raw_scores": rerank.raw_scores}, texts, rerank


def tei_rerank_call(body: dict) -> tuple[dict, TeiRerankBody]:
    rerank = decode(body, TeiRerankBody)
    return {"text_1": rerank.query, "text_2": rerank.texts, "truncate": rerank.truncate,
            "raw_scores": rerank.raw_scores}, rerank


def refuse_vllm_truncation(body: ScoreBody | RerankBody) -> None:
    if body.truncate_prompt_tokens is not None:
        raise RequestError("truncate_prompt_tokens is not supported here: send \"truncate\": true to cut pairs "
                           "longer than the model takes", param="truncate_prompt_tokens")


def ranked(scores: list[float]) -> list[int]:
    """Indices by decreasing score (ties keep their order)."""
    return sorted(range(len(scores)), key=lambda i: -scores[i])


def score_data(scores: list[float]) -> list[dict]:
    return [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)]


def rerank_results(scores: list[float], texts: list[str], rerank: RerankBody) -> list[dict]:
    """By decreasing relevance, vLLM's top_n of them (default: every document), with the document's text unless
    return_documents is false."""
    return [{"index": i, "relevance_score": scores[i],
             **({"document": {"text": texts[i]}} if rerank.return_documents else {})}
            for i in ranked(scores)[:rerank.top_n or len(texts)]]


def tei_results(scores: list[float], texts: list[str], return_text: bool) -> list[dict]:
    return [{"index": i, "score": scores[i], **({"text": texts[i]} if return_text else {})} for i in ranked(scores)]


def checked_scores(reply, count: int) -> list[float]:
    """The handler's `scores`, one per pair; ValueError when the reply lacks them."""
    scores = reply.get("scores") if isinstance(reply, dict) else None
    if not isinstance(scores, list) or len(scores) != count:
        raise ValueError(f"the handler's score reply has no 'scores' list for {count} pair(s)")
    return scores
