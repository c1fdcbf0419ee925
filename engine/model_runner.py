"""Owns a decoder model and its KV cache; turns a scheduled step into one forward pass and sampled ids.

Step inputs are written through numpy views into two pinned host buffers allocated once (one int64, one
int32) and reach the device in one non-blocking copy each, into device buffers that are also the inputs of
the captured CUDA graphs, so a step replays a graph with no further copies. A pure-decode step replays the
graph of the next batch size up on a ladder, padded with one-token rows that write to slot -1 and read one
key. Any other step of at most PREFILL_GRAPH_MAX_TOKENS tokens replays the graph of the next token count up,
padded with empty rows to max_num_seqs and with tokens that no row owns (slot -1, never attended): an eager
forward costs more host time than a prefill of that size takes on the GPU. Each row of the staged block
table remembers which sequence's table it holds, so a decode step writes only blocks that are new.

A step is launched (staged, uploaded, run and sampled, its sampled ids copied towards pinned host memory)
and finished (its ids read once they have arrived) in two calls, so the engine can launch the next step
before reading this one's ids. Such a step's leading requests continue the one in flight: it stages, in
place of their input ids, the rows of that step's sampled ids they take; the device swaps the ids in before
the forward (see execute).
"""
import bisect
import functools
import itertools
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from engine.config import EngineConfig
from engine.embedding import embed, max_input_tokens, pack
from engine.sampler import Sampler
from engine.sequence import Sequence
from kernels import AttentionMetadata, gumbel_argmax
from models.parallel_layers import min_over_ranks, tp_rank, tp_size
from models.pooling import read_pooling_config

DEFAULT_DECODER_POOLING = "last"
PREFILL_GRAPH_MAX_TOKENS = 2048  # past this a prefill's GPU time covers its launches, and padding costs more


@dataclass(frozen=True)
class GraphShape:
    """The padded shape a captured graph runs. Decode graphs pad with one-token rows (num_tokens ==
    num_rows); prefill graphs pad with empty rows and with tokens no row owns."""
    num_tokens: int
    num_rows: int
    is_decode: bool


@dataclass
class StepInputs:
    input_ids: Tensor
    positions: Tensor
    meta: AttentionMetadata
    logits_indices: Tensor | slice  # rows of the hidden states that sample
    sample_rows: list[int]  # which of the step's sequences sample


@dataclass
class StagedStep:
    """A step staged in the host buffers, described by sizes: with `host` (the staged arrays it reads) it is
    all a tensor-parallel rank needs to run the step as rank 0 does; it pickles small."""
    num_tokens: int  # padding included
    num_rows: int
    num_logits: int
    max_seqlen_q: int
    max_seqlen_k: int
    is_decode: bool
    logits_lead: bool  # every token samples: the logits rows are the step's first rows
    sample_rows: list[int]
    graph: GraphShape | None
    num_follows: int  # the first input ids staged are rows of the previous step's sampled ids
    host: tuple[np.ndarray, np.ndarray, np.ndarray]  # staged longs, cu_seqlens|seq_lens, block-table columns in use


@dataclass
class LaunchedStep:
    """A step on its way through the device; ModelRunner.finish() returns its sampled ids."""
    seqs: list[Sequence]
    num_tokens: list[int]
    sample_rows: list[int]
    ids: Tensor | None  # the sampled ids: in pinned host memory once `ready` has passed (on the CPU, at once)
    ready: "torch.cuda.Event | None"
    plannable: bool  # no penalties: the next step needs no token of this one on the host


def longest_first(seq_lens: np.ndarray, num_rows: int) -> np.ndarray:
    """The decode rows (the first len(seq_lens)) by decreasing context length, then the rest in order. The
    decode kernel starts its programs in this order, so the longest sequences do not run on alone at the end
    of the step (largest work first: 1.7% more KV bandwidth at batch 128-256 on contexts of 100-2,100 tokens,
    on an H100)."""
    return np.concatenate((np.argsort(-seq_lens, kind="stable"), np.arange(len(seq_lens), num_rows)))


def aligned(count: int) -> int:
    """Where an array of `count` elements ends when every staged array starts at a multiple of 16 elements.
    Triton specialises a kernel on whether each pointer is 16-byte aligned, so packed arrays whose alignment
    followed the step's sizes compiled new kernel variants mid-run (1.5 s in a throughput run on an H100)."""
    return -(-count // 16) * 16


class StagingBuffer:
    """A host buffer (pinned on CUDA) and its device twin; on the CPU they are one tensor. The host side is
    refilled only after the device has taken the previous upload."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device):
        on_cuda = device.type == "cuda"
        self.host = torch.zeros(size, dtype=dtype, pin_memory=on_cuda)
        self.device = torch.zeros(size, dtype=dtype, device=device) if on_cuda else self.host
        self.uploaded = torch.cuda.Event() if on_cuda else None
        self.array = self.host.numpy()

    def writable(self) -> np.ndarray:
        if self.uploaded is not None:
            self.uploaded.synchronize()
        return self.array

    def upload(self, size: int) -> None:
        if self.uploaded is not None:
            self.device[:size].copy_(self.host[:size], non_blocking=True)
            self.uploaded.record()


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
        self.is_driver = tp_rank() == 0  # stages steps and samples; the other tensor-parallel ranks follow
        self.sampler = Sampler(self.device)
        self.max_model_len = min(config.max_model_len, loaded.hf_config.max_position_embeddings)
        self.can_generate = getattr(self.model, "lm_head", None) is not None  # bare decoders only embed
        self.num_blocks = self._allocate_kv_cache() if self.can_generate else 0
        if self.can_generate:
            self.max_model_len = min(self.max_model_len, self.num_blocks * self.block_size)  # one request fits
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        max_size = config.max_num_seqs
        self.graph_sizes = sorted({s for s in [1, 2, 4, 8, *range(16, max_size + 1, 8), max_size] if s <= max_size})
        most = min(config.max_num_batched_tokens, PREFILL_GRAPH_MAX_TOKENS)  # 16, 24, 32, 48, 64, ..., most
        self.prefill_graph_tokens = sorted({t for t in [*(m << e for e in range(3, 11) for m in (2, 3)), most]
                                            if t <= most})
        self.graphs: dict[GraphShape, torch.cuda.CUDAGraph] = {}
        if self.can_generate:
            self._allocate_step_buffers()
            if self.device.type == "cuda":
                self._warm_lm_head()
            if self.device.type == "cuda" and not config.enforce_eager:
                self._capture_graphs()

    # ---- KV cache -------------------------------------------------------------------------------

    def _allocate_kv_cache(self) -> int:
        shape = self.model.kv_cache_shape(1, self.block_size)
        block_bytes = 2 * int(np.prod(shape)) * self.dtype.itemsize
        num_blocks = self.config.num_kv_blocks or (
            self._blocks_fitting_gpu(block_bytes) if self.device.type == "cuda"
            else self._blocks_fitting_cpu(block_bytes))
        num_blocks = min_over_ranks(num_blocks)
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
        then logits and sampling for max_num_seqs rows (which also compiles the one-pass sampler's kernel
        now rather than at the first request)."""
        num_tokens = self.config.max_num_batched_tokens
        lengths = [self.max_model_len] * (num_tokens // self.max_model_len) + [num_tokens % self.max_model_len]
        hidden, _ = self._forward_cacheless([[0] * n for n in lengths if n])
        num_rows = min(self.config.max_num_seqs, num_tokens)
        logits = self.model.compute_logits(hidden[:1].expand(num_rows, -1).contiguous())
        if logits is not None:  # tensor-parallel ranks other than 0 get no logits and do not sample
            torch.softmax(logits, -1).argmax(-1)
            gumbel_argmax(logits, torch.zeros(num_rows, device=self.device),
                          torch.zeros(num_rows, dtype=torch.int64, device=self.device))
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def _warm_lm_head(self) -> None:
        """Runs the LM head once at every row count a step can sample. The first GEMM of a shape cuBLAS has not
        run held the host 5-15 ms on an H100, about the step in flight: each time a shrinking decode batch
        reached such a size (18 times in bench/throughput.py's first run), the step launched ahead of the
        running one waited."""
        hidden = torch.zeros(self.config.max_num_seqs, self.hidden_size, dtype=self.dtype, device=self.device)
        for rows in range(1, self.config.max_num_seqs + 1):
            self.model.compute_logits(hidden[:rows])
        torch.cuda.synchronize(self.device)

    # ---- step inputs ----------------------------------------------------------------------------

    def _allocate_step_buffers(self) -> None:
        """int64: input ids, positions, slots (padded steps: one token per row) and logits indices; int32:
        cu_seqlens, seq_lens and the decode order, then the block table of max_num_seqs rows at a fixed
        offset."""
        max_rows, width = self.config.max_num_seqs, self.max_blocks_per_seq
        max_tokens = max(self.config.max_num_batched_tokens, max_rows)
        self.longs = StagingBuffer(3 * aligned(max_tokens) + max_rows, torch.int64, self.device)
        self.table_offset = aligned(aligned(aligned(max_rows + 1) + max_rows) + max_rows)
        self.ints = StagingBuffer(self.table_offset + max_rows * width, torch.int32, self.device)
        self.block_tables = self.ints.array[self.table_offset:].reshape(max_rows, width)
        self.table_owners: list[list[int] | None] = [None] * max_rows  # the block-table list each row holds
        self.table_lengths = [0] * max_rows  # how many of its blocks are written
        if self.device.type == "cuda":  # two: a step's ids may still be on their way while the next is launched
            self.host_ids = [(torch.zeros(max_rows, dtype=torch.int64, pin_memory=True), torch.cuda.Event())
                             for _ in range(2)]
            self.num_launched = 0

    def _device_inputs(self, num_tokens: int, num_rows: int, num_logits: int) -> tuple[Tensor, ...]:
        """Device views of a staged step: input ids, positions, slots, logits indices, cu_seqlens, seq_lens,
        decode order and block tables. A captured graph reads those of a padded step of its size, at fixed
        addresses."""
        longs, ints = self.longs.device, self.ints.device
        tokens_at, lens_at = aligned(num_tokens), aligned(num_rows + 1)
        ids, positions, slots = (longs[i * tokens_at:i * tokens_at + num_tokens] for i in range(3))
        logits = longs[3 * tokens_at:3 * tokens_at + num_logits]
        cu_seqlens, seq_lens = ints[:num_rows + 1], ints[lens_at:lens_at + num_rows]
        order_at = lens_at + aligned(num_rows)
        width = self.max_blocks_per_seq
        tables = self.ints.device[self.table_offset:self.table_offset + num_rows * width].view(num_rows, width)
        return ids, positions, slots, logits, cu_seqlens, seq_lens, ints[order_at:order_at + num_rows], tables

    def _stage_block_tables(self, seqs: list[Sequence]) -> np.ndarray:
        """The staged block table with rows 0..len(seqs)-1 brought up to date. A block table only grows by
        appends (freeing replaces the list), so a row that held this list before writes only its new blocks:
        a decode step writes nothing or the block it just got. Columns past a row's blocks are stale but
        always valid block ids, and attention never reads them."""
        owners, lengths, tables = self.table_owners, self.table_lengths, self.block_tables
        for row, seq in enumerate(seqs):
            blocks = seq.block_table
            start = lengths[row] if owners[row] is blocks else 0
            if start < len(blocks):
                tables[row, start:len(blocks)] = blocks[start:]
                owners[row], lengths[row] = blocks, len(blocks)
        return tables

    def prepare(self, seqs: list[Sequence], num_tokens: list[int], graph: GraphShape | None = None) -> StepInputs:
        """Stages the step's new tokens and uploads them, padded to a captured graph's shape when given
        (padding tokens are token 0 at position 0 and write no cache slot)."""
        return self._upload(self._stage(seqs, num_tokens, graph))

    def _stage(self, seqs: list[Sequence], num_tokens: list[int], graph: GraphShape | None = None,
               ahead: list[int] | None = None, follows: list[int] = ()) -> StagedStep:
        """ahead: the tokens each sequence has in the step in flight (not yet counted as computed). follows: the
        first len(follows) sequences compute one token each, the one sampled in these rows of the step in
        flight (not yet on the host)."""
        num_seqs, num_rows, num_follows = len(seqs), graph.num_rows if graph else len(seqs), len(follows)
        longs, ints = self.longs.writable(), self.ints.writable()
        counts = np.array(num_tokens, dtype=np.int64)
        starts = np.fromiter([seq.num_computed_tokens for seq in seqs], dtype=np.int64, count=num_seqs)
        if ahead is not None:
            starts += np.array(ahead, dtype=np.int64)
        seq_lens = starts + counts
        cu_seqlens = np.zeros(num_rows + 1, dtype=np.int64)
        np.cumsum(counts, out=cu_seqlens[1:num_seqs + 1])
        total = int(cu_seqlens[num_seqs])
        padding_rows = np.arange(1, num_rows - num_seqs + 1) if graph and graph.is_decode else 0
        cu_seqlens[num_seqs + 1:] = total + padding_rows
        size = graph.num_tokens if graph else total  # tokens in the step, padding included
        tokens_at, lens_at = aligned(size), aligned(num_rows + 1)
        input_ids, positions, slot_mapping = (longs[i * tokens_at:i * tokens_at + size] for i in range(3))
        input_ids[:num_follows] = follows
        input_ids[num_follows:total] = np.fromiter(itertools.chain.from_iterable(
            seq.token_ids[start:start + n] for seq, start, n in
            zip(seqs[num_follows:], starts[num_follows:].tolist(), num_tokens[num_follows:])),
            dtype=np.int64, count=total - num_follows)
        positions[:total] = np.arange(total) - np.repeat(cu_seqlens[:num_seqs] - starts, counts)
        rows = np.repeat(np.arange(num_seqs), counts)
        tables = self._stage_block_tables(seqs)
        slot_mapping[:total] = (tables[rows, positions[:total] // self.block_size] * self.block_size
                                + positions[:total] % self.block_size)
        input_ids[total:], positions[total:], slot_mapping[total:] = 0, 0, -1
        lengths = np.fromiter([len(seq.token_ids) for seq in seqs], dtype=np.int64, count=num_seqs)
        lengths[:num_follows] += 1  # the token in flight
        samples = seq_lens == lengths
        logits_indices = cu_seqlens[1:num_seqs + 1][samples] - 1
        num_logits = len(logits_indices)
        longs[3 * tokens_at:3 * tokens_at + num_logits] = logits_indices
        ints[:num_rows + 1] = cu_seqlens
        ints[lens_at:lens_at + num_seqs] = seq_lens
        ints[lens_at + num_seqs:lens_at + num_rows] = 1
        columns = -(-int(seq_lens.max(initial=0)) // self.block_size)
        is_decode = graph.is_decode if graph else bool((counts == 1).all())
        order_at = lens_at + aligned(num_rows)
        if is_decode:
            ints[order_at:order_at + num_rows] = longest_first(seq_lens, num_rows)
        return StagedStep(
            size, num_rows, num_logits,
            max_seqlen_q=size if graph and not graph.is_decode else max(num_tokens, default=1),
            max_seqlen_k=self.max_model_len if graph else int(seq_lens.max()),  # a graph serves any length
            is_decode=is_decode,
            logits_lead=num_logits == total,  # one token per sequence: the logits rows lead the step
            sample_rows=np.flatnonzero(samples).tolist(), graph=graph, num_follows=num_follows,
            host=(longs[:3 * tokens_at + num_logits], ints[:order_at + num_rows], tables[:num_rows, :columns]))

    def _upload(self, staged: StagedStep) -> StepInputs:
        size, num_rows, num_logits = staged.num_tokens, staged.num_rows, staged.num_logits
        self.longs.upload(3 * aligned(size) + num_logits)
        self.ints.upload(self.table_offset + num_rows * self.max_blocks_per_seq)
        ids, pos, slots, logits, cu, lens, order, block_tables = self._device_inputs(size, num_rows, num_logits)
        meta = AttentionMetadata(
            slot_mapping=slots, cu_seqlens_q=cu, seq_lens=lens, block_tables=block_tables,
            max_seqlen_q=staged.max_seqlen_q, max_seqlen_k=staged.max_seqlen_k, is_decode=staged.is_decode,
            seq_order=order)
        return StepInputs(ids, pos, meta, slice(0, num_logits) if staged.logits_lead else logits, staged.sample_rows)

    def _restage(self, staged: StagedStep) -> None:
        """Writes rank 0's staged arrays into this rank's host buffers."""
        longs, cu_and_lens, columns = staged.host
        self.longs.writable()[:len(longs)] = longs
        self.ints.writable()[:len(cu_and_lens)] = cu_and_lens
        self.block_tables[:columns.shape[0], :columns.shape[1]] = columns

    # ---- running steps --------------------------------------------------------------------------

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], num_tokens: list[int], ahead: list[int] | None = None,
               follows: list[int] = ()) -> LaunchedStep:
        """Starts the step on the device without waiting for it. With ahead, it goes on from the last step
        launched, still unfinished (see _stage)."""
        staged = self._stage(seqs, num_tokens, self._graph_for(num_tokens), ahead, follows)
        logits = self.collective("execute", staged)
        if not staged.sample_rows:
            return LaunchedStep(seqs, num_tokens, [], None, None, plannable=True)
        sampling = seqs if len(staged.sample_rows) == len(seqs) else [seqs[i] for i in staged.sample_rows]
        drawn_ahead = [1] * len(follows) + [0] * (len(sampling) - len(follows))  # the leading rows all sample
        self.last_sampled = self.sampler(logits, sampling, ahead=drawn_ahead)
        ids, ready = self._to_host(self.last_sampled)
        plannable = not self.sampler.plan_for(sampling).penalised
        return LaunchedStep(seqs, num_tokens, staged.sample_rows, ids, ready, plannable)

    def finish(self, step: LaunchedStep) -> list[int | None]:
        """The sampled token of each of the step's sequences (None: a prompt chunk that does not reach the
        end of its tokens), once the device has sent them: the step's one wait."""
        if step.ready is not None:
            step.ready.synchronize()
        sampled = [None] * len(step.seqs)
        if step.ids is not None:
            for row, token_id in zip(step.sample_rows, step.ids.tolist()):
                sampled[row] = token_id
        return sampled

    def _to_host(self, ids: Tensor) -> tuple[Tensor, "torch.cuda.Event | None"]:
        """Starts copying sampled ids into pinned memory, alternating between two buffers (the other may
        hold the ids of the step launched before, not read yet); returns the buffer and its ready event."""
        if self.device.type != "cuda":
            return ids, None
        self.num_launched += 1
        buffer, ready = self.host_ids[self.num_launched % 2]
        buffer = buffer[:len(ids)]
        buffer.copy_(ids, non_blocking=True)
        ready.record()
        return buffer, ready

    @torch.inference_mode()
    def execute(self, staged: StagedStep) -> Tensor | None:
        """The device side of a step, run by every tensor-parallel rank: upload, forward (or graph replay),
        and the logits of the rows that sample (on rank 0; None elsewhere and when no row samples)."""
        if not self.is_driver:
            self._restage(staged)
        step = self._upload(staged)
        if staged.num_follows:
            self._take_sampled_ids(step.input_ids[:staged.num_follows])
        if staged.graph:
            self.graphs[staged.graph].replay()
            hidden = self.graph_hidden[:staged.graph.num_tokens]
        else:
            hidden = self.model(step.input_ids, step.positions, step.meta)
        return self.model.compute_logits(hidden[step.logits_indices]) if staged.sample_rows else None

    def _take_sampled_ids(self, ids: Tensor) -> None:
        """Input ids staged as rows of the last step's sampled ids become those ids on the device; rank 0,
        which sampled them, sends them to the other tensor-parallel ranks."""
        if self.is_driver:
            ids.copy_(self.last_sampled[ids])
        if tp_size() > 1:
            dist.broadcast(ids, src=0)

    def collective(self, method: str, *args):
        """Calls a method that every tensor-parallel rank must run in step (its forward holds all-reduces)
        with picklable arguments. With one rank it is a plain call; engine/tensor_parallel.py replaces it on
        rank 0 with one that first sends (method, args) to the other ranks."""
        return getattr(self, method)(*args)

    def _graph_for(self, num_tokens: list[int]) -> GraphShape | None:
        """The captured graph to replay for this step; None runs it eagerly."""
        num_rows, total = len(num_tokens), sum(num_tokens)
        if not self.graphs or num_rows > self.config.max_num_seqs:
            return None
        if total == num_rows:  # one token per row: pure decode
            size = self.graph_sizes[bisect.bisect_left(self.graph_sizes, num_rows)]
            return GraphShape(size, size, is_decode=True)
        if total <= self.prefill_graph_tokens[-1]:
            size = self.prefill_graph_tokens[bisect.bisect_left(self.prefill_graph_tokens, total)]
            return GraphShape(size, self.config.max_num_seqs, is_decode=False)
        return None

    def _graph_shapes(self) -> list[GraphShape]:
        return ([GraphShape(size, size, is_decode=True) for size in self.graph_sizes]
                + [GraphShape(size, self.config.max_num_seqs, is_decode=False) for size in self.prefill_graph_tokens])

    def _capture_graphs(self) -> None:
        """One graph per decode batch size and prefill token count, largest first so the smaller ones reuse
        its memory pool; each is warmed up and captured on a step of padding only."""
        shapes = sorted(self._graph_shapes(), key=lambda shape: shape.num_tokens, reverse=True)
        self.graph_hidden = torch.zeros(shapes[0].num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        pool_handle = None
        with torch.inference_mode():
            for shape in shapes:
                step = self.prepare([], [], shape)
                hidden = self.graph_hidden[:shape.num_tokens]
                graph = torch.cuda.CUDAGraph()
                hidden.copy_(self.model(step.input_ids, step.positions, step.meta))  # warm-up
                torch.cuda.synchronize(self.device)
                with torch.cuda.graph(graph, pool_handle):
                    hidden.copy_(self.model(step.input_ids, step.positions, step.meta))
                pool_handle = graph.pool()
                self.graphs[shape] = graph
        torch.cuda.synchronize(self.device)

    # ---- embeddings -----------------------------------------------------------------------------

    def _forward_cacheless(self, token_lists: list[list[int]]) -> tuple[Tensor, Tensor]:
        """Hidden states [T, H] of packed sequences, attending only within each (the KV cache untouched),
        and their cu_seqlens."""
        input_ids, positions, cu_seqlens, max_len = pack(token_lists, self.device)
        seq_lens = cu_seqlens[1:] - cu_seqlens[:-1]
        meta = AttentionMetadata(slot_mapping=None, cu_seqlens_q=cu_seqlens, seq_lens=seq_lens, block_tables=None,
                                 max_seqlen_q=max_len, max_seqlen_k=max_len, is_decode=False)
        return self.model(input_ids, positions, meta), cu_seqlens

    @torch.inference_mode()
    def embed(self, token_lists: list[list[int]]) -> Tensor:
        """Pooled float32 vectors [n, H] on the CPU (engine/embedding.py) of inputs already checked."""
        limit = max_input_tokens(self.max_model_len, self.pooling)
        forward = functools.partial(self.collective, "_forward_cacheless")
        return embed(token_lists, forward, self.pooling, limit, self.config.max_embedding_batch_tokens,
                     self.hidden_size)
