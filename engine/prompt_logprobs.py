"""Prompt logprobs (vLLM's `prompt_logprobs`): the log-probability the model gives each prompt token after the
tokens before it, with the k most likely tokens at its position, for the requests that ask.

The logits at position p predict token p + 1, so a step computing prompt positions start..end-1 of such a request
yields the logprobs of its prompt tokens start+1..end (up to its last prompt token: the last position's logits
choose the first output token, as for every request). They come from the LM head over those rows of the step's
hidden states, a slice of rows at a time so that a long chunk never holds the logits of all its positions at once,
and they are the model's own distribution: no bias, penalty or grammar applies to a prompt. A position computed
again (after a preemption) rewrites its entry with the same values. The prefix cache serves such a request nothing
until its prompt is done (Sequence.needs_prompt_logits), so every position is computed.
"""
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.sampler import logprob_entry, logprob_table
from engine.sequence import Sequence

SLICE_ROWS = 256  # hidden rows per LM-head call


@dataclass
class PromptLogitRows:
    """The rows of a step's hidden states whose logits give prompt logprobs (picklable: tensor-parallel ranks
    compute them too)."""
    rows: list[int]
    targets: list[int]  # the prompt token each row's logits are read at
    owners: list[tuple[int, int]]  # (the sequence's place in the step, the prompt token's index) of each row
    top: int  # the most alternatives any of the step's requests asks for


def prompt_logit_rows(seqs: list[Sequence], num_tokens: list[int],
                      ahead: list[int] | None = None) -> PromptLogitRows | None:
    """The step's rows that yield prompt logprobs, or None when no request in it needs any. ahead: the tokens
    each sequence has in the step in flight (engine/step_inputs.py)."""
    rows, targets, owners, top, first_row = [], [], [], 0, 0
    for i, (seq, n) in enumerate(zip(seqs, num_tokens)):
        if seq.needs_prompt_logits:
            start = seq.num_computed_tokens + (ahead[i] if ahead else 0)
            for position in range(start, min(start + n, seq.num_prompt_tokens - 1)):
                rows.append(first_row + position - start)
                targets.append(seq.token_ids[position + 1])
                owners.append((i, position + 1))
            top = max(top, seq.params.prompt_logprobs)
        first_row += n
    return PromptLogitRows(rows, targets, owners, top) if rows else None


def compute_prompt_logprobs(model, hidden: Tensor, wanted: PromptLogitRows) -> Tensor | None:
    """logprob_table rows [len(wanted.rows), 1 + 2 top] on the device, on rank 0 (None on the other
    tensor-parallel ranks, which run the LM head with it)."""
    index = torch.tensor(wanted.rows, device=hidden.device)
    targets = torch.tensor(wanted.targets, device=hidden.device)
    parts = []
    for start in range(0, len(index), SLICE_ROWS):
        logits = model.compute_logits(hidden[index[start:start + SLICE_ROWS]])
        if logits is not None:
            parts.append(logprob_table(logits, targets[start:start + SLICE_ROWS], wanted.top))
    return torch.cat(parts) if parts else None


def record_prompt_logprobs(seqs: list[Sequence], wanted: PromptLogitRows, values: Tensor) -> None:
    """Writes each computed prompt token's entry (its logprob, the top ids, theirs) into its sequence."""
    for (i, token_index), row in zip(wanted.owners, values.tolist()):
        seq = seqs[i]
        seq.prompt_logprobs[token_index] = logprob_entry(row, seq.params.prompt_logprobs)
