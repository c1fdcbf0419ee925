"""Legacy completions (OpenAI's /v1/completions, as vLLM serves it): raw prompts, no chat template.

A request holds one prompt or a batch (strings or token ids); each prompt's `n` choices run through the chat
path's machinery (handler/choices.py: detokenization, stop strings, finish reasons, logprobs), the prompts side by
side, and their chunks are renamed into the `completions` reply chunks of docs/completions.md: choice i of
prompt p is choice p * n + i, as OpenAI numbers them. `echo` puts the prompt's text before each choice's text
and, with `logprobs`, its tokens' logprobs before the generated ones' (the engine's prompt logprobs,
engine/prompt_logprobs.py; the first prompt token has none).
"""
import asyncio
from dataclasses import dataclass

from daemon_protocol import RequestError
from handler.chat import (
    ChatModel,
    ChatRequest,
    check_stop,
    checked_max_tokens,
    decode_request,
    encode_prompt,
    sampling_params,
)
from handler.choices import usage
from handler.logprobs import LogprobEntries
from handler.logs import RequestLog
from handler.output_plan import OutputPlan, check_n, check_stream_options, parse_logit_bias
from schema import CompletionRequest as CompletionFields
from schema.completions import DEFAULT_MAX_TOKENS

MAX_PROMPTS = 256  # each prompt's choices are engine requests of their own


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list[ChatRequest]  # one per prompt, in order
    texts: list[str] | None  # each prompt's text, for echo
    echo: bool
    n: int


def parse_completion_request(data, model: ChatModel) -> CompletionRequest:
    """Every problem is a RequestError naming the field."""
    request = decode_request(data, CompletionFields, model.limits)
    check_unsupported(request)
    check_stream_options(request)
    n = check_n(request, model.limits.max_n)
    plan = OutputPlan(n=n, logprobs=request.logprobs, logit_bias=parse_logit_bias(request, model))
    sent = parse_prompts(request.prompt)
    prompts = [encode_prompt(model.tokenizer, prompt, request.add_special_tokens) if token_ids is None else token_ids
               for prompt, token_ids in sent]
    texts = [prompt if token_ids is None else model.tokenizer.decode(token_ids) for prompt, token_ids in sent] \
        if request.echo else None
    defaults = {**model.sampling_defaults, "max_tokens": DEFAULT_MAX_TOKENS}
    stop = check_stop(request.stop_strings(), model.limits)
    requests = []
    for i, token_ids in enumerate(prompts):
        check_prompt(token_ids, i, model)
        max_tokens = checked_max_tokens(request, defaults, len(token_ids), model.max_model_len)
        params = sampling_params(request, model, {**plan.sampling, "max_tokens": max_tokens,
                                                  "prompt_logprobs": request.logprobs if request.echo else None},
                                 defaults)
        requests.append(ChatRequest(token_ids, params, stop, plan))
    return CompletionRequest(requests, texts, request.echo, n)


def check_unsupported(request: CompletionFields) -> None:
    if request.suffix is not None:
        raise RequestError("suffix is not supported: insertion (fill-in-the-middle) needs a model trained for it; "
                           "send the text before the gap as the prompt", param="suffix")
    if request.best_of is not None and request.best_of != request.n:
        raise RequestError(f"best_of is not supported (it may only equal n): got {request.best_of!r:.100}; ask for n "
                           "choices with logprobs and rank them yourself", param="best_of")
    for name in ("messages", "tools", "response_format"):
        if getattr(request, name) is not None:
            raise RequestError(f"{name} is a chat completions field: send it to /v1/chat/completions", param=name)


def parse_prompts(prompt: str | list) -> list[tuple[str | list[int], list[int] | None]]:
    """Each prompt as (what was sent, its token ids when sent as ids): a string, a list of strings, a list of
    token ids, or a list of lists of token ids."""
    def is_token(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if isinstance(prompt, str):
        return [(prompt, None)]
    if not prompt:
        raise RequestError("prompt must be a string, a list of strings, a list of token ids or a list of lists of "
                           "token ids, got an empty list", param="prompt")
    if all(is_token(token) for token in prompt):
        return [(prompt, prompt)]
    if len(prompt) > MAX_PROMPTS:
        raise RequestError(f"prompt: at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}", param="prompt")
    if all(isinstance(item, str) for item in prompt):
        return [(item, None) for item in prompt]
    for i, item in enumerate(prompt):
        if not (isinstance(item, list) and item and all(is_token(token) for token in item)):
            raise RequestError(f"prompt[{i}] must be a non-empty list of token ids like the other items (a batch "
                               f"is all strings or all token-id lists), got {item!r:.100}", param="prompt")
    return [(item, item) for item in prompt]


def check_prompt(token_ids: list[int], index: int, model: ChatModel) -> None:
    vocab_size = model.vocab_size or len(model.tokenizer)
    if not token_ids:
        raise RequestError(f"prompt[{index}] has no tokens: give at least one", param="prompt")
    bad = next((token for token in token_ids if not 0 <= token < vocab_size), None)
    if bad is not None:
        raise RequestError(f"prompt[{index}]: token id {bad} is not in this model's vocabulary (0 to "
                           f"{vocab_size - 1})", param="prompt")
    if len(token_ids) >= model.max_model_len:
        raise RequestError(f"prompt[{index}] is {len(token_ids)} tokens, which leaves no room to generate within the "
                           f"model's maximum context length of {model.max_model_len} tokens; shorten it",
                           param="prompt", code="context_length_exceeded")


class CompletionChoice:
    """One choice's state across its chunks: whether its echo went out, and its text offset for logprobs."""

    def __init__(self, echo_text: str | None, prompt_token_ids: list[int]):
        self.echo_text, self.prompt_token_ids = echo_text, prompt_token_ids
        self.started = False
        self.text_offset = 0


async def stream_completion(replies, worker, request: CompletionRequest, request_id: str, log: RequestLog):
    """Yields the reply chunks of docs/completions.md; the last one alone has finish_reason, with usage."""
    logs = [RequestLog(f"{request_id}/{i}", "completions") for i in range(len(request.prompts))]
    choices = {}
    for p, prompt in enumerate(request.prompts):
        for i in range(request.n):
            choices[p * request.n + i] = CompletionChoice(request.texts[p] if request.echo else None,
                                                          prompt.prompt_token_ids)
    streams = [replies.stream(worker, prompt, f"{request_id}/{p}", logs[p]) for p, prompt in enumerate(request.prompts)]
    unfinished, totals = len(streams), [0, 0]
    async for p, chunk in merged(streams):
        log.completion_tokens = sum(each.completion_tokens for each in logs)
        if log.completion_tokens:
            log.first_token()
        index = p * request.n + chunk.get("index", 0)
        reason = chunk.get("finish_reason") or chunk.get("choice_finish_reason")
        out = completion_chunk(choices[index], chunk, index, replies.logprobs)
        if chunk.get("usage"):  # this prompt's last chunk
            unfinished -= 1
            totals[0] += chunk["usage"]["prompt_tokens"]
            totals[1] += chunk["usage"]["completion_tokens"]
        if unfinished:
            if reason:
                out["choice_finish_reason"] = reason
        else:
            out["finish_reason"], out["usage"] = reason, usage(*totals)
        yield out


def completion_chunk(choice: CompletionChoice, chunk: dict, index: int, entries: LogprobEntries) -> dict:
    """A `completions` reply chunk from one choice's chat chunk: its echo first on the choice's first chunk, and
    logprobs in the legacy shape when the chunk has them."""
    text, tokens = chunk.get("content") or "", []
    if not choice.started:
        choice.started = True
        if choice.echo_text is not None:
            text = choice.echo_text + text
            prompt_logprobs = chunk.get("prompt_logprobs")
            if prompt_logprobs:
                tokens = prompt_entries(entries, choice.prompt_token_ids, prompt_logprobs)
    if chunk.get("logprobs"):
        tokens += chunk["logprobs"]["content"]
    out = {"index": index, "text": text}
    if tokens:
        out["logprobs"] = legacy_logprobs(tokens, choice)
    return out


def prompt_entries(entries: LogprobEntries, token_ids: list[int], engine_entries: list) -> list[dict]:
    """Chat logprob entries of the prompt's tokens; the first, which nothing predicts, has logprob None."""
    first = {**entries.entry(token_ids[0], 0.0), "logprob": None, "top_logprobs": None}
    return [first, *entries.entries(token_ids[1:], engine_entries[1:])]


def legacy_logprobs(tokens: list[dict], choice: CompletionChoice) -> dict:
    """OpenAI's legacy logprobs object from chat logprob entries: `top_logprobs` maps each alternative's text (and
    the token's own, as vLLM does) to its logprob; `text_offset` is where each token's text starts in the choice."""
    offsets = []
    for token in tokens:
        offsets.append(choice.text_offset)
        choice.text_offset += len(token["token"])
    return {"tokens": [token["token"] for token in tokens],
            "token_logprobs": [token["logprob"] for token in tokens],
            "top_logprobs": [None if token["top_logprobs"] is None else
                             {**{top["token"]: top["logprob"] for top in token["top_logprobs"]},
                              token["token"]: token["logprob"]} for token in tokens],
            "text_offset": offsets}


async def merged(streams):
    """(i, item) from each async iterator streams[i] as items arrive; the first error ends them all. Closing
    this generator cancels the streams still running (each aborts its engine requests as it ends)."""
    queue = asyncio.Queue()
    done = object()

    async def pump(i, stream):
        try:
            async for item in stream:
                await queue.put((i, item))
        except Exception as exc:  # noqa: BLE001 - raised where the items are read
            await queue.put((i, exc))
            return
        await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

