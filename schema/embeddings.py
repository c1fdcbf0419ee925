"""The handler's `tokenize` and `embeddings` calls (texts to token ids, token id lists to vectors: docs/protocol.md),
and OpenAI's /v1/embeddings body that our front turns into them."""
from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from .chat import NonEmptyString, String, described, integer

TruncatePromptTokens = integer("-1 (the model's limit) or an integer from 1 to the model's limit")
TokenIds = Annotated[list[int], Meta(min_length=1, description="a non-empty list of integer token ids")]


class TokenizeRequest(Struct):
    input: Annotated[NonEmptyString | Annotated[list[NonEmptyString], Meta(min_length=1)],
                     Meta(description="a non-empty string or a non-empty list of non-empty strings")]
    truncate_prompt_tokens: TruncatePromptTokens | None = None  # vLLM's: keep the last k tokens of each input

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else self.input


class EmbeddingsRequest(Struct):
    input: Annotated[list[TokenIds], Meta(min_length=1, description="a non-empty list of token id lists")]
    truncate_prompt_tokens: TruncatePromptTokens | None = None


class EmbeddingsBody(Struct):
    """OpenAI's /v1/embeddings body, as the front reads it: strings go through `tokenize` first, token ids
    straight to `embeddings` (front/server.py sorts the input's forms)."""

    input: described(str | list, "a non-empty string, a list of strings, or token ids")
    encoding_format: described(Literal["float", "base64"], "'float' or 'base64'") = "float"
    dimensions: Any = None  # refused: the model's vectors have a fixed size
    model: String | None = None
    user: String | None = None
    truncate_prompt_tokens: TruncatePromptTokens | None = None  # travels to both calls; the handler checks its range
