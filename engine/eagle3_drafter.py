"""Drafts from an EAGLE-3 head (models/eagle3.py): k guesses per request, from the target's own hidden states.

What the head reads is kept beside the target's KV cache, in the same slots (a request's position p in the slot
its block table gives p), budgeted with the pool, so it follows the block manager's allocation, prefix caching
and rollback with little bookkeeping of its own (rather than recomputing the head over the whole context at
every proposal, which would cost a pass over every token of every drafting request at each step):
- the fused auxiliary states: every forward that fills the target's cache hands its rows to store() (the
  target's aux sink), which writes fc(aux) at the rows' slots; a position recomputed later (a rejected draft
  token, a preempted request) is overwritten. A prefix-cache hit finds them where the prompt's first request
  left them.
- the head's keys and values: the head's step at position p reads the token at p + 1, so its keys and values
  for p are stored in the slot of p + 1; they then depend only on the tokens up to p + 1, so a full block
  shared through the prefix cache holds the same ones for every request that shares it.

A proposal for a request whose next position is m (the tokens 0..m-1 computed, token m sampled) stores the
head's keys and values of the positions it has not stored yet, up to m - 2; drafts the first token from
position m - 1 (the target's state there and token m), then k - 1 more, each from the head's own output and
its previous guess, attending to the stored keys and to those of its own earlier steps (which are kept in the
step's buffers only: the next proposal starts again from the target's states). A request remembers the
blocks whose slots all hold its keys (seq.draft_state); a block that changed (preemption, rejected drafts'
blocks given back) is stored again. A block of its own that a preempted request gets back after another
request stored keys in it would be trusted: a draft's quality depends on the keys, never an output.

Drafts take the head's most likely token: a drafter that proposes a token with certainty is what the sampler's
verification rule (engine/sampler.py's verify) expects, so sampled outputs keep the target's distribution.
"""
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from engine.sequence import Sequence
from kernels import qkv_prologue
from models.eagle3 import Eagle3Head


class Eagle3State:
    """The leading blocks of a request's table whose slots hold its head keys and values."""

    __slots__ = ("blocks",)

    def __init__(self):
        self.blocks: list[int] = []


class Eagle3Drafter:
    batched = True  # proposes for a whole step's requests at once (Speculator.propose)

    def __init__(self, head: Eagle3Head, num_blocks: int, block_size: int):
        parameter = head.fc.weight
        self.head, self.block_size = head, block_size
        num_slots = num_blocks * block_size
        self.fused = torch.zeros(num_slots + 1, head.config.hidden_size, dtype=parameter.dtype,
                                 device=parameter.device)  # the last row takes the padding rows' writes
        shape = (num_blocks, block_size, head.num_kv_heads, head.head_dim)
        self.k_cache, self.v_cache = (torch.zeros(shape, dtype=parameter.dtype, device=parameter.device)
                                      for _ in range(2))

    @staticmethod
    def block_bytes(head: Eagle3Head, block_size: int, dtype: torch.dtype) -> int:
        """What the drafter keeps per KV block: a fused state, a key and a value per slot."""
        return block_size * (head.config.hidden_size + 2 * head.num_kv_heads * head.head_dim) * dtype.itemsize

    def store(self, aux: Tensor, slot_mapping: Tensor) -> None:
        """The target's aux sink: fuses a forward's auxiliary states into the slots of its tokens (slot -1, a
        padding row: the spare row). No host sync, so a captured CUDA graph holds it."""
        rows = torch.where(slot_mapping >= 0, slot_mapping, self.fused.shape[0] - 1)
        self.fused.index_copy_(0, rows, self.head.fc(aux).to(self.fused.dtype))

    @torch.inference_mode()
    def propose_batch(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """ks[i] draft tokens for each request seqs[i] (decoding: all its tokens but the last computed)."""
        head, device = self.head, self.fused.device
        plan = ProposalPlan(seqs, self.block_size)
        tokens, positions, fused_slots, store_slots, gathered = (
            torch.from_numpy(array).to(device, non_blocking=True) for array in
            (plan.tokens, plan.positions, plan.fused_slots, plan.store_slots, plan.gathered))
        x, residual = head.layer_input(head.embed(tokens), self.fused[fused_slots])
        q, k, v = qkv_prologue(head.qkv(x), positions, head.rotary.cos_sin_cache, head.num_heads,
                               head.num_kv_heads, k_cache=self.k_cache, v_cache=self.v_cache,
                               slot_mapping=store_slots)
        last = torch.from_numpy(plan.last_rows).to(device, non_blocking=True)
        num_steps, stored = max(ks), gathered.shape[1]
        keys, values = (self._attended(cache, gathered, num_steps) for cache in (self.k_cache, self.v_cache))
        mask = torch.ones(len(seqs), 1, 1, stored + num_steps, dtype=torch.bool, device=device)
        mask[:, 0, 0, :stored] = torch.from_numpy(plan.valid).to(device, non_blocking=True)
        q, residual, position = q[last], residual[last], positions[last]
        k, v = k[last], v[last]
        drafts = []
        for step in range(num_steps):
            keys[:, :, stored + step], values[:, :, stored + step] = k, v
            end = stored + step + 1
            attention = F.scaled_dot_product_attention(
                q[:, :, None], keys[:, :, :end], values[:, :, :end], attn_mask=mask[..., :end],
                scale=head.head_dim ** -0.5, enable_gqa=True)
            hidden = head.after_attention(attention.reshape(len(seqs), -1), residual)
            drafts.append(head.draft_tokens(hidden))
            if step + 1 < num_steps:
                position = position + 1
                x, residual = head.layer_input(head.embed(drafts[-1]), hidden)
                q, k, v = qkv_prologue(head.qkv(x), position, head.rotary.cos_sin_cache, head.num_heads,
                                       head.num_kv_heads)
        proposed = torch.stack(drafts, dim=1).tolist()
        return [draft[:n] for draft, n in zip(proposed, ks)]

    def _attended(self, cache: Tensor, gathered: Tensor, num_steps: int) -> Tensor:
        """[B, n_kv, stored + num_steps, D]: each request's stored keys (or values) at the gathered slots, then
        room for those of the drafting steps."""
        batch, stored = gathered.shape
        out = torch.empty(batch, cache.shape[2], stored + num_steps, cache.shape[3], dtype=cache.dtype,
                          device=cache.device)
        out[:, :, :stored] = cache.flatten(0, 1)[gathered].transpose(1, 2)
        return out


class ProposalPlan:
    """The host side of a proposal: for each request, the head rows to compute (the positions whose keys it has
    not stored, and its last computed one), where their inputs are and where their keys go, and which stored
    keys its drafts attend to (padded to the longest request)."""

    def __init__(self, seqs: list[Sequence], block_size: int):
        rows, gathers = [], []
        for seq in seqs:
            state = seq.draft_state if isinstance(seq.draft_state, Eagle3State) else Eagle3State()
            seq.draft_state = state
            table = np.asarray(seq.block_table, dtype=np.int64)
            last = seq.num_computed_tokens - 1  # the head's last position: the target's state there, token m
            start = stored_until(state.blocks, seq.block_table, block_size, last)
            positions = np.arange(start, last + 1)
            slots = slots_of(table, positions, block_size)
            after = slots_of(table, np.minimum(positions + 1, last), block_size)  # the slot of p + 1
            after[-1] = -1  # the last position's keys are not stored: its slot p + 1 is not computed yet
            rows.append((np.asarray(seq.token_ids[start + 1:last + 2], dtype=np.int64), positions, slots, after))
            gathers.append(slots_of(table, np.arange(1, last + 1), block_size))  # the stored keys: slots 1..m-1
            state.blocks = seq.block_table[:(last + 1) // block_size]
        self.tokens, self.positions, self.fused_slots, self.store_slots = (np.concatenate(parts)
                                                                            for parts in zip(*rows))
        self.last_rows = np.cumsum([len(row[0]) for row in rows]) - 1
        width = max(len(gather) for gather in gathers)
        self.gathered = np.zeros((len(seqs), width), dtype=np.int64)
        self.valid = np.zeros((len(seqs), width), dtype=bool)
        for i, gather in enumerate(gathers):
            self.gathered[i, :len(gather)] = gather
            self.valid[i, :len(gather)] = True


def stored_until(blocks: list[int], table: list[int], block_size: int, last: int) -> int:
    """The first position whose keys a request must store: positions before it have theirs in blocks that are
    still its own (the keys of position p are in the slot of p + 1)."""
    kept = len(blocks)
    if table[:kept] != blocks:  # a list comparison in C: the common case, nothing changed, costs no loop here
        kept = next((i for i, (old, new) in enumerate(zip(blocks, table)) if old != new), len(table))
    return min(max(kept * block_size - 1, 0), last)


def slots_of(table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    return table[positions // block_size] * block_size + positions % block_size


def check_eagle3(config, model, tensor_parallel_size: int) -> None:
    """What the EAGLE-3 drafter cannot serve yet, refused at start with what to do."""
    setting = f"HFENDPOINT_SPECULATIVE={config.speculative}"
    if tensor_parallel_size > 1:
        raise ValueError(f"{setting} is not supported with tensor parallelism yet: set "
                         "HFENDPOINT_TENSOR_PARALLEL_SIZE=1 or use ngram or suffix drafts")
    if model.kv_window:
        raise ValueError(f"{setting} is not supported for a model whose every layer has a sliding window (its "
                         "blocks behind the window are given back): use ngram or suffix drafts")
