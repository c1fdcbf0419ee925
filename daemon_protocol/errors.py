"""Error replies with an HTTP status (our extension of protocol.md section 4; docs/errors.md).

A reply `{"id", "error"}` may carry extra keys: "status" (the HTTP status a front daemon should answer
with), and "param" and "code" (OpenAI's error fields) when they are known. The production daemon ignores
them and answers 500; our front answers with them.

Only a ReplyError declares a status: a handler raises RequestError where it finds that the client sent
something it cannot serve. Any other exception, a ValueError included, is our bug: a 500, its traceback logged.
"""

DEFAULT_STATUS = 500  # what a reply without "status" means, and what an unexpected exception gets


class ReplyError(Exception):
    """A failure whose raiser knows the HTTP status it deserves (400-599), and maybe OpenAI's param and code."""

    def __init__(self, message: str, status: int, param: str | None = None, code: str | None = None):
        if type(status) is not int or not 400 <= status <= 599:
            raise TypeError(f"an error reply's status is an HTTP error status (400-599), got {status!r}")
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


class RequestError(ReplyError):
    """The request cannot be served as sent: the message says which field and why.

    status is the HTTP status for it (400 unless told: 413 for something too large, 503 for a service that
    cannot take requests now); param names the request field at fault; code is a short machine-readable
    reason (OpenAI's `code`, for example "context_length_exceeded")."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message, status, param, code)


def error_status(exc: BaseException) -> int | None:
    """The status a ReplyError declares; None for anything else: an unexpected failure."""
    return exc.status if isinstance(exc, ReplyError) else None


def error_message(exc: BaseException) -> str:
    """A declared error's message is the reply as it stands; anything else is named by its type so that a
    bare KeyError('x') still reads as an error."""
    if error_status(exc) is not None:
        return str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def error_fields(exc: BaseException) -> dict:
    """The extra keys of the error reply for `exc`: "status" always, "param" and "code" when set."""
    fields = {"status": error_status(exc) or DEFAULT_STATUS}
    for key in ("param", "code"):
        value = getattr(exc, key, None) if isinstance(exc, ReplyError) else None
        if isinstance(value, str) and value:
            fields[key] = value
    return fields
