"""Embeddings the same way for every model: check, pack longest first without padding into batches
within a token budget, forward, pool and normalise as the model declares, and return in the caller's order.
The decoder's ModelRunner and the EncoderRunner differ only in the forward they pass in."""
import itertools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from models.pooling import PoolingConfig, pool


def max_input_tokens(max_model_len: int, pooling: PoolingConfig) -> int:
    """The longest input the model embeds: its context, or sentence-transformers' max_seq_length when shorter."""
    return min(max_model_len, pooling.max_seq_length or max_model_len)


def check_inputs(token_lists: list[list[int]], vocab_size: int, max_tokens: int) -> None:
    """ValueError naming the first input that is empty, longer than max_tokens (inputs are refused, not cut:
    truncation is the caller's choice) or holds an id outside the vocabulary."""
    if not token_lists:
        raise ValueError("no inputs to embed")
    for i, tokens in enumerate(token_lists):
        if not tokens:
            raise ValueError(f"input {i} is empty: every input needs at least one token")
        if len(tokens) > max_tokens:
            raise ValueError(f"input {i} has {len(tokens)} tokens, more than the model's limit of {max_tokens}")
        low, high = min(tokens), max(tokens)
        if low < 0 or high >= vocab_size:
            raise ValueError(f"input {i} has token id {low if low < 0 else high}, outside the vocabulary "
                             f"[0, {vocab_size})")


def longest_first_batches(token_lists: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Indices of the inputs, longest first, grouped so that each group fits the token budget."""
    order = sorted(range(len(token_lists)), key=lambda i: -len(token_lists[i]))
    groups, group, group_tokens = [], [], 0
    for i in order:
        length = len(token_lists[i])
        if group and group_tokens + length > max_tokens:
            groups.append(group)
            group, group_tokens = [], 0
        group.append(i)
        group_tokens += length
    if group:
        groups.append(group)
    return groups


def pack(token_lists: list[list[int]], device: torch.device) -> tuple[Tensor, Tensor, Tensor, int]:
    """Packed input ids and positions (int64), cu_seqlens (int32) on the device, and the longest length."""
    lengths = torch.tensor([len(tokens) for tokens in token_lists])
    cu_seqlens = torch.zeros(len(token_lists) + 1, dtype=torch.int32)
    torch.cumsum(lengths, 0, out=cu_seqlens[1:])
    input_ids = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.int64)
    positions = torch.arange(len(input_ids)) - torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)
    on_cuda = device.type == "cuda"
    input_ids, positions, cu_seqlens = ((t.pin_memory() if on_cuda else t).to(device, non_blocking=True)
                                        for t in (input_ids, positions, cu_seqlens))
    return input_ids, positions, cu_seqlens, int(lengths.max())


def embed(token_lists: list[list[int]], forward: Callable[[list[list[int]]], tuple[Tensor, Tensor]],
          pooling: PoolingConfig, limit: int, max_batch_tokens: int, hidden_size: int) -> Tensor:
    """One float32 vector per input [n, H] on the CPU, in the order given, for inputs check_inputs() passed
    with `limit`. forward(batch) returns the packed hidden states [T, H] of a batch of token lists and the
    cu_seqlens it packed them with."""
    out = torch.empty(len(token_lists), hidden_size, dtype=torch.float32)
    for group in longest_first_batches(token_lists, max(max_batch_tokens, limit)):
        hidden, cu_seqlens = forward([token_lists[i] for i in group])
        vectors = pool(hidden, cu_seqlens, pooling.mode)
        out[torch.tensor(group)] = (F.normalize(vectors, dim=-1) if pooling.normalize else vectors).float().cpu()
    return out
