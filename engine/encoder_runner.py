"""Runs an encoder model for embeddings: pack token lists, forward, pool, normalise.

Inputs are sorted longest first and packed without padding into batches of at most
config.max_embedding_batch_tokens tokens; vectors come back in the caller's order.
"""
import torch
import torch.nn.functional as F
from torch import Tensor

from models.pooling import read_pooling_config, pool

# Pooling for encoders whose directory does not say (no sentence-transformers modules.json).
DEFAULT_ENCODER_POOLING = "cls"


class EncoderRunner:

    def __init__(self, config, loaded):
        self.model = loaded.model
        self.device = next(self.model.parameters()).device
        self.vocab_size = loaded.hf_config.vocab_size
        self.hidden_size = loaded.hf_config.hidden_size
        self.pooling = read_pooling_config(loaded.model_dir, DEFAULT_ENCODER_POOLING)
        self.max_model_len = min(config.max_model_len, self.pooling.max_seq_length or self.model.max_positions,
                                 self.model.max_positions)
        self.max_batch_tokens = max(config.max_embedding_batch_tokens, self.max_model_len)
        if self.device.type == "cuda":
            self.warm_up()

    def warm_up(self) -> None:
        """Compile the GPU kernels' variants (they specialise on the longest sequence's power-of-two tile)
        now, so the first requests do not wait for it."""
        for length in sorted({min(2 ** i, self.max_model_len) for i in range(4, 8)}):
            self.embed([[0] * length])

    def truncate(self, tokens: list[int]) -> list[int]:
        """Cut an over-long input to max_model_len, keeping its last token.

        The tokenizer ends an encoder's input with a special token ([SEP], </s>); sentence-transformers
        truncates the text and then appends it, so keeping the head and the last token yields the same
        ids as it would for the untruncated token list.
        """
        if len(tokens) <= self.max_model_len:
            return tokens
        return tokens[:self.max_model_len - 1] + tokens[-1:]

    def check(self, token_lists: list[list[int]]) -> None:
        for i, tokens in enumerate(token_lists):
            if not tokens:
                raise ValueError(f"input {i} is empty: every input needs at least one token")
            low, high = min(tokens), max(tokens)
            if low < 0 or high >= self.vocab_size:
                bad = low if low < 0 else high
                raise ValueError(f"input {i} has token id {bad}, outside the vocabulary [0, {self.vocab_size})")

    def batches(self, token_lists: list[list[int]]) -> list[list[int]]:
        """Indices of the inputs, longest first, grouped so each group fits the token budget."""
        order = sorted(range(len(token_lists)), key=lambda i: -len(token_lists[i]))
        groups, group, group_tokens = [], [], 0
        for i in order:
            length = len(token_lists[i])
            if group and group_tokens + length > self.max_batch_tokens:
                groups.append(group)
                group, group_tokens = [], 0
            group.append(i)
            group_tokens += length
        if group:
            groups.append(group)
        return groups

    def run_batch(self, token_lists: list[list[int]]) -> Tensor:
        """Pooled (and, if the model says so, normalised) float32 vectors [B, H] for one packed batch."""
        lengths = torch.tensor([len(tokens) for tokens in token_lists])
        cu_seqlens = torch.zeros(len(token_lists) + 1, dtype=torch.int32)
        torch.cumsum(lengths, 0, out=cu_seqlens[1:])
        input_ids = torch.tensor([t for tokens in token_lists for t in tokens], dtype=torch.int64)
        positions = torch.arange(len(input_ids)) - torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)
        pinned = self.device.type == "cuda"
        input_ids, positions, cu_seqlens = (
            (t.pin_memory() if pinned else t).to(self.device, non_blocking=True)
            for t in (input_ids, positions, cu_seqlens))
        hidden = self.model(input_ids, positions, cu_seqlens, int(lengths.max()))
        vectors = pool(hidden, cu_seqlens, self.pooling.mode)
        return F.normalize(vectors, dim=-1) if self.pooling.normalize else vectors

    @torch.inference_mode()
    def embed(self, token_lists: list[list[int]]) -> Tensor:
        """One float32 vector per input [n, H] on the CPU, in the order given; bad input -> ValueError."""
        self.check(token_lists)
        token_lists = [self.truncate(tokens) for tokens in token_lists]
        out = torch.empty(len(token_lists), self.hidden_size, dtype=torch.float32)
        for group in self.batches(token_lists):
            vectors = self.run_batch([token_lists[i] for i in group])
            out[torch.tensor(group)] = vectors.cpu()
        return out
