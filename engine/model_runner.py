"""Owns a decoder model and its KV cache; turns a scheduled step into one forward pass and sampled ids.

Step inputs are built in one vectorised numpy pass and reach the device in two copies (one int64, one
int32 buffer, pinned on CUDA). Pure-decode steps replay a CUDA graph captured at start-up for the next
batch size up on a ladder; padding rows write to slot -1 and read block 0, so they change nothing.
"""
import bisect
import itertools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from engine.config import EngineConfig
from engine.sampler import Sampler
from engine.sequence import Sequence
from kernels import AttentionMetadata
from models.pooling import read_pooling_config, pool

DEFAULT_DECODER_POOLING = "last"


@dataclass
class StepInputs:
    input_ids: Tensor
    positions: Tensor
    meta: AttentionMetadata
    logits_indices: Tensor  # rows of the hidden states that sample
    sample_rows: list[int]  # which of the step's sequences sample


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded):
        self.config = config
        self.model = loaded.model
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        self.block_size = config.block_size
        self.vocab_size = loaded.hf_config.vocab_size
        self.hidden_size = loaded.hf_config.hidden_size
        self.pooling = read_pooling_config(loaded.model_dir, DEFAULT_DECODER_POOLING)
        self.sampler = Sampler(self.device)
        self.max_model_len = min(config.max_model_len, loaded.hf_config.max_position_embeddings)
        self.can_generate = getattr(self.model, "lm_head", None) is not None  # bare decoders only embed
        self.num_blocks = self._allocate_kv_cache() if self.can_generate else 0
        if self.can_generate:
            self.max_model_len = min(self.max_model_len, self.num_blocks * self.block_size)  # one request fits
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if self.can_generate and self.device.type == "cuda" and not config.enforce_eager:
            self._capture_decode_graphs()

    # ---- KV cache -------------------------------------------------------------------------------

    def _allocate_kv_cache(self) -> int:
        shape = self.model.kv_cache_shape(1, self.block_size)
        block_bytes = 2 * int(np.prod(shape)) * self.dtype.itemsize
        num_blocks = self.config.num_kv_blocks or (
            self._blocks_fitting_gpu(block_bytes) if self.device.type == "cuda"
            else self._blocks_fitting_cpu(block_bytes))
        if num_blocks < 1:
            raise RuntimeError(f"no memory left for the KV cache (a block needs {block_bytes} bytes): raise "
                               "HFENDPOINT_GPU_MEMORY_UTILIZATION / HFENDPOINT_CPU_KV_CACHE_GB or lower "
                               "HFENDPOINT_MAX_BATCHED_TOKENS")
        num_layers, *layer_shape = self.model.kv_cache_shape(num_blocks, self.block_size)
        k_caches, v_caches = ([torch.zeros(layer_shape, dtype=self.dtype, device=self.device)
                               for _ in range(num_layers)] for _ in range(2))
        self.model.set_kv_cache(k_caches, v_caches)
        return num_blocks

    def _blocks_fitting_cpu(self, block_bytes: int) -> int:
        budget = int(self.config.cpu_kv_cache_gb * 2**30) // block_bytes
        most_ever_used = self.config.max_num_seqs * -(-self.max_model_len // self.block_size)
        return min(budget, most_ever_used)

    def _blocks_fitting_gpu(self, block_bytes: int) -> int:
        """What gpu_memory_utilization leaves after the weights and a full-budget forward's activations."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_forward()
        free, total = torch.cuda.mem_get_info(self.device)
        peak_extra = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
        budget = total * self.config.gpu_memory_utilization - (total - free) - peak_extra
        return int(budget) // block_bytes

    @torch.inference_mode()
    def _profile_forward(self) -> None:
        """The largest step the scheduler can build: max_num_batched_tokens in sequences of max_model_len,
        then logits and sampling for max_num_seqs rows."""
        num_tokens = self.config.max_num_batched_tokens
        lengths = [self.max_model_len] * (num_tokens // self.max_model_len) + [num_tokens % self.max_model_len]
        hidden = self._forward_cacheless([[0] * n for n in lengths if n])
        num_rows = min(self.config.max_num_seqs, num_tokens)
        logits = self.model.compute_logits(hidden[:1].expand(num_rows, -1).contiguous())
        torch.softmax(logits, -1).argmax(-1)
        torch.cuda.synchronize(self.device)

    # ---- step inputs ----------------------------------------------------------------------------

    def _to_device(self, array: np.ndarray) -> Tensor:
        tensor = torch.from_numpy(array)
        if self.device.type != "cuda":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def prepare(self, seqs: list[Sequence], num_tokens: list[int], pad_to: int | None = None) -> StepInputs:
        """Packs the step's new tokens; pad_to adds dummy decode rows up to a captured graph's batch size."""
        num_seqs = len(seqs)
        counts = np.array(num_tokens, dtype=np.int64)
        starts = np.array([seq.num_computed_tokens for seq in seqs], dtype=np.int64)
        cu_seqlens = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(counts, out=cu_seqlens[1:])
        total = int(cu_seqlens[-1])
        input_ids = np.fromiter(itertools.chain.from_iterable(
            seq.token_ids[start:start + n] for seq, start, n in zip(seqs, starts.tolist(), num_tokens)),
            dtype=np.int64, count=total)
        positions = np.arange(total) - np.repeat(cu_seqlens[:-1] - starts, counts)
        seq_lens = starts + counts
        max_seqlen_k = self.max_model_len if pad_to else int(seq_lens.max())  # a graph serves any length
        width = -(-max_seqlen_k // self.block_size)
        block_tables = np.full((pad_to or num_seqs, width), -1, dtype=np.int64)
        for row, seq in enumerate(seqs):
            block_tables[row, :len(seq.block_table)] = seq.block_table
        rows = np.repeat(np.arange(num_seqs), counts)
        slot_mapping = block_tables[rows, positions // self.block_size] * self.block_size + positions % self.block_size
        samples = seq_lens == np.array([len(seq) for seq in seqs])
        logits_indices = cu_seqlens[1:][samples] - 1
        if pad_to:  # dummy rows: token 0 at position 0, no cache write, one key read from block 0
            pad = pad_to - num_seqs
            input_ids, positions = np.pad(input_ids, (0, pad)), np.pad(positions, (0, pad))
            slot_mapping = np.pad(slot_mapping, (0, pad), constant_values=-1)
            seq_lens = np.pad(seq_lens, (0, pad), constant_values=1)
            cu_seqlens = np.arange(pad_to + 1)
            block_tables[num_seqs:, 0] = 0
        longs = self._to_device(np.concatenate([input_ids, positions, slot_mapping, logits_indices]))
        ints = self._to_device(np.concatenate([cu_seqlens, seq_lens, block_tables.ravel()]).astype(np.int32))
        n_tok, n_rows = len(input_ids), len(seq_lens)
        input_ids, positions, slot_mapping, logits_indices = longs.split([n_tok, n_tok, n_tok, len(logits_indices)])
        cu_seqlens, seq_lens, block_tables = ints.split([n_rows + 1, n_rows, block_tables.size])
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, cu_seqlens_q=cu_seqlens, seq_lens=seq_lens,
            block_tables=block_tables.view(n_rows, width), max_seqlen_q=int(counts.max()),
            max_seqlen_k=max_seqlen_k,
            is_decode=bool((counts == 1).all()))
        return StepInputs(input_ids, positions, meta, logits_indices, np.flatnonzero(samples).tolist())

    # ---- running steps --------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], num_tokens: list[int]) -> list[int | None]:
        """Computes the step; returns the sampled token of each sequence (None: a prompt chunk that does
        not reach the end of its tokens)."""
        graph_size = self._graph_size(num_tokens)
        step = self.prepare(seqs, num_tokens, pad_to=graph_size)
        if graph_size:
            hidden = self._replay(graph_size, step)
        else:
            hidden = self.model(step.input_ids, step.positions, step.meta)
        sampled = [None] * len(seqs)
        if step.sample_rows:
            logits = self.model.compute_logits(hidden[step.logits_indices])
            token_ids = self.sampler(logits, [seqs[i] for i in step.sample_rows]).tolist()
            for row, token_id in zip(step.sample_rows, token_ids):
                sampled[row] = token_id
        return sampled

    def _graph_size(self, num_tokens: list[int]) -> int | None:
        """The captured batch size to replay for this step; None runs it eagerly."""
        if not self.graphs or len(num_tokens) > self.graph_sizes[-1] or any(n != 1 for n in num_tokens):
            return None
        return self.graph_sizes[bisect.bisect_left(self.graph_sizes, len(num_tokens))]

    def _capture_decode_graphs(self) -> None:
        max_size = self.config.max_num_seqs
        self.graph_sizes = sorted({s for s in [1, 2, 4, 8, *range(16, max_size + 1, 8), max_size] if s <= max_size})
        self.static = {
            "input_ids": torch.zeros(max_size, dtype=torch.int64, device=self.device),
            "positions": torch.zeros(max_size, dtype=torch.int64, device=self.device),
            "slot_mapping": torch.full((max_size,), -1, dtype=torch.int64, device=self.device),
            "cu_seqlens_q": torch.arange(max_size + 1, dtype=torch.int32, device=self.device),
            "seq_lens": torch.ones(max_size, dtype=torch.int32, device=self.device),
            "block_tables": torch.zeros(max_size, self.max_blocks_per_seq, dtype=torch.int32, device=self.device),
            "hidden": torch.zeros(max_size, self.hidden_size, dtype=self.dtype, device=self.device),
        }
        pool_handle = None
        with torch.inference_mode():
            for size in reversed(self.graph_sizes):
                graph = torch.cuda.CUDAGraph()
                self._graph_body(size)  # warm-up: compiles kernels, settles allocations
                torch.cuda.synchronize(self.device)
                with torch.cuda.graph(graph, pool_handle):
                    self._graph_body(size)
                pool_handle = graph.pool()
                self.graphs[size] = graph
        torch.cuda.synchronize(self.device)

    def _graph_body(self, size: int) -> None:
        s = self.static
        meta = AttentionMetadata(
            slot_mapping=s["slot_mapping"][:size], cu_seqlens_q=s["cu_seqlens_q"][:size + 1],
            seq_lens=s["seq_lens"][:size], block_tables=s["block_tables"][:size],
            max_seqlen_q=1, max_seqlen_k=self.max_model_len, is_decode=True)
        s["hidden"][:size] = self.model(s["input_ids"][:size], s["positions"][:size], meta)

    def _replay(self, size: int, step: StepInputs) -> Tensor:
        s, meta = self.static, step.meta
        for name, value in (("input_ids", step.input_ids), ("positions", step.positions),
                            ("slot_mapping", meta.slot_mapping), ("seq_lens", meta.seq_lens),
                            ("block_tables", meta.block_tables)):
            s[name][:size].copy_(value, non_blocking=True)
        self.graphs[size].replay()
        return s["hidden"][:size]

    # ---- embeddings -----------------------------------------------------------------------------

    def _forward_cacheless(self, token_lists: list[list[int]]) -> Tensor:
        """Hidden states [T, H] of packed sequences, attending only within each (the KV cache untouched)."""
        lengths = np.array([len(tokens) for tokens in token_lists], dtype=np.int64)
        cu_seqlens = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=cu_seqlens[1:])
        input_ids = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64, count=int(cu_seqlens[-1]))
        positions = np.arange(len(input_ids)) - np.repeat(cu_seqlens[:-1], lengths)
        longs = self._to_device(np.concatenate([input_ids, positions]))
        ints = self._to_device(np.concatenate([cu_seqlens, lengths]).astype(np.int32))
        cu, seq_lens = ints.split([len(cu_seqlens), len(lengths)])
        meta = AttentionMetadata(slot_mapping=None, cu_seqlens_q=cu, seq_lens=seq_lens, block_tables=None,
                                 max_seqlen_q=int(lengths.max()), max_seqlen_k=int(lengths.max()), is_decode=False)
        return self.model(*longs.split(len(input_ids)), meta)

    @torch.inference_mode()
    def embed(self, token_lists: list[list[int]]) -> Tensor:
        """Pooled float32 vectors [n, H] on the CPU, normalised if the model's pooling config says so.
        Inputs longer than max_model_len keep their head and their last token (the end-of-text marker
        that last-token pooling reads)."""
        limit = min(self.max_model_len, self.pooling.max_seq_length or self.max_model_len)
        token_lists = [tokens if len(tokens) <= limit else tokens[:limit - 1] + tokens[-1:] for tokens in token_lists]
        out = torch.empty(len(token_lists), self.hidden_size, dtype=torch.float32)
        budget = max(self.config.max_embedding_batch_tokens, limit)
        start = 0
        while start < len(token_lists):
            end, used = start, 0
            while end < len(token_lists) and (end == start or used + len(token_lists[end]) <= budget):
                used += len(token_lists[end])
                end += 1
            batch = token_lists[start:end]
            cu_seqlens = torch.tensor([0, *itertools.accumulate(map(len, batch))], dtype=torch.int32,
                                      device=self.device)
            vectors = pool(self._forward_cacheless(batch), cu_seqlens, self.pooling.mode)
            out[start:end] = (F.normalize(vectors, dim=-1) if self.pooling.normalize else vectors).cpu()
            start = end
        return out
