"""Token choice for a whole batch on the device; only the chosen ids go back to the host.

Order (as vLLM and the OpenAI API define it): repetition penalty (prompt and output tokens), frequency
and presence penalties (output tokens), then greedy rows take the argmax; the others divide by their
temperature, drop tokens under min_p * max probability, outside the top k, and outside the top-p
nucleus, and draw with the exponential-race trick argmax(p / q), q ~ Exp(1). The race lets each seeded
request draw its noise from its own generator, so its tokens do not depend on its batch neighbours.

A batch that asks only for temperature (the common case) is drawn in one pass over the logits instead
(kernels.gumbel_argmax: Gumbel-max with noise keyed per row); a seeded request's key is its seed and the
position of the token drawn, so its tokens still depend on nothing else.
"""
import numpy as np
import torch
from torch import Tensor

import kernels
from engine.sequence import Sequence
from engine.upload_ring import UploadRing

INT63 = 2**63


class SamplingPlan:
    """What one batch of requests asks of the sampler, with its per-row parameters already on the device."""

    def __init__(self, seqs: list[Sequence], uploads: UploadRing):
        params = [seq.params for seq in seqs]
        self.penalised = any(p.penalised for p in params)
        self.all_greedy = all(p.greedy for p in params)
        self.any_greedy = any(p.greedy for p in params)
        self.uses_min_p = any(p.min_p > 0 for p in params)
        self.uses_top_k_top_p = any(p.top_k > 0 or p.top_p < 1 for p in params)
        self.seeded_rows = [row for row, p in enumerate(params) if p.seed is not None and not p.greedy]
        if not self.all_greedy:
            values = np.array([(1.0 if p.greedy else p.temperature, p.top_p, p.min_p, max(p.top_k, 0), p.greedy)
                               for p in params], dtype=np.float32).T
            self.temperature, self.top_p, self.min_p, self.top_k, greedy = uploads.upload(values)
            self.greedy = greedy.bool()
            self.temperature_or_zero = torch.where(self.greedy, 0.0, self.temperature)
        self.one_pass = not (self.uses_min_p or self.uses_top_k_top_p)
        self.penalty_counts: PenaltyCounts | None = None  # made at the batch's first penalised step


class PenaltyCounts:
    """The token statistics penalties need, for the penalised rows of one batch, kept on the device as long
    as the batch lasts (its plan's lifetime): which tokens each row's prompt holds, and how often each token
    occurs in its output. A step counts only the output tokens added since the last, instead of every token
    of every request."""

    def __init__(self, seqs: list[Sequence], vocab_size: int, uploads: UploadRing):
        rows = [i for i, seq in enumerate(seqs) if seq.params.penalised]
        self.rows, self.uploads = uploads.upload(np.array(rows, dtype=np.int64)), uploads
        params = [seqs[i].params for i in rows]
        values = np.array([(p.repetition_penalty, p.frequency_penalty, p.presence_penalty) for p in params],
                          dtype=np.float32).T
        self.repetition, self.frequency, self.presence = uploads.upload(values)
        prompts = torch.zeros(len(rows), vocab_size + 1, device=uploads.device)  # the last column takes the padding
        add_token_counts(prompts, [seqs[i].token_ids[:seqs[i].num_prompt_tokens] for i in rows], uploads)
        self.prompt_seen = prompts[:, :vocab_size] > 0
        self.output_counts = torch.zeros(len(rows), vocab_size + 1, device=uploads.device)
        self.penalised_seqs = [seqs[i] for i in rows]
        self.counted = [0] * len(rows)

    def update(self) -> None:
        """Counts the output tokens each row gained since the last call."""
        outputs = [seq.output_token_ids for seq in self.penalised_seqs]
        add_token_counts(self.output_counts, [out[n:] for out, n in zip(outputs, self.counted)], self.uploads)
        self.counted = [len(out) for out in outputs]


class Sampler:
    def __init__(self, device: torch.device, seed: int | None = None):
        self.device = device
        self.generator = torch.Generator(device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self.row_seed_source = np.random.default_rng(seed)
        self.uploads = UploadRing(device)
        self.planned_seqs: list[Sequence] = []
        self.plan: SamplingPlan | None = None

    @torch.inference_mode()
    def __call__(self, logits: Tensor, seqs: list[Sequence], ahead: int | list[int] = 0) -> Tensor:
        """logits [N, V] (any float dtype; bf16 from a bf16 model), one row per request -> int64 [N] token ids,
        on the device. ahead: how many tokens each request (or every request) has drawn beyond its token_ids
        (a step launched before the last one finished). Every path computes in float32: the argmax and the
        one-pass kernel read bf16 exactly, the temperature division promotes, penalties take a float32 copy."""
        plan = self.plan_for(seqs)
        if plan.penalised:
            logits = self.apply_penalties(logits.float(), seqs)
        if plan.all_greedy:
            return logits.argmax(-1)
        if plan.one_pass:
            return self.sample_in_one_pass(logits, seqs, plan, ahead)
        probs = torch.softmax(logits / plan.temperature[:, None], dim=-1)
        if plan.uses_min_p:
            probs = probs.masked_fill(probs < plan.min_p[:, None] * probs.amax(-1, keepdim=True), 0)
        if plan.uses_top_k_top_p:
            probs = top_k_top_p(probs, plan.top_k, plan.top_p)
        noise = self.exponential_noise(probs, seqs, plan.seeded_rows)
        sampled = (probs / noise).argmax(-1)
        if plan.any_greedy:
            sampled = torch.where(plan.greedy, logits.argmax(-1), sampled)
        return sampled

    def plan_for(self, seqs: list[Sequence]) -> SamplingPlan:
        """The batch's plan, rebuilt only when the batch changes (decode steps mostly repeat the last one)."""
        if seqs != self.planned_seqs:  # identity per element: a C loop, no Python per request
            self.planned_seqs, self.plan = list(seqs), SamplingPlan(seqs, self.uploads)
        return self.plan

    def sample_in_one_pass(self, logits: Tensor, seqs: list[Sequence], plan: SamplingPlan,
                           ahead: int | list[int]) -> Tensor:
        """Gumbel-max over each row; a row's Philox key is fresh randomness, or for a seeded request a hash of
        its seed and the position of the token it draws."""
        seeds = self.row_seed_source.integers(0, INT63, size=len(seqs), dtype=np.int64)
        for row in plan.seeded_rows:
            seq = seqs[row]
            position = len(seq) + (ahead if isinstance(ahead, int) else ahead[row])
            seeds[row] = (seq.params.seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) % INT63
        return kernels.gumbel_argmax(logits, plan.temperature_or_zero, self.uploads.upload(seeds))

    def exponential_noise(self, probs: Tensor, seqs: list[Sequence], seeded_rows: list[int]) -> Tensor:
        """Exp(1) noise; the rows of seeded requests draw from their own generators."""
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row in seeded_rows:
            seq = seqs[row]
            if seq.generator is None:
                seq.generator = torch.Generator(self.device).manual_seed(seq.params.seed)
            noise[row].exponential_(generator=seq.generator)
        return noise.clamp_(min=1e-20)  # a zero draw would turn a masked token's 0 / 0 into NaN

    def apply_penalties(self, logits: Tensor, seqs: list[Sequence]) -> Tensor:
        """Penalised copy of logits, from the batch's token counts (PenaltyCounts)."""
        plan = self.plan_for(seqs)
        if plan.penalty_counts is None:
            plan.penalty_counts = PenaltyCounts(seqs, logits.shape[1], self.uploads)
        counts = plan.penalty_counts
        counts.update()
        output_counts = counts.output_counts[:, :logits.shape[1]]
        picked = logits[counts.rows]
        penalty = torch.where(counts.prompt_seen | (output_counts > 0), counts.repetition[:, None], 1.0)
        picked = torch.where(picked > 0, picked / penalty, picked * penalty)
        picked = picked - counts.frequency[:, None] * output_counts - counts.presence[:, None] * (output_counts > 0)
        logits = logits.clone()
        logits[counts.rows] = picked
        return logits


def add_token_counts(counts: Tensor, token_lists: list[list[int]], uploads: UploadRing) -> None:
    """Adds how often each vocabulary id occurs in each list to counts [len(token_lists), vocab + 1], whose
    last column takes the padding."""
    width = max(1, max(len(tokens) for tokens in token_lists))
    padded = np.full((len(token_lists), width), counts.shape[1] - 1, dtype=np.int64)
    for row, tokens in enumerate(token_lists):
        padded[row, :len(tokens)] = tokens
    ids = uploads.upload(padded)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))


def top_k_top_p(probs: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Zeroes probabilities outside each row's top k (0: all) and its top-p nucleus (always keeps the top one)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[1], device=probs.device)
    cumulative = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly before each token
    drop = (cumulative >= top_p[:, None] * sorted_probs.sum(-1, keepdim=True)) & (rank > 0)
    drop |= (top_k[:, None] > 0) & (rank >= top_k[:, None])
    return probs.scatter(1, order, sorted_probs.masked_fill(drop, 0))
