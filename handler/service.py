"""The request handlers: chat_completions, tokenize, embeddings, and the extras models and stats.

Each takes the request's `data` and returns (or, for chat, yields) reply payloads; an exception becomes
the request's error reply. Chat runs on the engine Worker through a per-request queue of outputs.
Encoding (chat templates, tokenizing) runs on a small pool of threads, each with its own copy of the tokenizer,
so a long prompt neither holds up the event loop that streams every other request's chunks nor the encoding of
the requests behind it. A request cancelled while its encoding waits for a thread is never encoded; one
cancelled while encoding (a template render cannot be interrupted) is dropped once it ends, before the engine
sees it.
"""

import asyncio
import copy
import dataclasses
import itertools
import threading
from concurrent.futures import ThreadPoolExecutor

from engine import Worker
from handler.chat import ChatModel, RequestError, max_chars_per_token, parse_chat_request, sampling_defaults, type_name
from handler.detokenizer import Detokenizer
from handler.settings import HandlerSettings
from handler.tokenizer import embedding_token_ids

ENCODER_THREADS = 4  # requests encoded at once


class Service:
    def __init__(self, worker: Worker, tokenizer, model_name: str, settings: HandlerSettings | None = None):
        settings = settings or HandlerSettings()
        self.worker = worker
        self.tokenizer = tokenizer  # decoding, on the event loop
        self.model_name = model_name
        tokenizer_eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        eos = tuple(dict.fromkeys([*worker.eos_token_ids, *tokenizer_eos]))
        # Copies: tokenizers refuses to use one tokenizer from two threads while one reconfigures it (truncation).
        # This one is only copied from, by each encoding thread as it starts.
        self.chat_model = ChatModel(copy.deepcopy(tokenizer), worker.max_model_len, eos,
                                    sampling_defaults(worker.model_dir), max_chars_per_token(tokenizer),
                                    settings.trust_request_chat_template)
        self._encoder_state = threading.local()
        self.encoder = ThreadPoolExecutor(ENCODER_THREADS, thread_name_prefix="encoder",
                                          initializer=self._start_encoder_thread)
        self._request_ids = itertools.count(1)

    def _start_encoder_thread(self) -> None:
        self._encoder_state.chat_model = dataclasses.replace(self.chat_model,
                                                             tokenizer=copy.deepcopy(self.chat_model.tokenizer))

    async def encode(self, job):
        """job(chat_model) on an encoding thread, with that thread's own ChatModel (its own tokenizer)."""
        state = self._encoder_state
        return await asyncio.get_running_loop().run_in_executor(self.encoder, lambda: job(state.chat_model))

    async def chat_completions(self, data):
        """Streams {"content", "finish_reason"} chunks; the last one has a finish_reason and usage."""
        if self.worker.kind != "decoder":
            raise RequestError(f"{self.model_name} is an embedding model: it serves embeddings, not chat")
        request = await self.encode(lambda chat_model: parse_chat_request(data, chat_model))
        request_id = f"chat-{next(self._request_ids)}"
        completion = Completion(Detokenizer(self.tokenizer.backend_tokenizer, request.prompt_token_ids, request.stop))
        outputs = self.worker.submit(request_id, request.prompt_token_ids, request.params)
        try:
            while completion.finish_reason is None:
                batch = [await outputs.get()]
                while not outputs.empty():  # coalesce whatever already arrived into one chunk
                    batch.append(outputs.get_nowait())
                content = "".join(completion.consume(output) for output in batch)
                if completion.finish_reason is not None:
                    yield {"content": content, "finish_reason": completion.finish_reason,
                           "usage": usage(len(request.prompt_token_ids), completion.num_tokens)}
                elif content:
                    yield {"content": content, "finish_reason": None}
        finally:
            if not completion.engine_finished:  # cancelled, disconnected or cut by a stop string: free its blocks
                self.worker.abort(request_id)

    async def tokenize(self, data):
        texts = field(data, "input")
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, list) or not texts:
            raise RequestError(f"input must be a non-empty list of strings, got {type_name(texts)}")
        for i, text in enumerate(texts):
            if not isinstance(text, str) or not text:
                raise RequestError(f"input[{i}] must be a non-empty string, got {text!r}")
        tokens = await self.encode(lambda chat_model: embedding_token_ids(chat_model.tokenizer, texts,
                                                                          self.worker.max_model_len))
        return {"tokens": tokens}

    async def embeddings(self, data):
        token_lists = field(data, "input")
        if not isinstance(token_lists, list) or not token_lists:
            raise RequestError(f"input must be a non-empty list of token id lists, got {type_name(token_lists)}")
        for i, tokens in enumerate(token_lists):
            check_token_list(tokens, f"input[{i}]", self.worker.max_model_len)
        return {"embeddings": await self.worker.embed(token_lists)}  # the worker checks the vocabulary range

    async def models(self, data):
        return {"id": self.model_name, "kind": self.worker.kind, "max_model_len": self.worker.max_model_len,
                "hidden_size": self.worker.hidden_size}

    async def stats(self, data):
        return self.worker.stats()


class Completion:
    """One request's generated text, from the engine's outputs: finish reason, stop strings, token count."""

    def __init__(self, detokenizer: Detokenizer):
        self.detokenizer = detokenizer
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.engine_finished = False  # the engine finished the request itself (nothing to abort)

    def consume(self, output) -> str:
        """The text one engine output adds; nothing once the completion has finished."""
        if self.finish_reason is not None:
            return ""
        if output.finish_reason == "error":
            self.engine_finished = True
            raise RuntimeError(f"the engine failed on this request: {output.error}")
        token_ids = output.new_token_ids
        stop_token = output.finish_reason == "stop" and bool(token_ids)
        pieces = []
        for token_id in token_ids[:-1] if stop_token else token_ids:  # a stop token is not text
            self.num_tokens += 1
            pieces.append(self.detokenizer.add(token_id))
            if self.detokenizer.stopped:
                self.finish_reason = "stop"
                return "".join(pieces)
        if output.finish_reason is not None:
            self.num_tokens += stop_token
            self.engine_finished = True
            self.finish_reason = output.finish_reason
            pieces.append(self.detokenizer.flush())
        return "".join(pieces)


def check_token_list(tokens, where: str, max_length: int) -> None:
    if not isinstance(tokens, list) or not tokens:
        raise RequestError(f"{where} must be a non-empty list of token ids, got {type_name(tokens)}")
    if len(tokens) > max_length:
        raise RequestError(f"{where} has {len(tokens)} tokens, more than the model's maximum of {max_length}")
    if not all(isinstance(token, int) and not isinstance(token, bool) for token in tokens):
        raise RequestError(f"{where} must hold integer token ids only")


def field(data, name: str):
    if not isinstance(data, dict):
        raise RequestError(f"request data must be a map, got {type_name(data)}")
    if data.get(name) is None:
        raise RequestError(f"{name} is required")
    return data[name]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
