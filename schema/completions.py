"""OpenAI's legacy completion request (/v1/completions, as vLLM serves it)."""
from typing import Annotated, Any

from msgspec import Meta

from .chat import Boolean, Sampling, integer

DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy default
MAX_LOGPROBS = 5  # OpenAI's legacy limit


class CompletionRequest(Sampling, kw_only=True, forbid_unknown_fields=True):
    prompt: Annotated[str | list, Meta(description="a string, a list of strings, a list of token ids or a list of "
                                                   "lists of token ids")]
    echo: Boolean = False
    add_special_tokens: Boolean = True
    logprobs: integer(f"an integer from 0 to {MAX_LOGPROBS}", ge=0, le=MAX_LOGPROBS) | None = None
    best_of: Any = None  # accepted only equal to n (handler/completions.py)
    suffix: Any = None  # refused: insertion needs a model trained for it
    messages: Any = None  # chat fields, refused by name
    tools: Any = None
    response_format: Any = None
