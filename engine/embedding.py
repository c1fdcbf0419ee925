"""Embeddings the same way for every model: check, pack longest first without padding into batches
within a token budget, forward, pool and normalise as the model declares, and return in the caller's order.
Decoders and encoders differ only in the forward an Embedder is given: a decoder's runs through its
ModelRunner (on every tensor-parallel rank, its KV cache untouched), an encoder's is a plain call."""
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.errors import PromptRejected
from kernels import AttentionMetadata
from models.pooling import PoolingConfig, pool, read_pooling_config

# Pooling for models whose directory does not say (no sentence-transformers modules.json): decoders pool their
# last token, as Qwen3-Embedding does; encoders their [CLS] token.
DEFAULT_DECODER_POOLING = "last"
DEFAULT_ENCODER_POOLING = "cls"
Forward = Callable[[list[list[int]]], tuple[Tensor, Tensor]]  # a batch of token lists -> (hidden [T, H], cu_seqlens)


def check_inputs(token_lists: list[list[int]], vocab_size: int, max_tokens: int) -> None:
    """PromptRejected naming the first input that is empty, longer than max_tokens (inputs are refused, not cut:
    truncation is the caller's choice) or holds an id outside the vocabulary."""
    if not token_lists:
        raise PromptRejected("no inputs to embed")
    for i, tokens in enumerate(token_lists):
        if not tokens:
            raise PromptRejected(f"input {i} is empty: every input needs at least one token")
        if len(tokens) > max_tokens:
            raise PromptRejected(f"input {i} has {len(tokens)} tokens, more than the model's limit of {max_tokens}")
        low, high = min(tokens), max(tokens)
        if low < 0 or high >= vocab_size:
            raise PromptRejected(f"input {i} has token id {low if low < 0 else high}, outside the vocabulary "
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


def forward_decoder(model, token_lists: list[list[int]]) -> tuple[Tensor, Tensor]:
    """Hidden states [T, H] of packed sequences through a decoder, attending only within each (the KV cache
    untouched), and their cu_seqlens."""
    input_ids, positions, cu_seqlens, max_len = pack(token_lists, next(model.parameters()).device)
    seq_lens = cu_seqlens[1:] - cu_seqlens[:-1]
    meta = AttentionMetadata(slot_mapping=None, cu_seqlens_q=cu_seqlens, seq_lens=seq_lens, block_tables=None,
                             max_seqlen_q=max_len, max_seqlen_k=max_len, is_decode=False)
    return model(input_ids, positions, meta), cu_seqlens


def encoder_limit(config, model) -> int:
    """The longest input an encoder takes: its position table's, or HFENDPOINT_MAX_MODEL_LEN when set and shorter."""
    return min(config.max_model_len or model.max_positions, model.max_positions)


def forward_encoder(model, token_lists: list[list[int]]) -> tuple[Tensor, Tensor]:
    """Hidden states [T, H] of packed sequences through an encoder, and their cu_seqlens."""
    input_ids, positions, cu_seqlens, max_len = pack(token_lists, next(model.parameters()).device)
    return model(input_ids, positions, cu_seqlens, max_len), cu_seqlens


class Embedder:
    """One model's embeddings. max_model_len is the longest input it embeds: the model's limit, or the shorter
    max_seq_length its pooling config sets; longer inputs are refused (truncation is the caller's choice)."""

    def __init__(self, forward: Forward, pooling: PoolingConfig, model_limit: int, max_batch_tokens: int,
                 hidden_size: int, vocab_size: int, head: Callable[[Tensor], Tensor] | None = None):
        """head: what turns pooled vectors into the outputs (a cross-encoder's classifier: hidden_size is then its
        number of labels); None: the pooled vectors are the outputs."""
        self.forward, self.pooling, self.head = forward, pooling, head
        self.max_model_len = min(model_limit, pooling.max_seq_length or model_limit)
        self.max_batch_tokens = max(max_batch_tokens, self.max_model_len)
        self.hidden_size, self.vocab_size = hidden_size, vocab_size

    @classmethod
    def for_decoder(cls, config, loaded, forward: Forward, max_model_len: int) -> "Embedder":
        """forward: the decoder's packed forward (ModelRunner.forward_packed)."""
        pooling = read_pooling_config(loaded.model_dir, DEFAULT_DECODER_POOLING)
        return cls(forward, pooling, max_model_len, config.max_embedding_batch_tokens,
                   loaded.hf_config.hidden_size, loaded.hf_config.vocab_size)

    @classmethod
    def for_encoder(cls, config, loaded) -> "Embedder":
        """An encoder model's embedder; on CUDA it runs once at a few lengths first, so that the kernels'
        variants (they specialise on the longest sequence's power-of-two tile) compile now rather than at the
        first requests."""
        model = loaded.model
        pooling = read_pooling_config(loaded.model_dir, DEFAULT_ENCODER_POOLING)
        embedder = cls(lambda batch: forward_encoder(model, batch), pooling, encoder_limit(config, model),
                       config.max_embedding_batch_tokens, loaded.hf_config.hidden_size, loaded.hf_config.vocab_size)
        if next(model.parameters()).device.type == "cuda":
            for length in sorted({min(2 ** i, embedder.max_model_len) for i in range(4, 8)}):
                embedder.embed([[0] * length])
        return embedder

    @classmethod
    def for_classifier(cls, config, loaded) -> "Embedder":
        """A cross-encoder's scorer: the classifier head's logits [n, num_labels] from each pair's first token."""
        model = loaded.model
        return cls(lambda batch: forward_encoder(model, batch), PoolingConfig("cls", normalize=False,
                                                                              max_seq_length=None),
                   encoder_limit(config, model), config.max_embedding_batch_tokens, model.num_labels,
                   loaded.hf_config.vocab_size, head=model.classify)

    @torch.inference_mode()
    def embed(self, token_lists: list[list[int]]) -> Tensor:
        """One float32 vector per input [n, H] on the CPU, in the order given; bad input -> ValueError."""
        check_inputs(token_lists, self.vocab_size, self.max_model_len)
        out = torch.empty(len(token_lists), self.hidden_size, dtype=torch.float32)
        for group in longest_first_batches(token_lists, self.max_batch_tokens):
            hidden, cu_seqlens = self.forward([token_lists[i] for i in group])
            vectors = pool(hidden, cu_seqlens, self.pooling.mode)
            vectors = self.head(vectors) if self.head is not None else vectors
            normalized = F.normalize(vectors, dim=-1) if self.pooling.normalize else vectors
            out[torch.tensor(group)] = normalized.float().cpu()
        return out

