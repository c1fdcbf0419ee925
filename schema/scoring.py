"""The handler's `score` call: text pairs for a cross-encoder (docs/scoring.md)."""
from typing import Annotated

from msgspec import Meta, Struct

from .chat import Boolean

Texts = Annotated[str | Annotated[list[str], Meta(min_length=1)],
                  Meta(description="a string or a non-empty list of strings")]


class ScoreRequest(Struct):
    text_1: Texts
    text_2: Texts
    raw_scores: Boolean = False
    truncate: Boolean = False
