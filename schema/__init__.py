"""The typed requests the front and the handler both read: each field's type, range, default and the error a
client gets for it (a RequestError naming the field, with OpenAI's `param`), declared once.

msgspec rather than pydantic: its Structs are fast to build and check (one pass in C, no model objects per
field), which matters on the request path; its decoding is strict (no "1" for 1, no true for 1), as our 400s
promise; and it also decodes MessagePack, the handler's wire. This package imports nothing from the handler,
the engine or the front (no torch), so that both ends of the wire can use it.
"""
from .chat import ChatCompletionRequest, Message, StreamFields
from .completions import CompletionRequest
from .decode import decode, type_name
from .scoring import ScoreRequest

__all__ = ["ChatCompletionRequest", "CompletionRequest", "Message", "ScoreRequest", "StreamFields", "decode",
           "type_name"]
