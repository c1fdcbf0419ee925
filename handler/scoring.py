"""Scoring text pairs with a cross-encoder: the handler's `score` call (docs/scoring.md).

The front maps vLLM's /v1/score, /v1/rerank and TEI's /rerank onto pairs (`text_1`, `text_2`); here each pair is
tokenized as the model's tokenizer joins two texts ([CLS] a [SEP] b [SEP]), run through the encoder and its
classification head (models/bert.py's BertClassifier, on the engine thread like embeddings), and its one logit
becomes a score: the sigmoid of it, as sentence-transformers' CrossEncoder gives, or the logit itself with
`raw_scores`. A pair longer than the model takes is refused unless `truncate` asks to cut it (the longer text
first, as CrossEncoder's tokenizer call does).
"""
from dataclasses import dataclass

import torch

from daemon_protocol import RequestError
from schema import ScoreRequest as ScoreFields, decode

MAX_PAIRS = 1024


@dataclass(frozen=True)
class ScoreRequest:
    firsts: list[str]
    seconds: list[str]
    raw_scores: bool
    truncate: bool


def parse_score_request(data) -> ScoreRequest:
    """text_1 and text_2: strings or lists of strings (schema/scoring.py); one text_1 goes with each text_2, else
    they pair up in order (vLLM's rule)."""
    request = decode(data, ScoreFields)
    firsts, seconds = texts(request.text_1), texts(request.text_2)
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise RequestError(f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, or as many "
                           "as text_2", param="text_1")
    if len(seconds) > MAX_PAIRS:
        raise RequestError(f"text_2: at most {MAX_PAIRS} pairs in one request, got {len(seconds)}", param="text_2")
    return ScoreRequest(firsts, seconds, request.raw_scores, request.truncate)


def texts(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else value


def pair_token_ids(tokenizer, request: ScoreRequest, limit: int) -> list[list[int]]:
    """Each pair's token ids, as the tokenizer joins two texts; longer than limit is refused, or with truncate cut
    to it. Runs on an encoding thread, on its own tokenizer (handler/service.py)."""
    tokenizer.truncation_side = "right"  # read at each call; embedding inputs set it to "left"
    cut = {"truncation": "longest_first", "max_length": limit} if request.truncate else {}
    encoded = tokenizer(request.firsts, request.seconds, add_special_tokens=True, verbose=False, **cut)
    token_lists = [list(ids) for ids in encoded["input_ids"]]
    for i, tokens in enumerate(token_lists):
        if len(tokens) > limit:
            raise RequestError(f"pair {i} is {len(tokens)} tokens, more than the model's maximum of {limit}; shorten "
                               "its texts, or set truncate to cut the longer one", param="text_2",
                               code="context_length_exceeded")
    return token_lists


def scores(logits: list[list[float]], raw: bool) -> list[float]:
    """One score per pair from its logits: the sigmoid of its one logit (the logit itself when raw)."""
    values = torch.tensor(logits, dtype=torch.float32)[:, 0]
    return (values if raw else torch.sigmoid(values)).tolist()
