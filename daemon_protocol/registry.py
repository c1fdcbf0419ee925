"""The handler registry: request names mapped to the functions that serve them."""
import inspect
from collections.abc import Callable
from typing import Any

STREAM = "stream"        # async generator function: one reply chunk per yielded item
COROUTINE = "coroutine"  # async function: one reply with its return value
FUNCTION = "function"    # plain function: one reply; may also return an awaitable or an async iterator

RESERVED_NAMES = frozenset({"cancel"})


class Registry:
    def __init__(self) -> None:
        self._handlers: dict[str, tuple[str, Callable[[Any], Any]]] = {}

    def add(self, name: str, fn: Callable[[Any], Any]) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a handler name must be a non-empty string, got {name!r}")
        if name in RESERVED_NAMES:
            raise ValueError(f"'{name}' is reserved by the protocol and cannot be a handler name")
        if name in self._handlers:
            raise ValueError(f"a handler named '{name}' is already registered")
        self._handlers[name] = (kind_of(fn), fn)

    def get(self, name: str) -> tuple[str, Callable[[Any], Any]] | None:
        return self._handlers.get(name)


def kind_of(fn: Callable[[Any], Any]) -> str:
    if inspect.isasyncgenfunction(fn):
        return STREAM
    if inspect.iscoroutinefunction(fn):
        return COROUTINE
    if not callable(fn):
        raise TypeError(f"a handler must be callable, got {type(fn).__name__}")
    return FUNCTION


default_registry = Registry()


def handler(name: str, registry: Registry = default_registry):
    """Register the decorated function as the handler for requests named `name`.

    The function is called with the request's `data`. Async generators stream one reply chunk per
    yielded item; coroutines and plain functions send their return value as the one reply. Raising
    an exception sends `{"id", "error"}` instead.
    """
    def register(fn):
        registry.add(name, fn)
        return fn
    return register
