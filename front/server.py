"""An OpenAI-compatible HTTP front that drives a handler process like the production daemon does.

    python -m front [--host 127.0.0.1] [--port 8080] [--api-key KEY] -- HANDLER_CMD...

Routes: GET / and /health, GET /metrics, GET /v1/models, POST /v1/chat/completions and POST /v1/completions
(SSE when "stream": true), POST /v1/embeddings, POST /v1/responses, POST /v1/messages (Anthropic's Messages API,
front/anthropic.py), POST /v1/score, POST /v1/rerank and TEI's POST /rerank (cross-encoders). The whole chat request
body is forwarded to the handler as `data`; a client that disconnects mid-stream makes the front send `cancel`.
Port 0 picks a free port; the address is logged as "listening on http://HOST:PORT".

Unlike the production daemon, it answers a handler's error reply with the HTTP status the reply carries
(docs/errors.md), names the model as the handler does (its `models` reply), and /health answers 503 until
the handler has loaded its model and whenever it stops answering (front/handler_health.py).
On SIGINT/SIGTERM it stops accepting connections, lets the responses in flight finish (the handler sees EOF and
drains), then exits.
"""
import argparse
import asyncio
import base64
import hmac
import json
import logging
import os
import re
import signal
import socket
import struct
import sys
import time
import uuid

from aiohttp import web

from daemon_protocol import RequestError
from daemon_protocol.log import error
from schema import StreamFields, decode
from schema.embeddings import EmbeddingsBody

from . import anthropic
from .completions import CompletionReply, stream_choice as completion_choice
from .handler_connection import CHAT_QUEUE_CHUNKS, HandlerConnection, HandlerError, HandlerGone, UnencodableRequest
from .handler_health import HEALTH_TIMEOUT_S, HandlerHealth
from .metrics import CONTENT_TYPE, ServingMetrics
from .openai_chat import ChatReply, stream_choice
from .scoring import (
    RERANK_PARAMS,
    TEI_PARAMS,
    checked_scores,
    rerank_call,
    rerank_results,
    score_call,
    score_data,
    tei_rerank_call,
    tei_results,
)
from .settings import CHUNK_TIMEOUT_S, IDLE_TIMEOUT_S, FrontSettings

MAX_BODY_BYTES = 32 * 1024 * 1024
MAX_TOKEN_ID = (1 << 32) - 1
DEFAULT_MODEL_NAME = "hfendpoint"  # for a handler that does not answer `models` with an id
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
UNAUTHENTICATED_PATHS = ("/", "/health")  # probes: everything else needs the key, when one is set

CONNECTION = web.AppKey("connection", HandlerConnection)
SETTINGS = web.AppKey("settings", FrontSettings)
STARTED = web.AppKey("started", int)
HEALTH = web.AppKey("health", HandlerHealth)
METRICS = web.AppKey("metrics", ServingMetrics)
log = logging.getLogger("front")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object: type invalid_request_error for a client's mistake (4xx), api_error otherwise."""
    kind = "invalid_request_error" if status < 500 else "api_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> web.Response:
    return web.json_response(error_body(status, message, param, code), status=status)


@web.middleware
async def count_requests(request: web.Request, handler):
    """Every answer counted by route and status in /metrics (the outermost middleware: it sees the error
    responses too)."""
    started = time.perf_counter()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except asyncio.CancelledError:
        status = 499  # the client went away first
        raise
    finally:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "other"
        request.app[METRICS].observe_request(route, status, time.perf_counter() - started)


@web.middleware
async def openai_errors(request: web.Request, handler):
    """Every failure leaves as OpenAI-shaped JSON; the API key (a bearer token, or Anthropic's x-api-key) is
    checked on every route but health (and /metrics when the operator opened it)."""
    settings = request.app[SETTINGS]
    key = settings.api_key
    if key and needs_key(request.path, settings.open_metrics) and not key_sent(request, key):
        return error_response(401, "invalid or missing API key: send 'Authorization: Bearer <key>' or "
                                   "'x-api-key: <key>'", code="invalid_api_key")
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc.status, exc.message, exc.param, exc.code)
    except RequestError as exc:  # the front's own reading of the body, by the schema (schema/)
        return error_response(exc.status, str(exc), exc.param, exc.code)
    except UnencodableRequest as exc:
        return error_response(400, str(exc), exc.param)
    except HandlerError as exc:
        return error_response(exc.status, str(exc), exc.param, exc.code)
    except HandlerGone as exc:
        return error_response(503, f"{exc}; the endpoint is shutting down", code="handler_unavailable")
    except TimeoutError as exc:
        return error_response(500, str(exc), code="timeout")
    except web.HTTPException as exc:
        if exc.status == 413:
            return error_response(413, f"request body is larger than {MAX_BODY_BYTES} bytes", code="request_too_large")
        return error_response(exc.status, exc.reason)


def needs_key(path: str, open_metrics: bool) -> bool:
    return path not in UNAUTHENTICATED_PATHS and not (open_metrics and path == "/metrics")


def key_sent(request: web.Request, key: str) -> bool:
    """The key as a bearer token or in Anthropic's `x-api-key` header."""
    return (bearer_matches(request.headers.get("Authorization", ""), key)
            or hmac.compare_digest(request.headers.get("x-api-key", "").encode("utf-8", "surrogateescape"),
                                   key.encode()))


def bearer_matches(authorization: str, key: str) -> bool:
    """`Bearer KEY`, the scheme in any case (RFC 7235); the key compared in constant time. A header that is not
    UTF-8 (its bytes come as surrogate escapes) matches no key."""
    scheme, _, credentials = authorization.partition(" ")
    given = credentials.strip().encode("utf-8", "surrogateescape")
    return scheme.lower() == "bearer" and hmac.compare_digest(given, key.encode())


async def read_body(request: web.Request) -> bytes:
    """The request body, refused (408) when the client stops sending it for the idle timeout."""
    timeout = request.app[SETTINGS].idle_timeout
    body = bytearray()
    while True:
        try:
            async with asyncio.timeout(timeout):
                piece = await request.content.readany()
        except TimeoutError:
            raise ApiError(408, f"the request body stopped arriving for {timeout:g} s", code="timeout") from None
        if not piece:
            return bytes(body)
        body += piece
        if len(body) > MAX_BODY_BYTES:
            raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY_BYTES, actual_size=len(body))


async def read_json_object(request: web.Request) -> dict:
    """The body as a JSON object; anything json cannot parse (bad syntax or encoding, nesting deeper than
    Python's recursion limit) is a 400."""
    raw = await read_body(request)
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply to parse") from None
    except ValueError as exc:  # UnicodeDecodeError included
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


def model_name(request: web.Request) -> str:
    """The served model's name, as the handler gives it (HFENDPOINT_MODEL_NAME, MODEL_ID or the model's own
    name): every reply carries it whatever the request's `model` said, as OpenAI's servers do."""
    return request.app[HEALTH].model_name or DEFAULT_MODEL_NAME


def optional_type(body: dict, key: str, types, what: str) -> None:
    if body.get(key) is not None and not isinstance(body[key], types):
        raise ApiError(400, f"'{key}' must be {what}", param=key)


# Health, metrics and models
async def health(request: web.Request) -> web.Response:
    """200 while the handler serves; 503 (saying why) while it loads, after it exits, or while it does not
    answer its probes."""
    problem = request.app[HEALTH].problem()
    return web.Response(text="ok") if problem is None else web.Response(status=503, text=problem)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].text(), headers={"Content-Type": CONTENT_TYPE})


async def list_models(request: web.Request) -> web.Response:
    health = request.app[HEALTH]
    if not health.ready:
        raise ApiError(503, f"{health.problem()}; try again shortly", code="handler_unavailable")
    capabilities = {"capabilities": health.capabilities} if health.capabilities is not None else {}
    return web.json_response({"object": "list", "data": [
        {"id": model_name(request), "object": "model", "created": request.app[STARTED],
         "owned_by": "hfendpoint", **capabilities}]})


# Chat
def stream_fields(body: dict) -> StreamFields:
    """What the front reads of a chat or completions body before forwarding it (whether to stream, and with usage),
    checked by the handler's own schema: a bad value is the 400 the handler would answer, in the same words and
    `param`. The rest of the body is the handler's to check."""
    return decode(body, StreamFields)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await read_json_object(request)
    fields = stream_fields(body)
    if fields.stream:
        return await stream_chat(request, body, fields)
    reply = await complete_chat(request, body)
    return web.json_response({
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": model_name(request), "choices": reply.choices(),
        **({"usage": reply.usage} if reply.usage else {})})


async def open_chat(request: web.Request, data: dict, name: str = "chat_completions"):
    """A streaming handler call: chat_completions, or completions (same chunk contract)."""
    connection = request.app[CONNECTION]
    stream = connection.open(name, data, CHAT_QUEUE_CHUNKS)
    await connection.drain()
    return stream


async def chat_chunks(request: web.Request, stream):
    """The payloads of one chat request, up to the one with a finish_reason; its time to first token and
    time per output token go to /metrics."""
    started = time.perf_counter()
    first_chunk_s = None
    while True:
        payload = await stream.next(request.app[SETTINGS].chunk_timeout)
        if not isinstance(payload, dict):
            raise HandlerError(f"the handler sent a chat chunk that is not a map: {payload!r:.100}")
        if first_chunk_s is None:
            first_chunk_s = time.perf_counter() - started
        if payload.get("finish_reason") is not None:
            stream.finished = True
            usage = payload.get("usage") if isinstance(payload.get("usage"), dict) else {}
            request.app[METRICS].observe_chat(first_chunk_s, time.perf_counter() - started,
                                              usage.get("completion_tokens"))
        yield payload
        if stream.finished:
            return


async def complete_chat(request: web.Request, data: dict, name: str = "chat_completions", reply=None):
    """Every chunk gathered into its choice (content concatenated); the last finish_reason and usage. reply: a
    CompletionReply for name "completions"."""
    stream = await open_chat(request, data, name)
    reply = reply or ChatReply()
    try:
        async for payload in chat_chunks(request, stream):
            reply.add(payload)
    finally:
        stream.close()
    return reply


compact_json = json.JSONEncoder(separators=(",", ":")).encode


def sse(obj) -> bytes:
    return b"data: " + compact_json(obj).encode() + b"\n\n"


async def stream_chat(request: web.Request, body: dict, fields: StreamFields,
                      name: str = "chat_completions") -> web.StreamResponse:
    """SSE: one chat.completion.chunk (for name "completions", text_completion) per reply chunk. The response
    starts with the first chunk, so a request the handler rejects at once still gets a plain HTTP error with the
    reply's status."""
    stream = await open_chat(request, body, name)
    include_usage = fields.stream_options is not None and fields.stream_options.include_usage is True
    chat = name == "chat_completions"
    base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time())}
    response = None
    usage = None
    started = set()  # choices that have had their first delta
    events = []  # written together once no more chunks have arrived: one write for a backlog, not one per chunk
    try:
        chunks = chat_chunks(request, stream)
        try:
            async for payload in chunks:
                choice = stream_choice(payload, started) if chat else completion_choice(payload)
                if response is None:
                    base["model"] = model_name(request)
                    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                           "Cache-Control": "no-cache"})
                    await response.prepare(request)
                    framing = sse_framing(base, include_usage)
                usage = payload.get("usage") or usage
                events += (framing[0], compact_json(choice), framing[1])
                if stream.queue.empty():
                    await response.write("".join(events).encode())
                    events.clear()
            if events:
                await response.write("".join(events).encode())
        except (HandlerError, HandlerGone, TimeoutError) as exc:
            if response is None:
                raise
            status, param, code = ((exc.status, exc.param, exc.code) if isinstance(exc, HandlerError)
                                   else (500, None, None))
            events.append("event: error\n")
            await response.write("".join(events).encode() + sse(error_body(status, str(exc), param, code)))
            return response
        if include_usage:
            await response.write(sse({**base, "choices": [], "usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
    except ConnectionResetError:  # the client went away
        return response
    finally:
        stream.close()  # sends `cancel` when the client went away before the last chunk


def sse_framing(base: dict, include_usage: bool) -> tuple[str, str]:
    """The text of a stream's SSE events before and after their one choice (the other keys, the same in every event,
    encoded once), as sse({**base, "choices": [choice], "usage": None}) frames them ("usage" with include_usage)."""
    text = compact_json({**base, "choices": [None], **({"usage": None} if include_usage else {})})
    before, after = text.split('"choices":[null]')
    return f'data: {before}"choices":[', f"]{after}\n\n"


# Legacy completions (the handler's `completions` call, docs/completions.md)
async def completions(request: web.Request) -> web.StreamResponse:
    body = await read_json_object(request)
    fields = stream_fields(body)
    if fields.stream:
        return await stream_chat(request, body, fields, "completions")
    reply = await complete_chat(request, body, "completions", CompletionReply())
    return web.json_response({
        "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
        "model": model_name(request), "choices": reply.choices(), **({"usage": reply.usage} if reply.usage else {})})


# Scoring (front/scoring.py, docs/scoring.md)
async def score_pairs(request: web.Request, data: dict, params: dict[str, str]) -> tuple[list[float], dict]:
    """The handler's scores of data's pairs and its usage; its errors name the route's fields (params)."""
    try:
        reply = await request.app[CONNECTION].call("score", data, request.app[SETTINGS].chunk_timeout)
    except HandlerError as exc:
        exc.param = params.get(exc.param, exc.param)
        raise
    try:
        scores = checked_scores(reply, len(data["text_2"]) if isinstance(data["text_2"], list) else 1)
    except ValueError as exc:
        raise HandlerError(str(exc)) from None
    return scores, reply.get("usage") if isinstance(reply.get("usage"), dict) else {}


async def score(request: web.Request) -> web.Response:
    """vLLM's /v1/score."""
    scores, usage = await score_pairs(request, score_call(await read_json_object(request)), {})
    return web.json_response({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                              "model": model_name(request), "data": score_data(scores), "usage": usage})


async def rerank(request: web.Request) -> web.Response:
    """vLLM's /v1/rerank (Jina's and Cohere's shape): results by decreasing relevance."""
    data, texts, body = rerank_call(await read_json_object(request))
    scores, usage = await score_pairs(request, data, RERANK_PARAMS)
    return web.json_response({"id": f"rerank-{uuid.uuid4().hex}", "model": model_name(request), "usage": usage,
                              "results": rerank_results(scores, texts, body)})


async def tei_rerank(request: web.Request) -> web.Response:
    """TEI's /rerank: [{index, score, text}] by decreasing score; errors in TEI's shape ({error, error_type}),
    a body that does not fit 422 as TEI answers it."""
    try:
        data, body = tei_rerank_call(await read_json_object(request))
        scores, _ = await score_pairs(request, data, TEI_PARAMS)
    except RequestError as exc:
        return tei_error(422, str(exc))
    except (ApiError, HandlerError) as exc:
        return tei_error(exc.status, str(exc))
    return web.json_response(tei_results(scores, body.texts, body.return_text))


def tei_error(status: int, message: str) -> web.Response:
    kind = "validation" if status < 500 else "backend"
    return web.json_response({"error": message, "error_type": kind}, status=status)


# Anthropic Messages
async def anthropic_messages(request: web.Request) -> web.StreamResponse:
    """The Messages request as chat data on the same chat_completions call; the reply in Anthropic's shape."""
    data = anthropic.chat_data(await read_json_object(request))
    events = anthropic.MessageEvents(model_name(request))
    stream = await open_chat(request, data)
    try:
        if data["stream"]:
            return await anthropic.stream_events(request, chat_chunks(request, stream), events)
        async for payload in chat_chunks(request, stream):
            events.add(payload)
        return web.json_response(events.message())
    finally:
        stream.close()  # sends `cancel` when the client went away before the last chunk


# Embeddings
def token_lists_or_texts(value) -> tuple[list[str] | None, list[list[int]] | None]:
    """OpenAI's input forms: a string, strings, one token list, or token lists."""
    def is_token(x):
        return type(x) is int and 0 <= x <= MAX_TOKEN_ID

    def bad(message):
        return ApiError(400, message, param="input")

    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise bad("'input' must be a non-empty string, list of strings, or list of token ids")
    if all(isinstance(x, str) for x in value):
        if not all(value):
            raise bad("'input' strings must be non-empty")
        return value, None
    if all(is_token(x) for x in value):
        return None, [value]
    if all(isinstance(x, list) and x and all(is_token(t) for t in x) for x in value):
        return None, value
    raise bad("'input' must be strings or non-empty lists of token ids (unsigned 32-bit ints), not a mix")


def encode_embedding(vector: list[float], encoding_format: str):
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


async def embeddings(request: web.Request) -> web.Response:
    """Like the production daemon: strings go through `tokenize`, then token lists through `embeddings`.
    `truncate_prompt_tokens` (vLLM's name) travels with both; the handler checks it and, when inputs are
    cut, says how many tokens it embedded (its reply's usage)."""
    body = decode(await read_json_object(request), EmbeddingsBody)
    if body.dimensions is not None:
        raise ApiError(400, "'dimensions' is not supported: the model's vectors have a fixed size; leave it out",
                       param="dimensions")
    texts, token_lists = token_lists_or_texts(body.input)
    options = {} if body.truncate_prompt_tokens is None else {"truncate_prompt_tokens": body.truncate_prompt_tokens}
    connection, timeout = request.app[CONNECTION], request.app[SETTINGS].chunk_timeout
    if texts is not None:
        tokenized = await connection.call("tokenize", {"input": texts, **options}, timeout)
        token_lists = tokenized.get("tokens") if isinstance(tokenized, dict) else None
        if not isinstance(token_lists, list) or len(token_lists) != len(texts):
            raise HandlerError(f"the handler's tokenize reply has no 'tokens' list for {len(texts)} input(s)")
    result = await connection.call("embeddings", {"input": token_lists, **options}, timeout)
    vectors = result.get("embeddings") if isinstance(result, dict) else None
    if not isinstance(vectors, list) or len(vectors) != len(token_lists):
        raise HandlerError(f"the handler's embeddings reply has no 'embeddings' list for {len(token_lists)} input(s)")
    usage = result.get("usage")
    tokens = (usage["prompt_tokens"] if isinstance(usage, dict) and type(usage.get("prompt_tokens")) is int
              else sum(len(t) for t in token_lists))
    return web.json_response({
        "object": "list", "model": model_name(request),
        "data": [{"object": "embedding", "embedding": encode_embedding(v, body.encoding_format), "index": i}
                 for i, v in enumerate(vectors)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


# Responses
RESPONSES_FIELDS = {"max_tokens": "max_output_tokens", "temperature": "temperature", "top_p": "top_p"}  # chat: ours


def responses_wording(message: str) -> str:
    """A chat error's message in /v1/responses' field names."""
    return re.sub(r"\bmax_tokens\b", "max_output_tokens", message)


async def responses(request: web.Request) -> web.Response:
    """Like the production daemon: the input string becomes one user message (instructions, when
    given, a system message before it); non-streaming only."""
    body = await read_json_object(request)
    text = body.get("input")
    if not isinstance(text, str) or not text:
        raise ApiError(400, "'input' must be a non-empty string", param="input")
    if body.get("stream"):
        raise ApiError(400, "streaming is not supported on /v1/responses", param="stream")
    optional_type(body, "instructions", str, "a string")
    messages = ([{"role": "system", "content": body["instructions"]}] if body.get("instructions") else [])
    messages.append({"role": "user", "content": text})
    data = {"messages": messages, "stream": False}
    for ours, theirs in RESPONSES_FIELDS.items():
        if body.get(theirs) is not None:
            data[ours] = body[theirs]
    try:
        reply = await complete_chat(request, data)
    except HandlerError as exc:  # the handler names the chat field; the client sent this route's
        raise HandlerError(responses_wording(str(exc)), exc.status, RESPONSES_FIELDS.get(exc.param, exc.param),
                           exc.code) from None
    usage = reply.usage or {}
    return web.json_response({
        "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
        "status": "completed" if reply.finish_reason != "length" else "incomplete",
        "model": model_name(request),
        "output": [{"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "completed", "role": "assistant",
                    "content": [{"type": "output_text", "text": reply.content(), "annotations": []}]}],
        "usage": {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0),
                  "total_tokens": usage.get("total_tokens", 0)}})


def make_app(connection: HandlerConnection, settings: FrontSettings) -> web.Application:
    """The HTTP front of a started HandlerConnection; the handler's health probe runs while the app does."""
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[count_requests, anthropic.anthropic_errors,
                                                                             openai_errors])
    app[CONNECTION] = connection
    app[SETTINGS] = settings
    app[STARTED] = int(time.time())
    app[HEALTH] = health_state = HandlerHealth(connection, settings.health_timeout)
    app[METRICS] = ServingMetrics(lambda: health_state.stats, lambda: health_state.problem() is None)
    app.cleanup_ctx.append(watch_handler)
    app.router.add_get("/", health)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/v1/score", score)
    app.router.add_post("/v1/rerank", rerank)
    app.router.add_post("/rerank", tei_rerank)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post(anthropic.MESSAGES_PATH, anthropic_messages)
    return app


async def watch_handler(app: web.Application):
    task = asyncio.create_task(app[HEALTH].watch())
    yield
    task.cancel()


async def serve(args: argparse.Namespace, settings: FrontSettings) -> int:
    """Run until SIGINT/SIGTERM or the handler's exit; returns the process exit code.

    On a signal, as the production daemon does: stop accepting connections, drop the write half of the handler's
    socket (the handler finishes the requests in flight, then exits), and let their responses finish."""
    try:  # first, so that a busy port fails before the handler loads anything
        sock = listening_socket(args.host, args.port)
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else exc.strerror or str(exc)
        error(f"cannot listen on {args.host}:{args.port}: {reason}; pick a free --port (0: any) and an address of "
              "this machine for --host")
        return 1
    connection = HandlerConnection(args.handler)
    try:
        await connection.start()
    except OSError as exc:
        error(f"cannot start the handler {args.handler!r}: {exc}")
        sock.close()
        return 1
    app = make_app(connection, settings)
    # keepalive_timeout closes a connection idle between requests, or one that never completes a request's head
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, keepalive_timeout=settings.idle_timeout)
    await runner.setup()
    site = web.SockSite(runner, sock)
    await site.start()
    host, port = runner.addresses[0][:2]
    log.info(f"listening on http://{host}:{port}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({stopping, connection.closed}, return_when=asyncio.FIRST_COMPLETED)
    by_signal = stop.is_set()
    await site.stop()
    runner.server.pre_shutdown()  # idle connections close now, busy ones after their response
    log.info("shutting down (signal): no new connections; finishing the requests in flight" if by_signal
             else "the handler closed its socket; shutting down")
    code = await connection.stop()
    await runner.cleanup()
    stopping.cancel()
    if code:
        error(f"the handler exited with code {code}")
    return 0 if by_signal or code == 0 else 1


def listening_socket(host: str, port: int) -> socket.socket:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family, backlog=1024)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m front", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080, help="0 picks a free port")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: $HFENDPOINT_API_KEY)")
    parser.add_argument("--open-metrics", action="store_true",
                        help="serve /metrics without the API key (default: $HFENDPOINT_OPEN_METRICS, else false)")
    parser.add_argument("--chunk-timeout", type=float, default=CHUNK_TIMEOUT_S,
                        help="seconds to wait between two chunks of one request (default 300)")
    parser.add_argument("--health-timeout", type=float, default=HEALTH_TIMEOUT_S,
                        help="seconds a health probe of the handler may go unanswered before /health answers 503 "
                             f"(default {HEALTH_TIMEOUT_S:g})")
    parser.add_argument("--idle-timeout", type=float, default=IDLE_TIMEOUT_S,
                        help="seconds before closing a connection that sends no request, or stops sending a "
                             "request body (default 75)")
    parser.add_argument("handler", nargs=argparse.REMAINDER, help="-- HANDLER_CMD [ARGS...]")
    args = parser.parse_args(argv)
    if args.handler[:1] == ["--"]:
        args.handler = args.handler[1:]
    if not args.handler:
        parser.error("give the handler command after '--', e.g. -- python -m handler")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT, stream=sys.stderr)
    log.setLevel(logging.INFO)
    settings = FrontSettings.from_args(args)
    sys.exit(asyncio.run(serve(args, settings)))


