"""Speculative decoding: which steps draft, how many tokens each request drafts, and what the verifications
achieved.

A step that drafts gives each decoding request up to k guessed tokens (engine/drafters.py, or an EAGLE-3 draft
head's, engine/eagle3_drafter.py); the model scores the request's last token and its draft in one forward, and
the sampler keeps the longest prefix the model itself would have produced (engine/sampler.py's verify), plus
one token of its own. A drafting step needs the tokens of the step before it on the host, so it never runs
overlapped: it costs the host work that overlap hides, and its extra tokens cost compute that a large batch
does not have spare.

So speculation backs off by itself, per step:
- per request, k follows its recent acceptance: the expected run of accepted tokens at that rate, plus one;
- per step, a batch whose requests expect too few accepted tokens does not draft, and the drafts of a step
  fit into one decode step of max_num_seqs rows (a row per token); a batch of more than half that many
  requests never drafts (most of its requests would get no draft, all of them would lose the overlap), and
  costs the speculator nothing per step: no measurement, no loop over its requests, no drafter bookkeeping
  (a drafter learns a request's tokens only when it proposes for it);
- per batch size (batches of 2^(b-1)..2^b - 1 requests share a record), decoding steps measure output
  tokens per second and running request with and without drafting, and the faster mode runs; the slower is
  tried again now and then (less often each time it loses), since acceptance and batch composition change.
  Per request, since within a record the batch shrinks as requests finish: a step's time grows far less
  than its batch, so a rate per request compares the two modes across sizes better than a rate per step.
"""
import math
import time

from engine.constraints import valid_draft
from engine.drafters import DRAFTERS
from engine.sequence import Sequence

ACCEPTANCE_MEMORY = 0.7  # weight of the past in a request's moving acceptance
MIN_EXPECTED_GAIN = 0.1  # accepted tokens per request and step below which a step does not draft
RATE_MEMORY = 0.7        # weight of the past in a batch size's measured tokens per second
RETRY_AFTER_STEPS, MAX_RETRY_AFTER_STEPS, RETRY_STEPS = 32, 2048, 3
NO_SPECULATION = {"spec_drafted_tokens": 0, "spec_accepted_tokens": 0}  # the stats of an engine that never drafts


class ModeRecord:
    """Measured output tokens per second of decoding steps with and without drafting, for one batch-size
    class, and which mode to run next."""

    def __init__(self):
        self.rates: dict[bool, float] = {}
        self.steps_since_retry = 0
        self.retry_after = RETRY_AFTER_STEPS
        self.retrying = 0  # steps left of the slower mode's retry
        self.best_before_retry = True

    def best(self) -> bool:
        return self.rates.get(True, math.inf) >= self.rates.get(False, -math.inf) if self.rates else True

    def choose(self) -> bool:
        if len(self.rates) < 2:  # measure each mode first
            return True not in self.rates
        best = self.best()
        if self.retrying:
            self.retrying -= 1
            if not self.retrying:  # the slower mode lost again: try it less often
                won = best != self.best_before_retry
                self.retry_after = RETRY_AFTER_STEPS if won else min(2 * self.retry_after, MAX_RETRY_AFTER_STEPS)
            return not best
        self.steps_since_retry += 1
        if self.steps_since_retry >= self.retry_after:
            self.steps_since_retry, self.retrying, self.best_before_retry = 0, RETRY_STEPS, best
        return best

    def record(self, drafting: bool, rate: float) -> None:
        old = self.rates.get(drafting)
        self.rates[drafting] = rate if old is None else RATE_MEMORY * old + (1 - RATE_MEMORY) * rate


class Speculator:
    def __init__(self, method: str, max_draft_tokens: int, max_rows: int, drafter=None):
        """max_rows: the most rows a decode step has (max_num_seqs): a step's drafts are cut to fit its requests'
        rows and theirs into one, so that it verifies them as a decode step (engine/step_inputs.py). drafter:
        one the runner made (a draft model's, engine/eagle3_drafter.py), else the method's own."""
        self.drafter = drafter or DRAFTERS[method]()
        self.max_draft_tokens, self.max_rows = max_draft_tokens, max_rows
        self.adaptive = True  # False: every step drafts (tests)
        self.modes: dict[int, ModeRecord] = {}
        self.num_drafted = self.num_accepted = 0
        self.last_step_end: float | None = None
        self.last_mode: bool | None = None

    def decide(self, running: list[Sequence]) -> bool:
        """Whether the next step drafts (see the module's docstring); counts as one step of its batch size."""
        if not self.adaptive:
            return True
        if not self.may_draft(len(running)):
            return False
        if not self._record(len(running)).choose():
            return False  # first, as it is cheap: a large batch that drafts no more costs no loop over it
        return sum(expected_accepted(seq.acceptance, draft_length(seq, self.max_draft_tokens)) for seq in running
                   if can_draft(seq)) >= MIN_EXPECTED_GAIN * len(running)

    def may_draft(self, num_running: int) -> bool:
        """Whether a batch this large leaves every request a row for a draft token, on average."""
        return 2 * num_running <= self.max_rows

    def propose(self, running: list[Sequence]) -> None:
        """Gives each decoding request that may draft its draft tokens for the next step, oldest first while the
        step's rows last. A batched drafter (a draft model's) proposes for all of them in one call, each
        request's k counted against the rows."""
        if getattr(self.drafter, "batched", False):
            self._propose_batch(running)
            return
        rows_left = self.max_rows - len(running)
        for seq in running:
            if can_draft(seq):
                k = self._draft_size(seq, rows_left)
                set_draft(seq, self.drafter.propose(seq, k) if k > 0 else [])
                rows_left -= len(seq.draft_token_ids)

    def _propose_batch(self, running: list[Sequence]) -> None:
        rows_left, drafting, lengths = self.max_rows - len(running), [], []
        for seq in running:
            if can_draft(seq):
                k = self._draft_size(seq, rows_left)
                seq.draft_token_ids = []
                if k > 0:
                    drafting.append(seq)
                    lengths.append(k)
                    rows_left -= k
        if drafting:
            for seq, draft in zip(drafting, self.drafter.propose_batch(drafting, lengths)):
                set_draft(seq, draft)

    def _draft_size(self, seq: Sequence, rows_left: int) -> int:
        """How many tokens a request drafts: by its acceptance, within its length limit and the step's rows."""
        return min(draft_length(seq, self.max_draft_tokens), seq.max_len - len(seq.token_ids), rows_left)

    def verified(self, seqs: list[Sequence], sampled: list) -> None:
        """Counts a verification step's drafted and accepted tokens, per request and in total, before the
        scheduler applies it (sampled: each request's accepted drafts and its own next token)."""
        for seq, tokens in zip(seqs, sampled):
            if not isinstance(tokens, list) or not seq.draft_token_ids:
                continue
            drafted, accepted = len(seq.draft_token_ids), len(tokens) - 1
            self.num_drafted += drafted
            self.num_accepted += accepted
            seq.acceptance = ACCEPTANCE_MEMORY * seq.acceptance + (1 - ACCEPTANCE_MEMORY) * accepted / drafted

    def step_done(self, num_running: int, drafting: bool, decoding: bool, num_tokens: int) -> None:
        """Measures a finished step: output tokens per second and request since the last one ended, recorded
        for its batch size and mode when it only decoded and the step before ran in the same mode (a switch's
        first step pays for the switch)."""
        now = time.perf_counter()
        if decoding and self.last_mode is drafting and self.last_step_end is not None:
            rate = num_tokens / max(now - self.last_step_end, 1e-9) / num_running
            self._record(num_running).record(drafting, rate)
        self.last_step_end, self.last_mode = now, drafting if decoding else None

    def step_skipped(self) -> None:
        """A step of a batch too large to draft: the next step's time is not measured from its end."""
        self.last_mode = None

    def _record(self, num_running: int) -> ModeRecord:
        """The mode record of a batch of this size (made on first use)."""
        bucket = num_running.bit_length()
        record = self.modes.get(bucket)
        if record is None:
            record = self.modes[bucket] = ModeRecord()
        return record

    def stats(self) -> dict:
        return {"spec_drafted_tokens": self.num_drafted, "spec_accepted_tokens": self.num_accepted}


def set_draft(seq: Sequence, draft: list[int]) -> None:
    """A request's draft for the next step: the drafter's, cut where its constraint would reject a token."""
    seq.draft_token_ids = valid_draft(seq.constraint, draft) if seq.constraint and draft else draft


def can_draft(seq: Sequence) -> bool:
    """A decoding request whose tokens the sampler can verify: not penalised (its penalties would change
    along the draft), not seeded unless greedy (its tokens follow its seed and positions). A constrained
    request drafts only tokens its constraint accepts (engine/constraints.py's valid_draft)."""
    params = seq.params
    return (len(seq.token_ids) - seq.num_computed_tokens == 1 and not params.penalised
            and (params.seed is None or params.greedy))


def draft_length(seq: Sequence, most: int) -> int:
    """The expected run of accepted tokens at the request's recent acceptance, plus one, at most `most`."""
    rate = seq.acceptance
    return most if rate >= 1 else max(1, min(most, int(rate / (1 - rate)) + 1))


def expected_accepted(rate: float, k: int) -> float:
    """Expected accepted tokens of a k-token draft whose tokens are each accepted with probability `rate`."""
    return k if rate >= 1 else rate * (1 - rate ** k) / (1 - rate)
