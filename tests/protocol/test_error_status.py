"""The status extension of error replies (docs/errors.md): the exact bytes a handler sends for each kind of
failure, and what the production daemon sees (the same `error` string; extra keys it ignores)."""
import msgpack
import pytest

import daemon_protocol
from daemon_protocol.errors import error_fields


def reply_bytes(handler, request: dict) -> bytes:
    handler.send(request)
    [reply] = handler.read_count(1)
    return msgpack.packb(reply)


def test_a_request_error_carries_its_status_param_and_code(handler):
    data = {"message": "temperature must be a number, got 'hot'", "param": "temperature", "status": 422,
            "code": "bad_type"}
    assert reply_bytes(handler, {"id": 1, "name": "refuse", "data": data}) == msgpack.packb(
        {"id": 1, "error": "temperature must be a number, got 'hot'", "status": 422, "param": "temperature",
         "code": "bad_type"})


def test_status_400_by_default_and_no_param_or_code_keys_when_unset(handler):
    assert reply_bytes(handler, {"id": 2, "name": "refuse", "data": {"message": "no"}}) == msgpack.packb(
        {"id": 2, "error": "no", "status": 400})


def test_a_value_error_is_400_and_anything_else_500(handler):
    handler.send({"id": 3, "name": "chat_completions", "data": None}, {"id": 4, "name": "fail", "data": "x"})
    replies = {reply["id"]: reply for reply in handler.read_count(2)}
    assert replies[3] == {"id": 3, "error": "'messages' must be a non-empty list", "status": 400}
    assert replies[4] == {"id": 4, "error": "RuntimeError: failing as asked: x", "status": 500}


@pytest.mark.parametrize("status, expected", [(418, 418), (503, 503), (200, 500), ("400", 500), (True, 500)])
def test_any_exception_with_an_error_status_attribute_gets_it(handler, status, expected):
    handler.send({"id": 5, "name": "teapot", "data": status})
    [reply] = handler.read_count(1)
    assert reply["status"] == expected
    assert reply["error"] == ("short and stout" if expected != 500 else "Teapot: short and stout")


def test_the_exported_request_error_is_a_value_error():
    error = daemon_protocol.RequestError("too long", param="input", status=413, code="too_long")
    assert isinstance(error, ValueError)
    assert error_fields(error) == {"status": 413, "param": "input", "code": "too_long"}
    from handler.chat import RequestError
    assert RequestError is daemon_protocol.RequestError
