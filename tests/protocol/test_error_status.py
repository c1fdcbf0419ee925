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


def test_a_request_error_is_400_and_anything_else_500_a_value_error_included(handler):
    handler.send({"id": 3, "name": "chat_completions", "data": None}, {"id": 4, "name": "fail", "data": "x"},
                 {"id": 6, "name": "chat_completions", "data": {"model": "value_error", "messages": [{}]}})
    replies = {reply["id"]: reply for reply in handler.read_count(3)}
    assert replies[3] == {"id": 3, "error": "request data must be a map, got nil", "status": 400}
    assert replies[4] == {"id": 4, "error": "RuntimeError: failing as asked: x", "status": 500}
    assert replies[6] == {"id": 6, "error": "ValueError: echo worker has a bug", "status": 500}
    assert "Traceback" in handler.stderr(), "a 500 is our bug: its traceback goes to the log"


@pytest.mark.parametrize("status, expected", [(418, 418), (503, 503), (200, 500), ("400", 500), (True, 500)])
def test_a_reply_error_gets_its_status_when_it_is_an_http_error_status(handler, status, expected):
    handler.send({"id": 5, "name": "reply_error", "data": status})
    [reply] = handler.read_count(1)
    assert reply["status"] == expected
    assert reply["error"] == "short and stout" if expected != 500 else reply["error"].startswith("TypeError: ")


@pytest.mark.parametrize("status", [418, 400])
def test_any_other_exception_is_a_500_whatever_status_attribute_it_has(handler, status):
    handler.send({"id": 7, "name": "teapot", "data": status})
    [reply] = handler.read_count(1)
    assert reply == {"id": 7, "error": "Teapot: short and stout", "status": 500}


def test_the_exported_request_error_is_a_reply_error_and_no_value_error():
    error = daemon_protocol.RequestError("too long", param="input", status=413, code="too_long")
    assert isinstance(error, daemon_protocol.ReplyError) and not isinstance(error, ValueError)
    assert error_fields(error) == {"status": 413, "param": "input", "code": "too_long"}
    from handler.chat import RequestError
    assert RequestError is daemon_protocol.RequestError
