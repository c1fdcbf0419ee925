"""Request data -> a typed request Struct; msgspec's validation error -> a RequestError naming the field.

Each field declares what it accepts once, as its Meta's description; a value msgspec refuses is reported as
"<where> must be <description>, got <value>", `param` the top-level field (OpenAI's), `where` the path inside it.
A null top-level field is the field left out.
"""
import functools
import re
from typing import TypeVar

import msgspec
from msgspec import inspect

from daemon_protocol.errors import RequestError

T = TypeVar("T")
AT = re.compile(r"^(.*) - at `\$(.*)`$")
SEGMENT = re.compile(r"\.(\w+)|\[(\d+|\.\.\.)\]")
MISSING = re.compile(r"^Object missing required field `(\w+)`$")
UNKNOWN = re.compile(r"^Object contains unknown field `(\w+)`$")
EXPECTED = re.compile(r"^Expected `([^`]+)`(.*)$")
INVALID_ENUM = re.compile(r"^Invalid enum value (.*)$")
NOT_FOUND = object()
TYPE_WORDS = {"float": "a number", "int": "an integer", "str": "a string", "bool": "a boolean", "object": "a map",
              "array": "a list", "null": "null"}


def decode(data, kind: type[T]) -> T:
    """data (a request's map) as `kind`; RequestError naming the first field that does not fit."""
    if not isinstance(data, dict):
        raise RequestError(f"request data must be a map, got {type_name(data)}")
    sent = {name: value for name, value in data.items() if value is not None}
    try:
        return msgspec.convert(sent, kind)
    except msgspec.ValidationError as exc:
        raise field_error(str(exc), sent, kind) from None


def field_error(message: str, data: dict, kind: type) -> RequestError:
    """msgspec's message ("<problem> - at `$.a[0].b`") as ours, naming the field and what it must be."""
    at = AT.match(message)
    problem, path = (at.group(1), at.group(2)) if at else (message, "")
    segments = [name or index for name, index in SEGMENT.findall(path)]
    missing, unknown = MISSING.match(problem), UNKNOWN.match(problem)
    if missing:
        field = [*segments, missing.group(1)]
        return RequestError(f"{where(field)} is required", param=field[0])
    if unknown:
        field, known = [*segments, unknown.group(1)], ", ".join(field_names(kind, segments))
        return RequestError(f"{where(field)} is not supported here; leave it out (supported: {known})", param=field[0])
    expects = description(kind, segments) or expected_words(problem)
    found = value_at(data, segments)
    got = "" if found is NOT_FOUND else f", got {found!r:.100}"
    return RequestError(f"{where(segments)} must be {expects}{got}", param=segments[0] if segments else None)


def where(segments: list[str]) -> str:
    """The path as a client reads it: messages[0].content."""
    return "".join(f"[{s}]" if s.isdigit() or s == "..." else f".{s}" for s in segments).lstrip(".")


def value_at(data, segments: list[str]):
    """The value sent at the path; NOT_FOUND where the path names no one value (a map's values, `[...]`)."""
    for segment in segments:
        if segment == "...":
            return NOT_FOUND
        try:
            data = data[int(segment)] if segment.isdigit() and isinstance(data, list) else data[segment]
        except (KeyError, IndexError, TypeError):
            return NOT_FOUND
    return data


def expected_words(problem: str) -> str:
    """msgspec's own wording, in ours: `float | null` -> a number, `int` >= 1 -> an integer >= 1."""
    expected = EXPECTED.match(problem)
    if expected:
        kinds = [TYPE_WORDS.get(kind, kind) for kind in expected.group(1).split(" | ") if kind != "null"]
        return " or ".join(kinds) + expected.group(2).split(", got")[0]
    return "a valid value" if INVALID_ENUM.match(problem) else problem


def description(kind: type, segments: list[str]) -> str | None:
    """The Meta description of the type at `segments` inside `kind`, if it has one."""
    info = type_info(kind)
    for segment in segments:
        info = step(info, segment)
        if info is None:
            return None
    return described(info)


@functools.cache
def type_info(kind: type):
    return inspect.type_info(kind)


def field_names(kind: type, segments: list[str]) -> list[str]:
    """The fields of the Struct at `segments` inside `kind`."""
    info = type_info(kind)
    for segment in segments:
        info = step(info, segment)
    struct = next(member for member in members(info) if isinstance(member, inspect.StructType))
    return [field.encode_name for field in struct.fields]


def step(info, segment: str):
    """The type one path segment down from info (a Struct's field, a list's item, a map's value)."""
    for member in members(info):
        if isinstance(member, inspect.StructType) and not segment.isdigit():
            field = next((f for f in member.fields if f.encode_name == segment), None)
            if field is not None:
                return field.type
        if isinstance(member, (inspect.ListType, inspect.DictType)) and (segment.isdigit() or segment == "..."):
            return member.item_type if isinstance(member, inspect.ListType) else member.value_type
    return None


def members(info) -> list:
    """info's alternatives (a union's members, nested unions flattened), each without its Meta."""
    if isinstance(info, inspect.Metadata):
        return members(info.type)
    if isinstance(info, inspect.UnionType):
        return [member for alternative in info.types for member in members(alternative)]
    return [info]


def described(info) -> str | None:
    types = info.types if isinstance(info, inspect.UnionType) else (info,)
    for t in types:
        if isinstance(t, inspect.Metadata) and t.extra_json_schema and "description" in t.extra_json_schema:
            return t.extra_json_schema["description"]
    return None


def type_name(value) -> str:
    return "nil" if value is None else type(value).__name__
