"""The handler's `tokenize` and `embeddings` calls: texts to token ids, token id lists to vectors (docs/protocol.md)."""
from typing import Annotated

from msgspec import Meta, Struct

from .chat import NonEmptyString, integer

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
