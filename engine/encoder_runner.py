"""Runs an encoder model for embeddings (engine/embedding.py packs, pools and normalises)."""
import torch
from torch import Tensor

from engine.embedding import check_inputs, embed, pack
from models.pooling import read_pooling_config

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

    def forward(self, batch: list[list[int]]) -> tuple[Tensor, Tensor]:
        input_ids, positions, cu_seqlens, max_len = pack(batch, self.device)
        return self.model(input_ids, positions, cu_seqlens, max_len), cu_seqlens

    @torch.inference_mode()
    def embed(self, token_lists: list[list[int]]) -> Tensor:
        """One float32 vector per input [n, H] on the CPU, in the order given; bad input -> ValueError."""
        check_inputs(token_lists, self.vocab_size, self.max_model_len)
        return embed(token_lists, self.forward, self.pooling, self.max_model_len, self.max_batch_tokens,
                     self.hidden_size)
