"""vLLM's POST /v1/score and /v1/rerank (Jina's and Cohere's rerank shape) and TEI's POST /rerank, mapped onto the
handler's `score` call (docs/scoring.md), and its scores back into each API's reply.

The handler scores pairs (`text_1`, `text_2`); a rerank's query is text_1 and its documents text_2. A handler
error naming text_1 or text_2 is renamed to the route's own field. Bad input raises ScoringInputError naming
the field.
"""

RERANK_PARAMS = {"text_1": "query", "text_2": "documents"}
TEI_PARAMS = {"text_1": "query", "text_2": "texts"}
# The fields each route reads; any other is refused, naming it, rather than silently ignored.
SCORE_FIELDS = frozenset({"model", "user", "text_1", "text_2", "truncate", "truncate_prompt_tokens"})
RERANK_FIELDS = frozenset({"model", "user", "query", "documents", "top_n", "return_documents", "truncate",
                           "raw_scores", "truncate_prompt_tokens"})
TEI_FIELDS = frozenset({"query", "texts", "raw_scores", "return_text", "truncate"})


class ScoringInputError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def score_call(body: dict) -> dict:
    """vLLM's /v1/score: text_1 and text_2, each a string or a list of strings (the handler checks them)."""
    refuse_unknown(body, SCORE_FIELDS)
    refuse_vllm_truncation(body)
    for name in ("text_1", "text_2"):
        if body.get(name) is None:
            raise ScoringInputError(f"'{name}' is required: a string or a list of strings", name)
    return {"text_1": body["text_1"], "text_2": body["text_2"], **flags(body, "truncate")}


def rerank_call(body: dict, documents_field: str) -> tuple[dict, list[str]]:
    """A rerank request (vLLM's `documents`, TEI's `texts`): the handler call and the documents' texts. A vLLM
    document may be a string or an object with `text` (Jina's and Cohere's form)."""
    refuse_unknown(body, RERANK_FIELDS if documents_field == "documents" else TEI_FIELDS)
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise ScoringInputError("'query' must be a non-empty string", "query")
    documents = body.get(documents_field)
    if not isinstance(documents, list) or not documents:
        raise ScoringInputError(f"'{documents_field}' must be a non-empty list of strings", documents_field)
    texts = []
    for i, document in enumerate(documents):
        text = document.get("text") if isinstance(document, dict) and documents_field == "documents" else document
        if not isinstance(text, str):
            raise ScoringInputError(f"'{documents_field}[{i}]' must be a string"
                                    + (" or an object with a string 'text'" if documents_field == "documents" else ""),
                                    documents_field)
        texts.append(text)
    return {"text_1": query, "text_2": texts, **flags(body, "truncate", "raw_scores")}, texts


def refuse_unknown(body: dict, known: frozenset[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise ScoringInputError(f"'{unknown[0]}' is not supported on this route; it reads {', '.join(sorted(known))}",
                                unknown[0])


def flags(body: dict, *names: str) -> dict:
    """The boolean options the request sets, checked."""
    found = {}
    for name in names:
        if body.get(name) is not None:
            if not isinstance(body[name], bool):
                raise ScoringInputError(f"'{name}' must be a boolean", name)
            found[name] = body[name]
    return found


def refuse_vllm_truncation(body: dict) -> None:
    if body.get("truncate_prompt_tokens") is not None:
        raise ScoringInputError("'truncate_prompt_tokens' is not supported here: send \"truncate\": true to cut "
                                "pairs longer than the model takes", "truncate_prompt_tokens")


def rerank_options(body: dict, num_documents: int) -> tuple[int, bool]:
    """vLLM's top_n (default: every document) and return_documents (default true)."""
    refuse_vllm_truncation(body)
    top_n = body.get("top_n")
    if top_n is not None and (type(top_n) is not int or top_n < 1):
        raise ScoringInputError("'top_n' must be a positive integer", "top_n")
    return_documents = flags(body, "return_documents").get("return_documents", True)
    return min(top_n or num_documents, num_documents), return_documents


def ranked(scores: list[float]) -> list[int]:
    """Indices by decreasing score (ties keep their order)."""
    return sorted(range(len(scores)), key=lambda i: -scores[i])


def score_data(scores: list[float]) -> list[dict]:
    return [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)]


def rerank_results(scores: list[float], texts: list[str], top_n: int, return_documents: bool) -> list[dict]:
    return [{"index": i, "relevance_score": scores[i], **({"document": {"text": texts[i]}} if return_documents else {})}
            for i in ranked(scores)[:top_n]]


def tei_results(scores: list[float], texts: list[str], return_text: bool) -> list[dict]:
    return [{"index": i, "score": scores[i], **({"text": texts[i]} if return_text else {})} for i in ranked(scores)]


def checked_scores(reply, count: int) -> list[float]:
    """The handler's `scores`, one per pair; ValueError when the reply lacks them."""
    scores = reply.get("scores") if isinstance(reply, dict) else None
    if not isinstance(scores, list) or len(scores) != count:
        raise ValueError(f"the handler's score reply has no 'scores' list for {count} pair(s)")
    return scores
