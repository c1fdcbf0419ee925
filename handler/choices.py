"""The choices of one chat completion: the engine's outputs -> reply chunks (docs/chat-extensions.md).

Each choice is an engine request of its own and reads its tokens through its own pipeline: Completion
(detokenization, stop strings, finish reason), then the reasoning splitter (think models), then the tool-call
parser; logprobs go along per token. A chunk carries one choice's additions. With n > 1 it names its choice in
`index`, a choice that ends before the last says so in `choice_finish_reason`, and only the request's last chunk
carries `finish_reason` (with `usage`, counting the prompt once and every choice's tokens), as the protocol
wants: a daemon reads chunks up to the first finish_reason.
"""
from dataclasses import replace

from daemon_protocol import RequestError
from engine import SamplingParams
from handler.detokenizer import Detokenizer
from handler.grammar import GrammarConstraint, Grammars
from handler.logprobs import LogprobEntries
from handler.output_plan import OutputPlan
from handler.reasoning import THINK_CLOSE, THINK_OPEN, ReasoningSplitter
from handler.reply_stream import ReplyStream
from handler.tool_calls import FORMAT_MARKERS, Parsed, ToolCallParser

SEED_STRIDE = 0x9E3779B97F4A7C15  # choice i of a seeded request draws with seed + i * stride (mod 2**64)
MARKERS = frozenset(marker for markers in FORMAT_MARKERS.values() for marker in markers) | {THINK_OPEN, THINK_CLOSE}


class ChatReplies:
    """What turning engine outputs into reply chunks needs of the model, made once."""

    def __init__(self, tokenizer, token_bytes: list[bytes] | None, grammars: Grammars | None = None):
        """grammars: what compiled the requests' grammars, which makes their constraints (each ready to be sent to
        an engine in another process)."""
        self.tokenizer = tokenizer.backend_tokenizer  # decoding, on the event loop
        self.logprobs = LogprobEntries(token_bytes) if token_bytes is not None else None
        self.grammars = grammars
        # special tokens whose text the parsers read (decoding would drop them)
        self.kept_tokens = {token_id: added.content for token_id, added in
                            self.tokenizer.get_added_tokens_decoder().items()
                            if added.special and added.content in MARKERS}
        self.generated_tokens = 0  # by every request so far, for the engine line (handler/logs.py)

    async def stream(self, worker, request, request_id: str, log, sink=None):
        """Submits the request's choices to the engine and yields its reply chunks; log (handler/logs.py's
        RequestLog) follows its first token and its completion tokens. sink: the request's daemon_protocol
        ReplySink, which the engine's step callback sends chunks to while it can (handler/reply_stream.py): those
        chunks are not yielded."""
        plan = request.output or OutputPlan()
        choices = {(request_id if plan.n == 1 else f"{request_id}/{index}"):
                   Choice(index, self._detokenizer(request), plan, self.logprobs, self.grammars)
                   for index in range(plan.n)}
        generating = dict(choices)
        num_prompt_tokens = len(request.prompt_token_ids)

        def advance(outputs: list) -> list[dict]:
            chunks = self._chunks(outputs, choices, plan.n, num_prompt_tokens)
            self._count_tokens(choices, log)
            if chunks and ("choice_finish_reason" in chunks[-1] or "finish_reason" in chunks[-1]):
                self._end_finished(worker, generating)  # the chunks of choices that end come last
            return chunks

        replies = ReplyStream(advance, sink)  # every choice's outputs
        try:
            for choice_id, choice in choices.items():
                worker.submit(choice_id, request.prompt_token_ids, choice_params(request.params, choice.index),
                              constraint=choice.constraint, queue=replies,
                              shares_prompt_with=f"{request_id}/0" if choice.index else None, images=request.images)
            while generating:
                for chunk in advance(await replies.take()):
                    yield chunk
        finally:
            for choice_id, choice in choices.items():
                if not choice.completion.engine_finished:  # cancelled or disconnected (aborting twice is harmless)
                    worker.abort(choice_id)

    def _count_tokens(self, choices: dict, log) -> None:
        completion_tokens = sum([choice.completion.num_tokens for choice in choices.values()])
        self.generated_tokens += completion_tokens - log.completion_tokens
        log.completion_tokens = completion_tokens
        if completion_tokens:
            log.first_token()

    @staticmethod
    def _end_finished(worker, generating: dict) -> None:
        """Takes the choices that have finished out of `generating`; those cut short (a stop string, their one tool
        call) are aborted, so that their blocks are freed now."""
        for choice_id, choice in list(generating.items()):
            if choice.finish_reason is not None:
                del generating[choice_id]
                if not choice.completion.engine_finished:
                    worker.abort(choice_id)

    def _detokenizer(self, request) -> Detokenizer:
        return Detokenizer(self.tokenizer, request.prompt_token_ids, request.stop, self.kept_tokens)

    @staticmethod
    def _chunks(batch, choices: dict, n: int, num_prompt_tokens: int) -> list[dict]:
        """One chunk per choice that has something to say, those that finish last; the request's last chunk
        takes finish_reason and usage."""
        if n == 1:
            (choice,) = choices.values()
            chunk = choice.consume(batch)
            if chunk is None:
                return []
            del chunk["index"]
            chunks = [chunk]
        else:
            outputs = {}
            for output in batch:
                outputs.setdefault(output.request_id, []).append(output)
            chunks = [chunk for choice_id, items in outputs.items() if (chunk := choices[choice_id].consume(items))]
            chunks.sort(key=lambda chunk: "choice_finish_reason" in chunk)
        if chunks and "choice_finish_reason" in chunks[-1] and all(
                choice.finish_reason is not None for choice in choices.values()):
            last = chunks[-1]
            last["finish_reason"] = last.pop("choice_finish_reason")
            completion_tokens = sum(choice.completion.num_tokens for choice in choices.values())
            last["usage"] = usage(num_prompt_tokens, completion_tokens)
        return chunks


def grammar_constraint(plan: OutputPlan, grammars: Grammars | None) -> GrammarConstraint | None:
    """The choice's constraint, if its plan has a grammar; made by the grammars that compiled it when given."""
    if plan.grammar is None:
        return None
    return grammars.constraint(plan.schema, plan.grammar) if grammars is not None else GrammarConstraint(plan.grammar)


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice i's sampling: a seeded request's choices draw differently, each reproducibly."""
    if index == 0 or params.seed is None:
        return params
    return replace(params, seed=(params.seed + index * SEED_STRIDE) % 2**64)


class Choice:
    def __init__(self, index: int, detokenizer: Detokenizer, plan: OutputPlan, logprobs: LogprobEntries | None,
                 grammars: Grammars | None = None):
        self.index = index
        self.completion = Completion(detokenizer)
        self.constraint = grammar_constraint(plan, grammars)
        self.schema_field = plan.schema_field
        self.reasoning = ReasoningSplitter(plan.reasoning) if plan.reasoning is not None else None
        tools = plan.tools
        self.tools = ToolCallParser(tools.style, tools.function_name, max_calls=None if tools.parallel else 1) \
            if tools.style is not None else None
        self.logprobs = logprobs if plan.logprobs is not None else None
        self.finish_reason: str | None = None

    def consume(self, outputs) -> dict | None:
        """The chunk these engine outputs make (None when they add nothing a client would see, and once the
        choice has ended)."""
        if self.finish_reason is not None:
            return None
        completion = self.completion
        text, entries, prompt_logprobs = "", [], None
        for output in outputs:
            if output.finish_reason == "error":
                self._check_grammar()
            piece, num_read = completion.consume(output)
            text += piece
            if self.logprobs is not None and output.logprobs:
                entries += self.logprobs.entries(output.new_token_ids[:num_read], output.logprobs[:num_read])
            if prompt_logprobs is None and output.prompt_logprobs:
                prompt_logprobs = output.prompt_logprobs
        reasoning, content, tool_calls = self._parse(text, finished=completion.finish_reason is not None)
        if self.tools is not None and self.tools.finished and completion.finish_reason is None:
            completion.finish_reason = "stop"  # its one call is complete: the rest is not read (an abort)
        chunk = {"index": self.index, "content": content}
        if reasoning:
            chunk["reasoning_content"] = reasoning
        if tool_calls:
            chunk["tool_calls"] = tool_calls
        if entries:
            chunk["logprobs"] = {"content": entries}
        if prompt_logprobs:  # the engine's entries, as they came: handler/completions.py reads them
            chunk["prompt_logprobs"] = prompt_logprobs
        if self.completion.finish_reason is not None:
            self.finish_reason = self._finish_reason()
            chunk["choice_finish_reason"] = self.finish_reason
            if self.completion.detokenizer.stop_string is not None:
                chunk["stop_sequence"] = self.completion.detokenizer.stop_string
        return chunk if len(chunk) > 2 or content else None

    def _check_grammar(self) -> None:
        """Of a request that failed: a grammar that allowed no next token failed it, the schema's fault, not the
        engine's."""
        if self.constraint is not None and self.constraint.broken:
            self.completion.engine_finished = True
            raise RequestError(f"{self.schema_field}: the JSON schema's grammar reached a point where no token may "
                               "follow (no value satisfies the schema); fix the schema", param=self.schema_field)

    def _parse(self, text: str, finished: bool) -> tuple[str, str, list[dict]]:
        """(reasoning, content, tool-call deltas) of the text."""
        if self.reasoning is None and self.tools is None:
            return "", text, []
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        if finished and self.reasoning:
            more_reasoning, more_content = self.reasoning.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        if self.tools is None:
            return reasoning, content, []
        parsed = self.tools.feed(content)
        if finished or self.tools.finished:
            rest = self.tools.finish()
            parsed = Parsed(parsed.content + rest.content, parsed.tool_calls + rest.tool_calls)
        return reasoning, parsed.content, parsed.tool_calls

    def _finish_reason(self) -> str:
        reason = self.completion.finish_reason
        return "tool_calls" if reason == "stop" and self.tools is not None and self.tools.calls else reason


class Completion:
    """One choice's generated text, from the engine's outputs: finish reason, stop strings, token count."""

    def __init__(self, detokenizer: Detokenizer):
        self.detokenizer = detokenizer
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.engine_finished = False  # the engine finished the request itself (nothing to abort)

    def consume(self, output) -> tuple[str, int]:
        """The text one engine output adds, and how many of its tokens that text reads (a stop token is not
        text; tokens after a stop string are not read). Nothing once the completion has finished."""
        if self.finish_reason is not None:
            return "", 0
        if output.finish_reason == "error":
            self.engine_finished = True
            raise RuntimeError(f"the engine failed on this request: {output.error}")
        token_ids = output.new_token_ids
        stop_token = output.finish_reason == "stop" and bool(token_ids)
        detokenizer, text = self.detokenizer, ""
        read = token_ids[:-1] if stop_token else token_ids
        for num_read, token_id in enumerate(read, start=1):
            text += detokenizer.add(token_id)
            if detokenizer.stopped:
                self.num_tokens += num_read
                self.finish_reason = "stop"
                return text, num_read
        self.num_tokens += len(read)
        if output.finish_reason is not None:
            self.num_tokens += stop_token
            self.engine_finished = True
            self.finish_reason = output.finish_reason
            text += detokenizer.flush()
        return text, len(read)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
