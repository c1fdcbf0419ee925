"""What attention needs to know about one engine step, besides the tensors themselves."""

from dataclasses import dataclass

from torch import Tensor


@dataclass
class AttentionMetadata:
    """Per-step attention metadata.

    Query token i (0-based) of sequence b sits at absolute position seq_lens[b] - q_len_b + i and
    attends to key positions 0..that position: causal over the cached prefix plus its own chunk. With
    image_spans, a query also sees the keys of its span [start, end) (an image's tokens see each other both
    ways), within its layer's window; a row outside any image has the empty span (0, 0). Such a step runs our
    Triton prefill kernel on CUDA (never flash-attn) and the torch attention on CPU.
    """

    slot_mapping: Tensor  # int64 [T]: cache slot for each token of this step (-1: don't store)
    cu_seqlens_q: Tensor  # int32 [B+1]: query tokens of this step per sequence
    seq_lens: Tensor  # int32 [B]: context length after this step (cached + new) per sequence
    block_tables: Tensor | None  # int32 [B, max_blocks_per_seq], padded with -1; None: no KV cache
    max_seqlen_q: int
    max_seqlen_k: int
    is_decode: bool  # every sequence has exactly one query token
    seq_order: Tensor | None = None  # int32 [B], decode: the rows, longest context first (the order they start in)
    image_spans: Tensor | None = None  # int64 [T, 2]: key positions [start, end) each query sees beyond causal
    # Decode rows that read each other's keys (one request's draft tokens, a later row reading the key an earlier
    # one stores in the same step): all keys are stored before attention starts, not within its launch.
    rows_read_each_other: bool = False
