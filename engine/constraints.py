"""Constraints on which tokens a request may take next (structured outputs, forced tool calls): per-request
objects the engine does not look into. A constraint has

    accept_token(token_id) -> bool    advances past a token the request took (False: the token breaks it)
    rollback(num_tokens)              undoes the last num_tokens tokens it accepted (speculative decoding
                                      judges draft tokens with it, then takes them back)
    is_terminated() -> bool           it has ended: the request finishes with "stop"
    fill_bitmasks(constraints, bitmask, rows)
                                      a static method of its class: writes the tokens each of `constraints`
                                      allows next into row rows[i] of bitmask (int32 [R, ceil(V / 32)], bit
                                      t % 32 of word t // 32 set where token t is allowed; xgrammar's layout),
                                      all at once, so that a library can fill a batch in parallel

The engine calls accept_token once per token a request takes (never again for tokens it recomputes after a
preemption or finds in the prefix cache), and fills masks only for the rows of a step that sample. Draft
tokens are accepted only while their masks are filled, and rolled back at once.
"""
import numpy as np
import torch
from torch import Tensor

from engine.sequence import Sequence
from engine.upload_ring import UploadRing


class TokenMasks:
    """The bitmasks of a step's constrained rows, filled on the host and copied to the device. Two pinned
    buffers, used in turn: one may still be on its way to the device while the next step's is filled."""

    def __init__(self, vocab_size: int, max_rows: int, uploads: UploadRing):
        self.uploads = uploads
        self.on_cuda = uploads.on_cuda
        shape = (max_rows, -(-vocab_size // 32))
        self.buffers = [torch.empty(shape, dtype=torch.int32, pin_memory=self.on_cuda) for _ in range(2)]
        self.copied = [torch.cuda.Event() for _ in self.buffers] if self.on_cuda else []
        self.turn = 0

    def build(self, seqs: list[Sequence], drafts: list[list[int]] | None = None) -> tuple[Tensor, Tensor] | None:
        """(bitmask, rows) on the device for the constrained rows of a batch of sampling rows, or None when it
        has none. A row whose request has finished (its token will be thrown away) allows every token.

        drafts: a verification step's draft tokens per request, whose rows are one per draft token and one
        more: the mask of its j-th row is what its constraint allows after the first j draft tokens (which
        valid_draft has checked)."""
        drafts = drafts or [[]] * len(seqs)
        rows, row = [], 0  # each constrained request's first row (slot), by request
        firsts: list[tuple[int, int]] = []
        for i, (seq, draft) in enumerate(zip(seqs, drafts)):
            if seq.constraint is not None:
                firsts.append((i, len(rows)))
                rows.extend(range(row, row + len(draft) + 1))
            row += len(draft) + 1
        if not rows:
            return None
        index, self.turn = self.turn, 1 - self.turn
        if self.on_cuda:
            self.copied[index].synchronize()
        bitmask = self.buffers[index][:len(rows)]
        for depth in range(1 + max(len(drafts[i]) for i, _ in firsts)):
            deep = [(seqs[i], drafts[i], slot + depth) for i, slot in firsts if len(drafts[i]) >= depth]
            fill_masks(bitmask, deep)
            for seq, draft, _ in deep:
                if depth < len(draft):
                    seq.constraint.accept_token(draft[depth])
        for i, _ in firsts:
            if drafts[i]:
                seqs[i].constraint.rollback(len(drafts[i]))
        rows_on_device = self.uploads.upload(np.array(rows, dtype=np.int64))
        if not self.on_cuda:
            return bitmask, rows_on_device
        on_device = bitmask.to(self.uploads.device, non_blocking=True)
        self.copied[index].record()
        return on_device, rows_on_device


def fill_masks(bitmask: Tensor, rows: list[tuple[Sequence, list[int], int]]) -> None:
    """Writes what each (request, _, slot)'s constraint allows next into bitmask[slot], a batch per constraint
    type; a finished request, or one whose draft tokens end its constraint, allows every token (the row's
    token is thrown away)."""
    groups: dict[type, tuple[list, list[int]]] = {}
    for seq, _, slot in rows:
        if seq.is_finished or seq.constraint.is_terminated():
            bitmask[slot] = -1
            continue
        constraints, slots = groups.setdefault(type(seq.constraint), ([], []))
        constraints.append(seq.constraint)
        slots.append(slot)
    for kind, (constraints, slots) in groups.items():
        kind.fill_bitmasks(constraints, bitmask, slots)


def valid_draft(constraint, draft: list[int]) -> list[int]:
    """The leading draft tokens the constraint accepts, up to one that ends it; the constraint is left as it
    was."""
    valid = 0
    for token_id in draft:
        if not constraint.accept_token(token_id):
            break
        valid += 1
        if constraint.is_terminated():
            break
    if valid:
        constraint.rollback(valid)
    return draft[:valid]
