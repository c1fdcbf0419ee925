"""Token choice for a whole batch on the device; only the chosen ids (and logprobs, for rows that ask) go back
to the host.

Order (as vLLM and the OpenAI API define it): logit bias, repetition penalty (prompt and output tokens),
frequency and presence penalties (output tokens), the token masks of constrained rows (grammars: tokens they
rule out get -inf), then greedy rows take the argmax; the others divide by their
temperature, drop tokens under min_p * max probability, outside the top k, and outside the top-p
nucleus, and draw from what is left.

Every draw is Gumbel-max with noise keyed per row (kernels.gumbel_argmax, one pass over the logits): a batch
that asks only for temperature (the common case) draws from its logits as they are, any other batch from its
logits with the dropped tokens set to -inf. A seeded request's key is a hash of its seed and the position of
the token drawn, so its tokens depend on its seed, its positions and its own settings, never on its batch.

Logprobs are the log-softmax of the logits after bias, penalties and grammar masks, before temperature, top-k,
top-p and min-p: the distribution the row's token was chosen from, at temperature 1 (so a temperature does not
change them, and a token a mask rules out is never reported as chosen). vLLM reports the raw model's by
default; OpenAI's are unaffected by temperature too.
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
        self.uses_masks = self.uses_min_p or self.uses_top_k_top_p
        self.penalty_counts: PenaltyCounts | None = None  # made at the batch's first penalised step
        self.constrained = any(seq.constraint is not None for seq in seqs)  # masks to apply (engine/constraints.py)
        self.bias = logit_bias(params, uploads)
        self.logprob_rows = [row for row, p in enumerate(params) if p.logprobs is not None]
        if self.logprob_rows:
            self.num_top_logprobs = max(params[row].logprobs for row in self.logprob_rows)
            self.logprob_rows_on_device = uploads.upload(np.array(self.logprob_rows, dtype=np.int64))


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
        """seed: where unseeded requests' keys come from (None: fresh randomness)."""
        self.device = device
        self.row_seed_source = np.random.default_rng(seed)
        self.uploads = UploadRing(device)
        self.planned_seqs: list[Sequence] = []
        self.plan: SamplingPlan | None = None

    def __call__(self, logits: Tensor, seqs: list[Sequence], ahead: int | list[int] = 0) -> Tensor:
        """The token ids of sample(), for a batch without masks."""
        return self.sample(logits, seqs, ahead)[0]

    @torch.inference_mode()
    def sample(self, logits: Tensor, seqs: list[Sequence], ahead: int | list[int] = 0,
               masks: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor | None]:
        """logits [N, V] (any float dtype; bf16 from a bf16 model), one row per request -> int64 [N] token ids,
        on the device, and the logprobs of the rows that ask (top_logprobs), or None when none does. ahead: how
        many tokens each request (or every request) has drawn beyond its token_ids (a step launched before the
        last one finished). masks: (bitmask, rows) for kernels.apply_token_bitmask, the allowed tokens of the
        constrained rows. Every path computes in float32: the argmax and the Gumbel-max kernel read bf16 exactly,
        the temperature division promotes, bias, penalties and top-k/top-p/min-p masks take a float32 copy."""
        plan = self.plan_for(seqs)
        if plan.bias is not None:
            logits = logits.float().index_put_(plan.bias[:2], plan.bias[2], accumulate=True)
        if plan.penalised:
            logits = self.apply_penalties(logits.float(), seqs)
        if masks is not None:
            kernels.apply_token_bitmask(logits, *masks)
        sampled = self.choose(logits, seqs, plan, ahead)
        return sampled, top_logprobs(logits, sampled, plan) if plan.logprob_rows else None

    @torch.inference_mode()
    def verify(self, logits: Tensor, row_seqs: list[Sequence], targets: np.ndarray,
               masks: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor | None]:
        """Speculative sampling over the rows of a verification step: logits [R, V], row_seqs[r] the request of
        row r (a request verifying d draft tokens has d + 1 consecutive rows), targets[r] the draft token row r
        judges (-1: a request's last row, which only draws). Returns int64 [2 R] on the device, each row's
        drawn token then whether it accepts its draft token, and the logprobs of the rows that ask (of the
        token each row contributes: its draft token where accepted, else its drawn one).

        A greedy row accepts its draft token when it is the argmax, else its token is the argmax. Any other
        row accepts draft token x with probability p(x), p its distribution after temperature, top-k, top-p and
        min-p (the rule of speculative sampling for a drafter that proposes x with certainty), and draws from p
        without x, renormalised: the residual max(p - q, 0) of that rule. A request takes its accepted prefix
        and then the token of its first rejecting row (or of its last row), so each token it takes has exactly
        the distribution plain sampling gives it. Penalised requests, and seeded ones that are not greedy, never
        draft."""
        plan = self.plan_for(row_seqs)
        if plan.bias is not None:
            logits = logits.float().index_put_(plan.bias[:2], plan.bias[2], accumulate=True)
        if masks is not None:
            kernels.apply_token_bitmask(logits, *masks)
        targets = self.uploads.upload(targets)
        judged = targets >= 0
        draft = targets.clamp(min=0)
        argmax = logits.argmax(-1)
        if plan.all_greedy:
            drawn, accepted = argmax, judged & (argmax == draft)
        else:
            kept = logits.float()
            if plan.uses_masks:
                kept = kept.masked_fill(self.dropped(logits, plan), float("-inf"))
            probs = torch.softmax(kept / plan.temperature[:, None], dim=-1)
            accepted = judged & (torch.rand(len(targets), device=logits.device)
                                 < probs.gather(1, draft[:, None]).squeeze(1))
            residual = kept.scatter(1, draft[:, None], torch.where(judged, float("-inf"), kept.gather(
                1, draft[:, None]).squeeze(1))[:, None])
            seeds = self.uploads.upload(self.row_seed_source.integers(0, INT63, size=len(targets), dtype=np.int64))
            drawn = kernels.gumbel_argmax(residual, plan.temperature_or_zero, seeds)
            if plan.any_greedy:
                drawn = torch.where(plan.greedy, argmax, drawn)
                accepted = torch.where(plan.greedy, judged & (argmax == draft), accepted)
        packed = torch.cat((drawn, accepted.long()))
        if not plan.logprob_rows:
            return packed, None
        return packed, top_logprobs(logits, torch.where(accepted, draft, drawn), plan)

    def choose(self, logits: Tensor, seqs: list[Sequence], plan: SamplingPlan, ahead: int | list[int]) -> Tensor:
        if plan.all_greedy:
            return kernels.gumbel_argmax(logits, None, None)
        if not plan.uses_masks:
            return self.draw(logits, seqs, plan, ahead)
        sampled = self.draw(logits.float().masked_fill(self.dropped(logits, plan), float("-inf")), seqs, plan, ahead)
        if plan.any_greedy:  # a greedy row's own argmax, whatever the masks keep of a tie
            sampled = torch.where(plan.greedy, logits.argmax(-1), sampled)
        return sampled

    def plan_for(self, seqs: list[Sequence]) -> SamplingPlan:
        """The batch's plan, rebuilt only when the batch changes (decode steps mostly repeat the last one)."""
        if seqs != self.planned_seqs:  # identity per element: a C loop, no Python per request
            self.planned_seqs, self.plan = list(seqs), SamplingPlan(seqs, self.uploads)
        return self.plan

    def draw(self, logits: Tensor, seqs: list[Sequence], plan: SamplingPlan, ahead: int | list[int]) -> Tensor:
        """Gumbel-max over each row of logits / temperature (greedy rows: the argmax); a row's noise key is
        fresh randomness, or for a seeded request a hash of its seed and the position of the token it draws."""
        seeds = self.row_seed_source.integers(0, INT63, size=len(seqs), dtype=np.int64)
        for row in plan.seeded_rows:
            seq = seqs[row]
            position = len(seq) + (ahead if isinstance(ahead, int) else ahead[row])
            seeds[row] = (seq.params.seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) % INT63
        return kernels.gumbel_argmax(logits, plan.temperature_or_zero, self.uploads.upload(seeds))

    @staticmethod
    def dropped(logits: Tensor, plan: SamplingPlan) -> Tensor:
        """Which tokens min_p, top_k and top_p take out of each row, judged on its tempered probabilities; a row
        that asks for none of them keeps every token."""
        probs = torch.softmax(logits / plan.temperature[:, None], dim=-1)
        dropped = torch.zeros_like(probs, dtype=torch.bool)
        if plan.uses_min_p:
            dropped = probs < plan.min_p[:, None] * probs.amax(-1, keepdim=True)
        if plan.uses_top_k_top_p:
            dropped |= outside_top_k_top_p(probs, plan.top_k, plan.top_p)
        return dropped

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


def logit_bias(params, uploads: UploadRing) -> tuple[Tensor, Tensor, Tensor] | None:
    """The batch's logit biases as (rows, token ids, biases) on the device, or None when no row has any."""
    entries = [(row, token, bias) for row, p in enumerate(params) for token, bias in (p.logit_bias or {}).items()]
    if not entries:
        return None
    rows, tokens, biases = zip(*entries)
    return (uploads.upload(np.array(rows, dtype=np.int64)), uploads.upload(np.array(tokens, dtype=np.int64)),
            uploads.upload(np.array(biases, dtype=np.float32)))


def top_logprobs(logits: Tensor, sampled: Tensor, plan: SamplingPlan) -> Tensor:
    """The logprob_table of the plan's logprob rows, in that order, at their sampled tokens."""
    if len(plan.logprob_rows) < len(sampled):
        rows = plan.logprob_rows_on_device
        logits, sampled = logits[rows], sampled[rows]
    return logprob_table(logits, sampled, plan.num_top_logprobs)


def logprob_table(logits: Tensor, token_ids: Tensor, k: int) -> Tensor:
    """float32 [N, 1 + 2 k]: each row's logprob of its token, then the k most likely tokens' logprobs (descending),
    then their ids (exact as float32 below 2**24)."""
    logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    chosen = logprobs.gather(1, token_ids[:, None])
    top, ids = logprobs.topk(k, dim=-1)
    return torch.cat((chosen, top, ids.float()), dim=1)


def logprob_entry(values: list[float], k: int) -> tuple[float, list[int], list[float]]:
    """One row of a logprob_table read on the host, its first k alternatives kept: (the token's logprob, the top
    ids, their logprobs)."""
    width = (len(values) - 1) // 2
    return values[0], [int(token_id) for token_id in values[1 + width:1 + width + k]], values[1:1 + k]


def add_token_counts(counts: Tensor, token_lists: list[list[int]], uploads: UploadRing) -> None:
    """Adds how often each vocabulary id occurs in each list to counts [len(token_lists), vocab + 1], whose
    last column takes the padding."""
    width = max(1, max(len(tokens) for tokens in token_lists))
    padded = np.full((len(token_lists), width), counts.shape[1] - 1, dtype=np.int64)
    for row, tokens in enumerate(token_lists):
        padded[row, :len(tokens)] = tokens
    ids = uploads.upload(padded)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))


def outside_top_k_top_p(probs: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """True for the tokens outside each row's top k (0: all) and outside its top-p nucleus (1: all); the most
    probable token always stays."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[1], device=probs.device)
    cumulative = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly before each token
    drop = (cumulative >= top_p[:, None] * sorted_probs.sum(-1, keepdim=True)) & (rank > 0) & (top_p[:, None] < 1)
    drop |= (top_k[:, None] > 0) & (rank >= top_k[:, None])
    return torch.zeros_like(drop).scatter(1, order, drop)
