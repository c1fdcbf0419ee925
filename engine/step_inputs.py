"""A step's inputs, from the scheduled sequences to the device tensors the forward reads.

Step inputs are written through numpy views into two pinned host buffers allocated once (one int64, one
int32) and reach the device in one non-blocking copy each, into device buffers that are also the inputs of
the captured CUDA graphs, so a step replays a graph with no further copies. A step staged for a graph is
padded to the graph's shape (engine/cuda_graphs.py). Each row of the staged block table remembers which
sequence's table it holds, so a decode step writes only blocks that are new.

A step launched before the one in flight has finished stages its sequences' positions past the tokens they
have in flight (`ahead`), and, for its leading requests (`follows`), in place of their input ids, the rows
of the in-flight step's sampled ids they take; the device swaps the ids in before the forward.

For an M-RoPE model (shifted_positions), each token's rotary position is its index plus its request's rope_delta
(engine/mrope.py); its cache slot stays at its index.
"""
import itertools
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from engine.config import EngineConfig
from engine.cuda_graphs import GraphShape
from engine.sequence import Sequence
from kernels import AttentionMetadata


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
    rows_read_each_other: bool  # verification rows: attention stores all the step's keys first
    logits_lead: bool  # every token samples: the logits rows are the step's first rows
    sample_rows: list[int]
    graph: GraphShape | None
    num_follows: int  # the first input ids staged are rows of the previous step's sampled ids
    host: tuple[np.ndarray, np.ndarray, np.ndarray]  # staged longs, cu_seqlens|seq_lens, block-table columns in use


def longest_first(request_lens: np.ndarray, num_rows: int) -> np.ndarray:
    """The decode rows (the first len(request_lens)) by decreasing context length of their request, then the rest
    in order. The decode kernel starts its programs in this order, so the longest sequences do not run on alone at
    the end of the step (largest work first). A request's verification rows (one per token, staged one after the
    other) share its length and so stay together: their programs start side by side and read the same keys at the
    same time, so that L2 can serve all but the first read. Ordered by each row's own length, a request's rows
    started a batch apart, and a batch whose keys exceed L2 read them from memory once per row."""
    return np.concatenate((np.argsort(-request_lens, kind="stable"), np.arange(len(request_lens), num_rows)))


def verified_rows(ends: np.ndarray, drafted: np.ndarray) -> np.ndarray:
    """The token rows whose logits a step samples: each sampling sequence's last, and before it one per
    draft token it verifies (the model's choice after each token it is given). ends: where each sampling
    sequence's tokens end in the step."""
    if not drafted.any():
        return ends - 1
    counts = drafted + 1
    firsts = np.cumsum(counts) - counts
    return np.repeat(ends - counts, counts) + np.arange(int(counts.sum())) - np.repeat(firsts, counts)


def aligned(count: int) -> int:
    """Where an array of `count` elements ends when every staged array starts at a multiple of 16 elements.
    Triton specialises a kernel on whether each pointer is 16-byte aligned, so packed arrays whose alignment
    followed the step's sizes compiled new kernel variants mid-run."""
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


class StepBuffers:
    """The staging buffers of one runner. int64: input ids, positions, slots (padded steps: one token per row)
    and logits indices; int32: cu_seqlens, seq_lens and the decode order, then the block table of max_num_seqs
    rows at a fixed offset."""

    def __init__(self, config: EngineConfig, max_model_len: int, device: torch.device, shifted_positions: bool = False):
        self.block_size, self.max_model_len = config.block_size, max_model_len
        self.shifted_positions = shifted_positions
        self.max_blocks_per_seq = width = -(-max_model_len // config.block_size)
        max_rows = config.max_num_seqs
        max_tokens = max(config.max_num_batched_tokens, max_rows)
        max_logits = max_rows * (1 + config.num_speculative_tokens)  # a verification step: each draft token too
        self.longs = StagingBuffer(3 * aligned(max_tokens) + max_logits, torch.int64, device)
        self.table_offset = aligned(aligned(aligned(max_rows + 1) + max_rows) + max_rows)
        self.ints = StagingBuffer(self.table_offset + max_rows * width, torch.int32, device)
        self.block_tables = self.ints.array[self.table_offset:].reshape(max_rows, width)
        self.table_owners: list[list[int] | None] = [None] * max_rows  # the block-table list each row holds
        self.table_lengths = [0] * max_rows  # how many of its blocks are written

    def prepare(self, seqs: list[Sequence], num_tokens: list[int], graph: GraphShape | None = None) -> StepInputs:
        """Stages the step's new tokens and uploads them, padded to a captured graph's shape when given
        (padding tokens are token 0 at position 0 and write no cache slot)."""
        return self.upload(self.stage(seqs, num_tokens, graph))

    def device_views(self, num_tokens: int, num_rows: int, num_logits: int) -> tuple[Tensor, ...]:
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
        tables = ints[self.table_offset:self.table_offset + num_rows * width].view(num_rows, width)
        return ids, positions, slots, logits, cu_seqlens, seq_lens, ints[order_at:order_at + num_rows], tables

    def _stage_block_tables(self, seqs: list[Sequence]) -> np.ndarray:
        """The staged block table with rows 0..len(seqs)-1 brought up to date. A block table only grows by
        appends (freeing replaces the list; a block freed behind a sliding window turns FREED in place), so a
        row that held this list before writes only its new blocks: a decode step writes nothing or the block it
        just got. Columns past a row's blocks, and entries behind its window (old ids or FREED), are stale, and
        attention never reads them, but a padding row reads its first column (stage)."""
        owners, lengths, tables = self.table_owners, self.table_lengths, self.block_tables
        for row, seq in enumerate(seqs):
            blocks = seq.block_table
            start = lengths[row] if owners[row] is blocks else 0
            if start < len(blocks):
                tables[row, start:len(blocks)] = blocks[start:]
                owners[row], lengths[row] = blocks, len(blocks)
        return tables

    def verifies_as_rows(self, seqs: list[Sequence], num_tokens: list[int]) -> bool:
        """Whether the step only verifies drafts (each request computes its last token and its draft tokens)
        and can be staged with a decode row per token (stage's as_rows)."""
        return (sum(num_tokens) <= len(self.table_owners) and any(seq.draft_token_ids for seq in seqs)
                and all(n == 1 + len(seq.draft_token_ids) == len(seq.token_ids) + len(seq.draft_token_ids)
                        - seq.num_computed_tokens for seq, n in zip(seqs, num_tokens)))

    def stage(self, seqs: list[Sequence], num_tokens: list[int], graph: GraphShape | None = None,
              ahead: list[int] | None = None, follows: list[int] = (), as_rows: bool = False) -> StagedStep:
        """ahead: the tokens each sequence has in the step in flight (not yet counted as computed). follows: the
        first len(follows) sequences compute one token each, the one sampled in these rows of the step in
        flight (not yet on the host). as_rows: a verification step (verifies_as_rows) staged as a decode step
        of one row per token, each row attending to its request's cache up to its own position: the decode
        kernels and graphs, whose cost at a small batch hardly grows with rows, serve it (the verification
        graphs: its rows read keys that its other rows store, engine/cuda_graphs.py). A graph's own shape says
        whether it verifies (a capture stages no sequences)."""
        num_seqs, num_follows = len(seqs), len(follows)
        longs, ints = self.longs.writable(), self.ints.writable()
        counts = np.array(num_tokens, dtype=np.int64)
        starts = np.fromiter([seq.num_computed_tokens for seq in seqs], dtype=np.int64, count=num_seqs)
        if ahead is not None:
            starts += np.array(ahead, dtype=np.int64)
        seq_lens = starts + counts
        ends = np.cumsum(counts)  # where each sequence's tokens end in the step
        total = int(ends[-1]) if num_seqs else 0
        num_attending = total if as_rows else num_seqs  # rows of the attention metadata
        num_rows = graph.num_rows if graph else num_attending
        size = graph.num_tokens if graph else total  # tokens in the step, padding included
        tokens_at, lens_at = aligned(size), aligned(num_rows + 1)
        input_ids, positions, slot_mapping = (longs[i * tokens_at:i * tokens_at + size] for i in range(3))
        input_ids[:num_follows] = follows
        input_ids[num_follows:total] = np.fromiter(itertools.chain.from_iterable(
            (seq.token_ids + seq.draft_token_ids if seq.draft_token_ids else seq.token_ids)[start:start + n]
            for seq, start, n in
            zip(seqs[num_follows:], starts[num_follows:].tolist(), num_tokens[num_follows:])),
            dtype=np.int64, count=total - num_follows)
        positions[:total] = np.arange(total) - np.repeat(ends - counts - starts, counts)
        if as_rows:
            tables = self._stage_block_tables([seq for seq, n in zip(seqs, num_tokens) for _ in range(n)])
            rows, attended = np.arange(total), positions[:total] + 1
            row_counts = np.ones(total, dtype=np.int64)
        else:
            tables = self._stage_block_tables(seqs)
            rows, attended, row_counts = np.repeat(np.arange(num_seqs), counts), seq_lens, counts
        slot_mapping[:total] = (tables[rows, positions[:total] // self.block_size] * self.block_size
                                + positions[:total] % self.block_size)
        if self.shifted_positions:
            positions[:total] += np.repeat(np.fromiter([seq.rope_delta for seq in seqs], dtype=np.int64,
                                                       count=num_seqs), counts)
        input_ids[total:], positions[total:], slot_mapping[total:] = 0, 0, -1
        cu_seqlens = np.zeros(num_rows + 1, dtype=np.int64)
        np.cumsum(row_counts, out=cu_seqlens[1:num_attending + 1])
        padding_rows = np.arange(1, num_rows - num_attending + 1) if graph and graph.is_decode else 0
        cu_seqlens[num_attending + 1:] = total + padding_rows
        drafted = np.fromiter([len(seq.draft_token_ids) for seq in seqs], dtype=np.int64, count=num_seqs)
        lengths = np.fromiter([len(seq.token_ids) for seq in seqs], dtype=np.int64, count=num_seqs) + drafted
        lengths[:num_follows] += 1  # the token in flight
        samples = seq_lens == lengths
        logits_indices = verified_rows(ends[samples], drafted[samples])
        num_logits = len(logits_indices)
        longs[3 * tokens_at:3 * tokens_at + num_logits] = logits_indices
        ints[:num_rows + 1] = cu_seqlens
        ints[lens_at:lens_at + num_attending] = attended
        ints[lens_at + num_attending:lens_at + num_rows] = 1
        read_by_padding = tables[num_attending:num_rows, 0]  # a padding row attends to the key at position 0
        read_by_padding[read_by_padding < 0] = 0  # a stale row's block freed behind a window: any block will do
        columns = -(-int(seq_lens.max(initial=0)) // self.block_size)
        is_decode = graph.is_decode if graph else bool((row_counts == 1).all())
        order_at = lens_at + aligned(num_rows)
        if is_decode:
            ints[order_at:order_at + num_rows] = longest_first(np.repeat(seq_lens, counts), num_rows)
        return StagedStep(
            size, num_rows, num_logits,
            max_seqlen_q=size if graph and not graph.is_decode else int(row_counts.max(initial=1)),
            max_seqlen_k=self.max_model_len if graph else int(seq_lens.max()),  # a graph serves any length
            is_decode=is_decode, rows_read_each_other=graph.verifies if graph else as_rows,
            logits_lead=num_logits == total,  # every token samples: the logits rows are the step's first rows
            sample_rows=np.flatnonzero(samples).tolist(), graph=graph, num_follows=num_follows,
            host=(longs[:3 * tokens_at + num_logits], ints[:order_at + num_rows], tables[:num_rows, :columns]))

    def upload(self, staged: StagedStep) -> StepInputs:
        """Sends a staged step to the device; returns the device views the forward reads."""
        size, num_rows, num_logits = staged.num_tokens, staged.num_rows, staged.num_logits
        self.longs.upload(3 * aligned(size) + num_logits)
        self.ints.upload(self.table_offset + num_rows * self.max_blocks_per_seq)
        ids, pos, slots, logits, cu, lens, order, block_tables = self.device_views(size, num_rows, num_logits)
        meta = AttentionMetadata(
            slot_mapping=slots, cu_seqlens_q=cu, seq_lens=lens, block_tables=block_tables,
            max_seqlen_q=staged.max_seqlen_q, max_seqlen_k=staged.max_seqlen_k, is_decode=staged.is_decode,
            seq_order=order, rows_read_each_other=staged.rows_read_each_other)
        return StepInputs(ids, pos, meta, slice(0, num_logits) if staged.logits_lead else logits, staged.sample_rows)

    def restage(self, staged: StagedStep) -> None:
        """Writes rank 0's staged arrays into this rank's host buffers."""
        longs, cu_and_lens, columns = staged.host
        self.longs.writable()[:len(longs)] = longs
        self.ints.writable()[:len(cu_and_lens)] = cu_and_lens
        self.block_tables[:columns.shape[0], :columns.shape[1]] = columns
