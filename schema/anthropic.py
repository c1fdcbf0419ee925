"""Anthropic's Messages request (POST /v1/messages), which the front turns into a chat request: its top-level fields,
typed as the chat fields they become. Its content blocks, tools and tool_choice are Anthropic's own shapes, read by
front/anthropic.py."""
from typing import Any

from msgspec import Struct

from .chat import Boolean, MaxTokens, NonEmptyString, String, Temperature, TopK, TopP, described


class Metadata(Struct):
    user_id: String | None = None


class MessagesRequest(Struct, forbid_unknown_fields=True):
    model: String
    max_tokens: MaxTokens
    messages: Any  # front/anthropic.py's chat_messages
    system: Any = None  # a string or text blocks
    stop_sequences: described(list[NonEmptyString], "a list of non-empty strings") | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    metadata: described(Metadata, "an object") | None = None  # accepted and checked; nothing in it changes the reply
    stream: Boolean = False
    tools: Any = None
    tool_choice: Any = None
