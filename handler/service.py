"""The request handlers: chat_completions, tokenize, embeddings, and the extras models and stats.

Each takes the request's `data` and returns (or, for chat, yields) reply payloads; an exception becomes
the request's error reply. Chat runs on the engine Worker through a per-request queue of outputs.
Encoding (chat templates, tokenizing) runs on a thread of its own, with its own copy of the tokenizer, so a
long prompt does not hold up the event loop that streams every other request's chunks.
"""

import asyncio
import copy
import itertools
from concurrent.futures import ThreadPoolExecutor

from engine import Worker
from handler.chat import ChatModel, RequestError, parse_chat_request, sampling_defaults, type_name
from handler.choices import ChatReplies
from handler.grammar import Grammars
from handler.tokenizer import embedding_token_ids


class Service:
    def __init__(self, worker: Worker, tokenizer, model_name: str):
        self.worker = worker
        self.tokenizer = tokenizer  # decoding, on the event loop
        self.model_name = model_name
        tokenizer_eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        eos = tuple(dict.fromkeys([*worker.eos_token_ids, *tokenizer_eos]))
        # A copy: tokenizers refuses to use one tokenizer from two threads while one reconfigures it
        # (truncation), so the encoding thread shares nothing with the loop's decoding.
        encoding_tokenizer = copy.deepcopy(tokenizer)
        grammars = Grammars(encoding_tokenizer, worker.vocab_size, eos) if worker.kind == "decoder" else None
        self.chat_model = ChatModel(encoding_tokenizer, worker.max_model_len, eos, sampling_defaults(worker.model_dir),
                                    worker.vocab_size, grammars)
        self.replies = ChatReplies(tokenizer, grammars.token_bytes if grammars else None)
        self.encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encoder")
        self._request_ids = itertools.count(1)

    async def encode(self, function, *args):
        """function(*args) on the encoding thread."""
        return await asyncio.get_running_loop().run_in_executor(self.encoder, function, *args)

    async def chat_completions(self, data):
        """Streams reply chunks (docs/chat-extensions.md); the last one has a finish_reason and usage."""
        if self.worker.kind != "decoder":
            raise RequestError(f"{self.model_name} is an embedding model: it serves embeddings, not chat")
        request = await self.encode(parse_chat_request, data, self.chat_model)
        async for chunk in self.replies.stream(self.worker, request, f"chat-{next(self._request_ids)}"):
            yield chunk

    async def tokenize(self, data):
        texts = field(data, "input")
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, list) or not texts:
            raise RequestError(f"input must be a non-empty list of strings, got {type_name(texts)}")
        for i, text in enumerate(texts):
            if not isinstance(text, str) or not text:
                raise RequestError(f"input[{i}] must be a non-empty string, got {text!r}")
        tokens = await self.encode(embedding_token_ids, self.chat_model.tokenizer, texts, self.worker.max_model_len)
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
