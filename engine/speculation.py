"""Speculative decoding: which steps draft, how many tokens each request drafts, and what the verifications
achieved.

A step that drafts gives each decoding request up to k guessed tokens (engine/drafters.py, or an EAGLE-3 draft
head's, engine/eagle3_drafter.py); the model scores the request's last token and its draft in one forward, and
the sampler keeps the longest prefix the model itself would have produced (engine/sampler.py's verify), plus
one token of its own. A drafting step needs the tokens of the step before it on the host, so it never runs
overlapped: it costs the host work that overlap hides, and its extra tokens cost compute that a large batch
does not have spare.

So speculation backs off by itself, per step:
- per request, k follows its recent acceptance (as long as its last draft token stays likely to be accepted),
  and its draft gain is the moving average of the draft tokens a drafting step accepted for it (or would have:
  see the drafts checked on the side below), a step where the drafter found nothing counting 0;
- a batch of more than half max_num_seqs requests never drafts (most of its requests would get no row for a
  draft token, all of them would lose the overlap) and costs the speculator nothing per step: no
  measurement, no loop over its requests, no drafter bookkeeping (a drafter learns a request's tokens only
  when it proposes for it);
- otherwise a step drafts when it is expected to make every request of the batch faster: per batch-size class
  (batches of about 2^b requests: from 2^(b - 1/2) up to 2^(b + 1/2), so that a batch of a power of two keeps
  its class while it drains) the engine measures the seconds of a decoding step with drafts (not overlapped,
  a row per draft token) and without, and a step drafts when one token plus the draft gain of the request
  that gains least beats one token per plain step by a margin. A drafting step slows every request of the
  batch, so tokens that some requests gain (an answer that copies, one that loops) do not pay for the others
  waiting longer: the slowest request sets when a batch is done, and a request that waits for a place in the
  batch waits for the slowest too. For the same reason the requests share the step's rows for draft tokens
  equally (a request left without a draft gains nothing), and a request is expected to gain no more than its
  share; a step in which a request still computes its prompt does not draft at all.
  Each kind is timed over its runs of consecutive steps, switches included (StepTimer), leaving out a step
  far slower than its kind's others (a first step that compiles kernels). Timing the two kinds of step
  apart, rather than tokens per second of each mode, keeps a phase where the drafter finds nothing (the start
  of an answer) from condemning drafting for the rest of it.
  A plain step keeps the draft gains current on the side: for a few of its requests (in turn) the drafter
  proposes a draft, and once the tokens it guessed are decoded the draft counts as if it had been verified
  (check_aside), so a request whose answer starts copying is seen to gain while no step drafts. The step
  seconds of a kind are measured only by running it, so while drafting does not pay the step drafts now and
  then anyway (a probe): soon again after a probe whose tokens paid for its step, half as often after one
  whose tokens did not. Where drafting could not pay even if every request accepted its whole share (the
  drafting step is that much slower), plain steps check nothing on the side and probes are the rarest.
"""
import math
import operator
import statistics
import time

from engine.constraints import valid_draft
from engine.drafters import DRAFTERS
from engine.sequence import Sequence

ACCEPTANCE_MEMORY = 0.7  # weight of the past in a request's moving acceptance and draft gain
MIN_TOKEN_CHANCE = 0.1   # how likely a draft token must be to be accepted to be drafted (draft_length)
MIN_EXPECTED_GAIN = 0.1  # draft tokens accepted per request and step below which a step does not draft
PERIOD_MEMORY = 0.7      # weight of the past in a batch class's measured step seconds
ASIDE_PER_STEP = 4       # requests whose drafts a plain step checks on the side (Speculator.check_aside)
PROBE_AFTER_STEPS, MAX_PROBE_AFTER_STEPS = 16, 1024
SWITCH_MARGIN = 1.15     # how much faster drafting must promise to be, against measurement noise
REFRESH_STEPS = 32       # a long run of one kind of step is recorded in parts of this many steps,
FIRST_STEPS = 4          # and of this many while its batch class has no time for that kind yet
OUTLIER_FACTOR = 4       # a step this many times slower than its kind's usual ones is not timed (StepTimer)
NO_SPECULATION = {"spec_drafted_tokens": 0, "spec_accepted_tokens": 0}  # the stats of an engine that never drafts
DRAFT_GAIN = operator.attrgetter("draft_gain")


class StepPeriods:
    """Measured seconds of decoding steps with and without drafts for one batch-size class, and when to probe
    drafting again while it does not pay."""

    def __init__(self):
        self.seconds: dict[bool, float] = {}
        self.plain_steps = 0  # steps that did not draft since the last that did
        self.probe_after = PROBE_AFTER_STEPS
        self.probes = 0  # drafting steps chosen as probes (bench/speculative.py reports them)

    def drafting_pays(self, num_running: int, gain: float) -> bool:
        """Whether the next step of num_running requests expecting `gain` accepted draft tokens in all drafts:
        each kind of step is measured first, then the faster in tokens per second runs, with probes."""
        if gain >= MIN_EXPECTED_GAIN * num_running:
            if True not in self.seconds:
                return True
            if False not in self.seconds:
                return False
            if self.faster_drafting(num_running, gain):
                return True
        self.plain_steps += 1
        if self.plain_steps < self.probe_after:
            return False
        self.plain_steps = 0
        self.probes += 1
        return True

    def record(self, drafting: bool, seconds: float) -> None:
        old = self.seconds.get(drafting)
        self.seconds[drafting] = seconds if old is None else PERIOD_MEMORY * old + (1 - PERIOD_MEMORY) * seconds

    def faster_drafting(self, num_running: int, gain: float) -> bool:
        """Whether a drafting step that gains `gain` tokens beyond one a request beats plain steps by the margin
        in tokens per second (both kinds measured)."""
        return (num_running + gain) * self.seconds[False] > SWITCH_MARGIN * num_running * self.seconds[True]

    def beats_plain(self, num_running: int, gain: float) -> bool:
        """Whether a drafting step that gains `gain` tokens beyond one a request beats plain steps as measured
        (true while either kind is unmeasured)."""
        return True not in self.seconds or False not in self.seconds or self.faster_drafting(num_running, gain)

    def drafted(self, num_running: int, gained: int) -> None:
        """After a drafting step that gained `gained` tokens beyond one a request: probe soon again if they paid
        for the step (as far as measured), half as often otherwise, so that probes a batch never profits from
        grow rare."""
        paid = gained >= MIN_EXPECTED_GAIN * num_running and self.beats_plain(num_running, gained)
        self.probe_after = PROBE_AFTER_STEPS if paid else min(2 * self.probe_after, MAX_PROBE_AFTER_STEPS)


class StepTimer:
    """Seconds per step of each run of consecutive decoding steps of one kind (drafting or plain), recorded in
    the batch class's StepPeriods when the run ends, or every REFRESH_STEPS steps (FIRST_STEPS at first). A run
    is timed from the end of the step before it to the end of its last step: with overlap, the first plain step
    after a drafting one launches two forwards and the last one before a drafting step launches none, so one
    step's own period says little of its kind, while a run's total holds what each kind costs, its switches
    included.

    A step that takes more than OUTLIER_FACTOR times what its kind takes (the least of the class's recorded
    period and its run's lower median) is left out of its run: the first step of a kind may compile kernels or
    finish the warm-up's CUDA graphs, which says nothing of what the next steps cost, and the slow moving
    average would keep a class from drafting for long."""

    def __init__(self):
        self.kind: bool | None = None  # the kind of the run being timed (True: drafting); None: none is
        self.last_end: float | None = None  # when the last step ended
        self.step_seconds: list[float] = []  # the periods of the run's steps
        self.periods: StepPeriods | None = None  # where the run is recorded: its last step's batch class

    def step(self, periods: StepPeriods, drafting: bool, decoding: bool) -> None:
        now = time.perf_counter()
        if not decoding or drafting is not self.kind or len(self.step_seconds) >= self.run_length(periods):
            self.close()
            if decoding and self.last_end is not None:
                self.kind = drafting
        if self.kind is not None:
            self.step_seconds.append(now - self.last_end)
            self.periods = periods
        self.last_end = now

    def run_length(self, periods: StepPeriods) -> int:
        """Steps after which a run is recorded: soon while its kind is unmeasured, as the choice waits for it."""
        return REFRESH_STEPS if self.kind in periods.seconds else FIRST_STEPS

    def interrupt(self) -> None:
        """A step that is not timed (a batch too large to draft): the run ends, the next starts after it."""
        self.close()
        self.last_end = time.perf_counter()

    def close(self) -> None:
        if self.kind is not None and self.step_seconds:
            kept = typical(self.step_seconds, self.periods.seconds.get(self.kind))
            if kept:
                self.periods.record(self.kind, sum(kept) / len(kept))
        self.kind = None
        self.step_seconds = []


def typical(step_seconds: list[float], recorded: float | None) -> list[float]:
    """The step periods of a run without its outliers: those over OUTLIER_FACTOR times the least of the recorded
    period and the run's lower median (the median alone where nothing is recorded: a run's first step may be
    its outlier). None may be left (a probe's one step, an outlier): a kind's cost drifts (contexts grow), it
    does not jump, and the moving average follows a drift."""
    usual = statistics.median_low(step_seconds)
    limit = OUTLIER_FACTOR * (usual if recorded is None else min(usual, recorded))
    return [seconds for seconds in step_seconds if seconds <= limit]


class Speculator:
    def __init__(self, method: str, max_draft_tokens: int, max_rows: int, drafter=None):
        """max_rows: the most rows a decode step has (max_num_seqs): a step's drafts are cut to fit its requests'
        rows and theirs into one, so that it verifies them as a decode step (engine/step_inputs.py). drafter:
        one the runner made (a draft model's, engine/eagle3_drafter.py), else the method's own."""
        self.drafter = drafter or DRAFTERS[method]()
        self.max_draft_tokens, self.max_rows = max_draft_tokens, max_rows
        self.adaptive = True  # False: every step drafts (tests)
        self.periods: dict[int, StepPeriods] = {}
        self.num_drafted = self.num_accepted = 0
        self.timer = StepTimer()
        self.aside_turn = 0  # where in the batch the next plain step's drafts on the side start

    def decide(self, running: list[Sequence], in_flight=None) -> bool:
        """Whether the next step drafts (see the module's docstring); counts as one step of its batch size.
        in_flight: the step launched before it, not finished (its seqs and num_tokens), if any."""
        if not self.adaptive:
            return True
        num_running = len(running)
        if not running or not self.may_draft(num_running):
            return False  # nothing to draft for (the last requests finished): a drafting step would only stall
        if prompts_next(running, in_flight):
            return False
        periods = self._periods(num_running)
        if not self.could_pay(num_running):
            periods.probe_after = MAX_PROBE_AFTER_STEPS  # no gain pays as measured: only the rarest probes
        return periods.drafting_pays(num_running, least_gain(running, self.draft_share(num_running)))

    def may_draft(self, num_running: int) -> bool:
        """Whether a batch this large leaves every request a row for a draft token, on average."""
        return 2 * num_running <= self.max_rows

    def draft_share(self, num_running: int) -> int:
        """The draft tokens that every request of a batch this large gets at least, when all draft: an equal
        share of the rows the step has beyond one a request (propose), k at most."""
        return min(self.max_draft_tokens, (self.max_rows - num_running) // num_running)

    def could_pay(self, num_running: int) -> bool:
        """Whether drafting could pay at this batch size, as measured, if every request accepted all of its
        share of draft tokens: where not, drafts checked on the side are work for nothing."""
        return self._periods(num_running).beats_plain(num_running, num_running * self.draft_share(num_running))

    def propose(self, running: list[Sequence]) -> None:
        """Gives each decoding request that may draft its draft tokens for the next step, each at most an equal
        share of the rows left (fair_share): a request left without a draft would gain nothing, and the request
        that gains least sets when the batch is done (least_gain). A batched drafter (a draft model's) proposes
        for all of them in one call, each request's k counted against the rows."""
        if getattr(self.drafter, "batched", False):
            self._propose_batch(running)
            return
        rows_left = self.max_rows - len(running)
        for i, seq in enumerate(running):
            seq.aside_draft = None  # verified drafts count from here on
            if not draftable(seq.params):
                seq.draft_gain = 0.0
            elif can_draft(seq):
                k = self._draft_size(seq, fair_share(rows_left, len(running) - i))
                set_draft(seq, self.drafter.propose(seq, k) if k > 0 else [])
                rows_left -= len(seq.draft_token_ids)

    def _propose_batch(self, running: list[Sequence]) -> None:
        rows_left, drafting, lengths = self.max_rows - len(running), [], []
        for i, seq in enumerate(running):
            seq.aside_draft = None
            if can_draft(seq):
                k = self._draft_size(seq, fair_share(rows_left, len(running) - i))
                seq.draft_token_ids = []
                if k > 0:
                    drafting.append(seq)
                    lengths.append(k)
                    rows_left -= k
        if drafting:
            for seq, draft in zip(drafting, self.drafter.propose_batch(drafting, lengths)):
                set_draft(seq, draft)

    def _draft_size(self, seq: Sequence, rows: int) -> int:
        """How many tokens a request drafts: by its acceptance, within its length limit and the rows it may
        take."""
        return min(draft_length(seq, self.max_draft_tokens), seq.max_len - len(seq.token_ids), rows)

    def verified(self, seqs: list[Sequence], sampled: list) -> None:
        """Counts a verification step's drafted and accepted tokens, per request and in total, before the
        scheduler applies it (sampled: each request's accepted drafts and its own next token)."""
        for seq, tokens in zip(seqs, sampled):
            if not isinstance(tokens, list) or not seq.draft_token_ids:
                continue
            drafted, accepted = len(seq.draft_token_ids), len(tokens) - 1
            self.num_drafted += drafted
            self.num_accepted += accepted
            count_verification(seq, drafted, accepted)

    def check_aside(self, seqs: list[Sequence]) -> None:
        """On a plain step: for ASIDE_PER_STEP of its requests in turn, counts a draft proposed on the side as
        verified once the tokens it guessed are decoded (or one of them is not the guess), and proposes the
        next. A drafter that proposes on the device (a draft model's) and a constrained request (whose drafts
        its constraint cuts) keep the gains their verified drafts measured."""
        if getattr(self.drafter, "batched", False) or not seqs:
            return
        start = self.aside_turn % len(seqs)
        for i in range(start, start + min(ASIDE_PER_STEP, len(seqs))):
            seq = seqs[i % len(seqs)]
            if draftable(seq.params) and seq.constraint is None and seq.num_computed_tokens >= seq.num_prompt_tokens:
                self._check_aside(seq)
        self.aside_turn = start + ASIDE_PER_STEP

    def _check_aside(self, seq: Sequence) -> None:
        if seq.aside_draft is not None:
            position, draft = seq.aside_draft
            decoded = seq.token_ids[position:position + len(draft)]
            accepted = next((i for i, (a, b) in enumerate(zip(draft, decoded)) if a != b), len(decoded))
            if accepted == len(decoded) < len(draft):
                return  # the guess holds so far: its outcome is not known yet
            count_verification(seq, len(draft), accepted)
        k = self._draft_size(seq, rows=self.max_draft_tokens)  # a draft on the side takes no rows
        draft = self.drafter.propose(seq, k) if k > 0 else []
        seq.aside_draft = (len(seq.token_ids), draft) if draft else None
        if not draft:
            count_miss(seq)

    def step_done(self, num_running: int, drafting: bool, decoding: bool, gained: int) -> None:
        """Times a finished step (StepTimer); a drafting step tells when to probe next by whether its tokens
        paid for it (gained: its tokens beyond one a request)."""
        periods = self._periods(num_running)
        if drafting:
            periods.drafted(num_running, gained)
        self.timer.step(periods, drafting, decoding)

    def step_skipped(self) -> None:
        """A step of a batch too large to draft."""
        self.timer.interrupt()

    def _periods(self, num_running: int) -> StepPeriods:
        """The step periods of a batch of this size (made on first use)."""
        bucket = batch_class(num_running)
        periods = self.periods.get(bucket)
        if periods is None:
            periods = self.periods[bucket] = StepPeriods()
        return periods

    def stats(self) -> dict:
        return {"spec_drafted_tokens": self.num_drafted, "spec_accepted_tokens": self.num_accepted}


def batch_class(num_running: int) -> int:
    """The class b of a batch of about 2^b requests, the nearest power of two: floor(log2(n) + 1/2), that is
    floor(log2(2 n^2) / 2)."""
    return ((2 * num_running * num_running).bit_length() - 1) // 2


def prompts_next(running: list[Sequence], in_flight) -> bool:
    """Whether a running request computes more than one token in the next step (a prompt, or a recomputation,
    that the step in flight does not finish). Such a step does not draft: that request gains nothing from
    drafts (least_gain), and a drafting step costs every request the overlap. in_flight: the step in flight
    (its seqs and num_tokens), or None."""
    if in_flight is None:
        return any(seq.num_computed_tokens < len(seq.token_ids) - 1 for seq in running)
    if len(in_flight.seqs) == len(running) and in_flight.num_tokens.count(1) == len(running):
        return False  # every running request decodes in the step in flight
    computing = dict(zip(map(id, in_flight.seqs), in_flight.num_tokens))
    return any(seq.num_computed_tokens + computing.get(id(seq), 0) < len(seq.token_ids) - 1 for seq in running)


def least_gain(running: list[Sequence], share: int) -> float:
    """The draft tokens a step is expected to gain in all, counted as if every request gained as little as the
    one that gains least: a drafting step slows every request of the batch, so tokens that some requests (an
    answer copying or looping) gain fast do not pay for the others waiting longer; the slowest request sets
    when the batch is done. A request gains at most its share of the step's draft rows (its draft gain was
    measured with drafts up to k long)."""
    return len(running) * min(min(map(DRAFT_GAIN, running)), share)


def fair_share(rows_left: int, requests_left: int) -> int:
    """The draft rows a request may take: an equal share of those left among the requests left (rounded up,
    so that a step short of rows drafts for the oldest)."""
    return -(-rows_left // requests_left)


def count_verification(seq: Sequence, drafted: int, accepted: int) -> None:
    """Moves a request's acceptance and draft gain towards a verification's outcome."""
    seq.acceptance = ACCEPTANCE_MEMORY * seq.acceptance + (1 - ACCEPTANCE_MEMORY) * accepted / drafted
    seq.draft_gain = ACCEPTANCE_MEMORY * seq.draft_gain + (1 - ACCEPTANCE_MEMORY) * accepted


def set_draft(seq: Sequence, draft: list[int]) -> None:
    """A request's draft for the next step: the drafter's, cut where its constraint would reject a token."""
    seq.draft_token_ids = valid_draft(seq.constraint, draft) if seq.constraint and draft else draft
    if not seq.draft_token_ids:
        count_miss(seq)


def count_miss(seq: Sequence) -> None:
    """A request for which the drafter found nothing gained nothing."""
    seq.draft_gain *= ACCEPTANCE_MEMORY


def can_draft(seq: Sequence) -> bool:
    """A decoding request whose tokens the sampler can verify."""
    return len(seq.token_ids) - seq.num_computed_tokens == 1 and draftable(seq.params)


def draftable(params) -> bool:
    """Sampling whose tokens a verification reproduces: not penalised (its penalties would change along the
    draft), not seeded unless greedy (its tokens follow its seed and positions). A constrained request drafts
    only tokens its constraint accepts (engine/constraints.py's valid_draft)."""
    return not params.penalised and (params.seed is None or params.greedy)


def draft_length(seq: Sequence, most: int) -> int:
    """The draft tokens worth their rows at the request's recent acceptance a: the k-th is accepted only with
    the k - 1 before it, a^k under a steady rate, and is drafted while that is at least MIN_TOKEN_CHANCE (one
    at least, `most` at most). A row costs a step little (the rows share its weight reads; a batch that is
    short of rows drafts less, Speculator.propose), so a request that copies drafts long."""
    rate = seq.acceptance
    if rate >= 1:
        return most
    if rate <= 0:
        return 1
    return max(1, min(most, int(math.log(MIN_TOKEN_CHANCE) / math.log(rate))))

