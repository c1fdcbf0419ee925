"""The request handlers: chat_completions, tokenize, embeddings, and the extras models and stats.

Each takes the request's `data` and returns (or, for chat, yields) reply payloads; an exception becomes
the request's error reply (RequestError: 400 naming the field; EngineUnavailable: 503). Chat runs on the
engine Worker; its chunks go out from the engine step's callback (handler/reply_stream.py). Each request ends
with an access line (handler/logs.py).
Encoding (chat templates, tokenizing) runs on a small pool of threads, each with its own copy of the tokenizer,
so a long prompt neither holds up the event loop that streams every other request's chunks nor the encoding of
the requests behind it; a request's images are fetched on the event loop first, then decoded and preprocessed
with its prompt on the encoding thread (handler/images.py). A request cancelled while its encoding waits for a
thread is never encoded; one cancelled while encoding (a template render cannot be interrupted) is dropped once it
ends, before the engine sees it. A request's JSON schema compiles after its encoding, in the grammar compilers'
own processes (handler/grammar.py), so that a slow compile holds no encoding thread.
"""

import asyncio
import contextlib
import copy
import dataclasses
import itertools
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

from daemon_protocol import ReplyError, RequestError, reply_sink
from engine import PromptRejected, Worker
from engine.embedding import check_inputs
from handler.chat import ChatModel, ChatRequest, max_chars_per_token, parse_chat_request, sampling_defaults
from handler.choices import ChatReplies
from handler.completions import parse_completion_request, stream_completion
from handler.grammar import Grammars
from handler.images import VisionPrompt
from handler.limits import RequestLimits
from handler.logs import ENGINE_LOG_INTERVAL_S, logged_request, report_engine
from handler.memory import resident_bytes
from handler.scoring import pair_token_ids, parse_score_request, scores
from handler.settings import HandlerSettings
from handler.tokenizer import embedding_token_ids
from schema import decode
from schema.embeddings import EmbeddingsRequest, TokenizeRequest

ENCODER_THREADS = 4  # requests encoded at once
ENCODER_START_TIMEOUT_S = 60.0
FALLBACK_CHARS_PER_TOKEN = 64  # for tokenizers that give no bound (handler/chat.py max_chars_per_token)
TRUNCATION_MARGIN = 2  # a truncated text's end tokenized: this many times what its kept tokens can span


class EngineUnavailable(ReplyError):
    """The engine takes no more requests (a tensor-parallel rank died, or it shut down): 503, and the
    handler exits for the daemon to restart it."""

    def __init__(self, message: str):
        super().__init__(message, 503, code="engine_unavailable")


def stop_tokens(model_eos: tuple[int, ...], tokenizer) -> tuple[int, ...]:
    """The tokens that end a reply: the model's end-of-sequence ids, then the tokenizer's."""
    tokenizer_eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    return tuple(dict.fromkeys([*model_eos, *tokenizer_eos]))


@dataclasses.dataclass
class EncodingParts:
    """What the service makes from the tokenizer that takes a while, which the handler makes on a thread while the
    weights load. The tokenizer's copies (tokenizers refuses to use one tokenizer from two threads while one
    reconfigures it, as truncation does): one that the grammars and the chat model read, and one for each
    encoding thread. The most characters a token stands for (handler/chat.py's max_chars_per_token). And the
    grammars, for the vocabulary size and end-of-sequence ids that the model's files give, with the tokenizer
    info their compiling processes start from serialized: the service makes its own when the engine's differ."""
    shared: object
    per_thread: queue.SimpleQueue  # taken by the encoding threads as they start
    max_chars_per_token: int | None
    grammars: Grammars | None = None

    @classmethod
    def of(cls, tokenizer, vocabulary: tuple[int, tuple[int, ...]] | None = None,
           max_grammar_bytes: int = RequestLimits.max_grammar_bytes) -> "EncodingParts":
        """vocabulary: (vocabulary size, end-of-sequence ids) of a decoder, for its grammars; None: none made."""
        per_thread = queue.SimpleQueue()
        for _ in range(ENCODER_THREADS):
            per_thread.put(copy.deepcopy(tokenizer))
        shared = copy.deepcopy(tokenizer)
        grammars = None
        if vocabulary is not None:
            vocab_size, model_eos = vocabulary
            grammars = Grammars(shared, vocab_size, stop_tokens(model_eos, tokenizer), max_grammar_bytes)
            if grammars.can_constrain:
                _ = grammars.info_json  # serialized here, on the loading thread, rather than after the engine is ready
        return cls(shared, per_thread, max_chars_per_token(tokenizer), grammars)


def image_fetcher(settings: HandlerSettings):
    """The fetcher of a vision model's image parts; its module (and aiohttp) is imported for such a model only."""
    from handler.image_fetch import ImageFetcher

    return ImageFetcher(settings)


class Service:
    def __init__(self, worker: Worker, tokenizer, model_name: str, settings: HandlerSettings | None = None,
                 engine_log_interval: float = ENGINE_LOG_INTERVAL_S, parts: EncodingParts | None = None):
        """parts: what encoding needs, made beforehand (EncodingParts.of(tokenizer, ...)); made here if not
        given, and its grammars too when they were not made for this engine's vocabulary."""
        settings = settings or HandlerSettings()
        self.auto_truncate = settings.auto_truncate
        self.worker = worker
        self.tokenizer = tokenizer  # decoding, on the event loop
        self.model_name = model_name
        eos = stop_tokens(worker.eos_token_ids, tokenizer)
        self._parts = parts or EncodingParts.of(tokenizer)
        encoding_tokenizer = self._parts.shared
        grammars = None
        if worker.kind == "decoder":
            grammars = self._parts.grammars
            if grammars is None or not grammars.made_for(worker.vocab_size, eos, settings.limits.max_grammar_bytes):
                grammars = Grammars(encoding_tokenizer, worker.vocab_size, eos, settings.limits.max_grammar_bytes)
        self.grammars = grammars
        if grammars is not None and grammars.can_constrain:
            grammars.start_compilers()
        vision = VisionPrompt.load(worker.model_dir, settings.image_max_pixels) if worker.reads_images else None
        self.images = image_fetcher(settings) if vision is not None else None
        self.chat_model = ChatModel(encoding_tokenizer, worker.max_model_len, eos, sampling_defaults(worker.model_dir),
                                    vocab_size=worker.vocab_size, grammars=grammars,
                                    max_chars_per_token=self._parts.max_chars_per_token,
                                    trust_request_chat_template=settings.trust_request_chat_template, vision=vision,
                                    limits=settings.limits)
        self.replies = ChatReplies(tokenizer, grammars.token_bytes if grammars else None,
                                   grammars if grammars and grammars.can_constrain else None)
        self._encoder_state = threading.local()
        self.encoder = ThreadPoolExecutor(ENCODER_THREADS, thread_name_prefix="encoder",
                                          initializer=self._start_encoder_thread)
        self._start_every_encoder_thread()
        self._request_ids = itertools.count(1)
        self._engine_log_interval = engine_log_interval
        self._engine_report: asyncio.Task | None = None

    def _start_every_encoder_thread(self) -> None:
        """Starts the pool's threads now rather than at the first burst of requests: each takes its tokenizer copy
        and its ChatModel as it starts (copying the tokenizer then held the GIL long enough to stall the engine
        thread and every request in flight)."""
        all_started = threading.Barrier(ENCODER_THREADS)  # while one thread waits, the next job needs a new one
        for started in [self.encoder.submit(all_started.wait, ENCODER_START_TIMEOUT_S) for _ in range(ENCODER_THREADS)]:
            started.result()

    def _start_encoder_thread(self) -> None:
        self._encoder_state.chat_model = dataclasses.replace(self.chat_model,
                                                             tokenizer=self._parts.per_thread.get_nowait())

    async def encode(self, job):
        """job(chat_model) on an encoding thread, with that thread's own ChatModel (its own tokenizer)."""
        state = self._encoder_state
        return await asyncio.get_running_loop().run_in_executor(self.encoder, lambda: job(state.chat_model))

    async def chat_completions(self, data):
        """Streams reply chunks (docs/chat-extensions.md); the last one has a finish_reason and usage."""
        request_id = f"chat-{next(self._request_ids)}"
        with logged_request(request_id, "chat_completions") as log, self.engine_errors("messages"):
            if self.worker.kind != "decoder":
                raise RequestError(f"{self.model_name} is an embedding model: it serves embeddings, not chat")
            sources = await self.images.gather(data) if self.images is not None else ()
            request = await self.encode(lambda chat_model: parse_chat_request(data, chat_model, sources))
            request = await self.with_grammar(request)
            log.prompt_tokens = len(request.prompt_token_ids)
            self.start_engine_report()
            async for chunk in self.replies.stream(self.worker, request, request_id, log, reply_sink()):
                yield chunk

    async def completions(self, data):
        """Legacy completions (docs/completions.md): raw prompts, echo, prompt logprobs; streams reply chunks, the
        last one with finish_reason and usage."""
        request_id = f"cmpl-{next(self._request_ids)}"
        with logged_request(request_id, "completions") as log, self.engine_errors("prompt"):
            if self.worker.kind != "decoder":
                raise RequestError(f"{self.model_name} is not a generative model: it serves no completions")
            request = await self.encode(lambda chat_model: parse_completion_request(data, chat_model))
            log.prompt_tokens = sum(len(prompt.prompt_token_ids) for prompt in request.prompts)
            self.start_engine_report()
            async for chunk in stream_completion(self.replies, self.worker, request, request_id, log):
                yield chunk

    async def score(self, data):
        """Cross-encoder scores of text pairs (handler/scoring.py, docs/scoring.md)."""
        with logged_request(f"score-{next(self._request_ids)}", "score") as log, self.engine_errors("text_2"):
            if self.worker.kind != "classifier":
                raise RequestError(f"{self.model_name} is not a cross-encoder (a sequence-classification model): it "
                                   "scores no text pairs")
            num_labels = self.worker.embedder.hidden_size  # a classifier's outputs are its logits
            if num_labels != 1:
                raise RequestError(f"{self.model_name} classifies into {num_labels} labels; scoring needs a "
                                   "cross-encoder with one")
            request = parse_score_request(data)
            limit = self.worker.max_embedding_tokens
            token_lists = await self.encode(lambda chat_model: pair_token_ids(chat_model.tokenizer, request, limit))
            log.prompt_tokens = sum(map(len, token_lists))
            logits = await self.worker.embed(token_lists)
            return {"scores": scores(logits, request.raw_scores),
                    "usage": {"prompt_tokens": log.prompt_tokens, "total_tokens": log.prompt_tokens}}

    async def with_grammar(self, request: ChatRequest) -> ChatRequest:
        """The request with its schema's grammar compiled (handler/grammar.py), if it has a schema."""
        plan = request.output
        if plan is None or plan.schema is None:
            return request
        grammar = await self.grammars.compile_json_schema(plan.schema, plan.schema_field,
                                                          self.chat_model.limits.grammar_compile_timeout)
        return dataclasses.replace(request, output=dataclasses.replace(plan, grammar=grammar))

    async def tokenize(self, data):
        """Token ids of each input string; longer than the model's embedding limit is an error unless
        `truncate_prompt_tokens` asks to keep the last tokens (engine/embedding.py, docs/errors.md)."""
        with logged_request(f"tokenize-{next(self._request_ids)}", "tokenize") as log:
            request = decode(data, TokenizeRequest)
            keep_last = self.truncation(request.truncate_prompt_tokens)
            texts = self.bounded_texts(request.texts(), keep_last)
            tokens = await self.encode(lambda chat_model: embedding_token_ids(chat_model.tokenizer, texts,
                                                                              keep_last))
            self.check_embedding_lengths(tokens)
            log.prompt_tokens = sum(map(len, tokens))
            return {"tokens": tokens}

    async def embeddings(self, data):
        """Pooled vectors of token id lists; with `truncate_prompt_tokens` the reply also says how many
        tokens were embedded (`usage`), since inputs may have been cut."""
        with logged_request(f"embeddings-{next(self._request_ids)}", "embeddings") as log, self.engine_errors("input"):
            if self.worker.kind == "classifier":
                raise RequestError(f"{self.model_name} is a cross-encoder: it scores text pairs (score, rerank), it "
                                   "does not embed")
            request = decode(data, EmbeddingsRequest)
            token_lists = request.input
            keep_last = self.truncation(request.truncate_prompt_tokens)
            if keep_last is not None:
                token_lists = [tokens[-keep_last:] for tokens in token_lists]
            self.check_embedding_lengths(token_lists)
            check_inputs(token_lists, self.worker.vocab_size, self.worker.max_embedding_tokens)  # before the queue
            log.prompt_tokens = sum(map(len, token_lists))
            vectors = await self.worker.embed(token_lists)
            if keep_last is None:
                return {"embeddings": vectors}
            return {"embeddings": vectors, "usage": {"prompt_tokens": log.prompt_tokens,
                                                     "total_tokens": log.prompt_tokens}}

    async def models(self, data):
        return {"id": self.model_name, "kind": self.worker.kind, "max_model_len": self.worker.max_model_len,
                "hidden_size": self.worker.hidden_size, "capabilities": self.capabilities()}

    def capabilities(self) -> list[str]:
        """What the served model does, by the front's names: chat (with a chat template), completions and
        embeddings for a decoder, embeddings for an encoder, score (score and rerank) for a cross-encoder."""
        if self.worker.kind == "classifier":
            return ["score"]
        if self.worker.kind == "encoder":
            return ["embeddings"]
        return [*(["chat"] if self.chat_model.tokenizer.chat_template else []), "completions", "embeddings"]

    async def stats(self, data):
        return self.handler_stats()

    def handler_stats(self) -> dict:
        """The engine's numbers and the handler's resident memory."""
        return {**self.worker.stats(), "handler_rss_bytes": resident_bytes()}

    def truncation(self, keep_last: int | None) -> int | None:
        """How many tokens to keep, from the end, of each embedding input (None: refuse longer inputs).
        vLLM's truncate_prompt_tokens: k keeps the last k tokens, -1 the model's limit; without it, the model's
        limit when the operator set HFENDPOINT_AUTO_TRUNCATE (TEI's auto-truncate)."""
        limit = self.worker.max_embedding_tokens
        if keep_last is None:
            return limit if self.auto_truncate else None
        if not (keep_last == -1 or 1 <= keep_last <= limit):
            raise RequestError(f"truncate_prompt_tokens must be -1 (the model's limit) or an integer from 1 to "
                               f"{limit}, got {keep_last!r:.100}", param="truncate_prompt_tokens")
        return limit if keep_last == -1 else keep_last

    def bounded_texts(self, texts: list[str], keep_last: int | None) -> list[str]:
        """Texts too long in characters to fit the embedding limit whatever their tokens are refused before
        tokenizing (as chat prompts are, handler/chat.py); with truncation, only their ends that can hold the
        tokens kept are tokenized. A tokenizer whose normalizer may delete text gives no such bound: for it, more
        than FALLBACK_CHARS_PER_TOKEN characters per token is taken as too long (no real text is that sparse)."""
        per_token = self.chat_model.max_chars_per_token or FALLBACK_CHARS_PER_TOKEN
        if keep_last is not None:
            return [text[-TRUNCATION_MARGIN * keep_last * per_token:] for text in texts]
        limit = self.worker.max_embedding_tokens
        for i, text in enumerate(texts):
            if len(text) > limit * per_token:
                raise RequestError(
                    f"input[{i}] is {len(text)} characters, more than the {limit} tokens the model embeds can hold "
                    f"(at most {per_token} characters a token); shorten it, or set truncate_prompt_tokens to embed "
                    "its last tokens only", param="input", code="context_length_exceeded")
        return texts

    def check_embedding_lengths(self, token_lists: list[list[int]]) -> None:
        """Inputs longer than the model embeds are refused, as OpenAI does, not cut silently."""
        limit = self.worker.max_embedding_tokens
        for i, tokens in enumerate(token_lists):
            if len(tokens) > limit:
                raise RequestError(
                    f"input[{i}] is {len(tokens)} tokens, more than the model's maximum of {limit} for embeddings; "
                    f"shorten it, or set truncate_prompt_tokens to embed its last tokens only",
                    param="input", code="context_length_exceeded")

    @contextlib.contextmanager
    def engine_errors(self, prompt_field: str):
        """The engine's refusal of a prompt (engine/errors.py) becomes a RequestError naming prompt_field, the
        request field the prompt came from; its RuntimeError once it is lost or stopped becomes EngineUnavailable
        (503). Anything else it raises is our bug (500)."""
        try:
            yield
        except PromptRejected as exc:
            raise RequestError(str(exc), param=prompt_field) from exc
        except RuntimeError as exc:
            reason = self.worker.unavailable
            if reason is None:
                raise
            raise EngineUnavailable(f"the engine cannot serve requests: {reason}") from exc

    def start_engine_report(self) -> None:
        """The periodic engine line (handler/logs.py), started with the first chat request on this loop."""
        loop = asyncio.get_running_loop()
        if self._engine_report is None or self._engine_report.get_loop() is not loop:
            self._engine_report = loop.create_task(
                report_engine(self.handler_stats, lambda: self.replies.generated_tokens, self._engine_log_interval))
