"""Scoring text pairs with a cross-encoder: the handler's `score` call (docs/scoring.md), and the bodies of the
front's routes onto it (vLLM's /v1/score and /v1/rerank, TEI's /rerank), which refuse a field they do not read."""
from typing import Annotated, Any

from msgspec import Meta, Struct

from .chat import Boolean, NonEmptyString, String, described, integer

Texts = Annotated[str | Annotated[list[str], Meta(min_length=1)],
                  Meta(description="a string or a non-empty list of strings")]


class ScoreRequest(Struct):
    """The handler's `score` call."""

    text_1: Texts
    text_2: Texts
    raw_scores: Boolean = False
    truncate: Boolean = False


class Document(Struct):
    text: String


class ScoreBody(Struct, forbid_unknown_fields=True):
    """vLLM's /v1/score."""

    text_1: Texts
    text_2: Texts
    model: String | None = None
    user: String | None = None
    truncate: Boolean = False
    truncate_prompt_tokens: Any = None  # refused: `truncate` cuts instead


class RerankBody(Struct, forbid_unknown_fields=True):
    """vLLM's /v1/rerank (Jina's and Cohere's shape): a document is a string or {"text": ...}."""

    query: NonEmptyString
    documents: Annotated[list[described(str | Document, 'a string or an object with a string "text"')],
                         Meta(min_length=1, description="a non-empty list of documents")]
    model: String | None = None
    user: String | None = None
    top_n: integer("an integer >= 1", ge=1) | None = None
    return_documents: Boolean = True
    raw_scores: Boolean = False
    truncate: Boolean = False
    truncate_prompt_tokens: Any = None


class TeiRerankBody(Struct, forbid_unknown_fields=True):
    """TEI's /rerank."""

    query: NonEmptyString
    texts: Annotated[list[described(str, "a string")], Meta(min_length=1, description="a non-empty list of strings")]
    raw_scores: Boolean = False
    return_text: Boolean = False
    truncate: Boolean = False
