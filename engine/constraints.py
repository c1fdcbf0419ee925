"""Constraints on which tokens a request may take next (structured outputs, forced tool calls): per-request
objects the engine does not look into. A constraint has

    accept_token(token_id) -> bool    advances past a token the request took (False: the token breaks it)
    is_terminated() -> bool           it has ended: the request finishes with "stop"
    fill_bitmasks(constraints, bitmask, rows)
                                      a static method of its class: writes the tokens each of `constraints`
                                      allows next into row rows[i] of bitmask (int32 [R, ceil(V / 32)], bit
                                      t % 32 of word t // 32 set where token t is allowed; xgrammar's layout),
                                      all at once, so that a library can fill a batch in parallel

The engine calls accept_token once per token a request takes (never again for tokens it recomputes after a
preemption or finds in the prefix cache), and fills masks only for the rows of a step that sample.
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

    def build(self, seqs: list[Sequence]) -> tuple[Tensor, Tensor] | None:
        """(bitmask, rows) on the device for the constrained rows of a batch of sampling rows, or None when it
        has none. A row whose request has finished (its token will be thrown away) allows every token."""
        rows = [row for row, seq in enumerate(seqs) if seq.constraint is not None]
        if not rows:
            return None
        index, self.turn = self.turn, 1 - self.turn
        if self.on_cuda:
            self.copied[index].synchronize()
        bitmask = self.buffers[index][:len(rows)]
        groups: dict[type, tuple[list, list[int]]] = {}
        for slot, row in enumerate(rows):
            seq = seqs[row]
            if seq.is_finished:
                bitmask[slot] = -1
                continue
            constraints, slots = groups.setdefault(type(seq.constraint), ([], []))
            constraints.append(seq.constraint)
            slots.append(slot)
        for kind, (constraints, slots) in groups.items():
            kind.fill_bitmasks(constraints, bitmask, slots)
        rows_on_device = self.uploads.upload(np.array(rows, dtype=np.int64))
        if not self.on_cuda:
            return bitmask, rows_on_device
        on_device = bitmask.to(self.uploads.device, non_blocking=True)
        self.copied[index].record()
        return on_device, rows_on_device
