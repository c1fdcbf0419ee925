"""Which requests compute which tokens in the next step.

Running requests first (oldest first), then waiting ones, under one token budget and a cap on running
requests. Blocks are allocated for exactly the tokens a step computes; when they run out, the newest
running request is preempted (blocks freed, back to the front of the waiting queue, recomputed later). A
prompt chunk never ends inside an image (engine/images.py): a request whose image does not fit the budget left
waits for the next step.
"""
from collections import deque

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.images import fit_chunk
from engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[Sequence], list[int]]:
        """Returns the step's requests and how many new tokens each computes."""
        budget = self.max_num_batched_tokens
        seqs, num_tokens = [], []
        preempted = False
        i = 0
        while i < len(self.running) and budget:
            seq = self.running[i]
            n = fit_chunk(seq.images, seq.num_computed_tokens,
                          min(len(seq.token_ids) + len(seq.draft_token_ids) - seq.num_computed_tokens, budget))
            if not n:  # the rest of an image does not fit this step
                i += 1
                continue
            del seq.draft_token_ids[max(n - 1, 0):]  # the budget cuts the draft short
            while not self.block_manager.allocate(seq, n):
                if seq.draft_token_ids:  # drafts never preempt a request: verify none this step
                    seq.draft_token_ids.clear()
                    n = 1
                    continue
                preempted = True
                self._preempt(self.running.pop())  # the newest; never one already scheduled (all before i)
                if len(self.running) == i:  # seq itself was the newest
                    break
            else:
                seqs.append(seq)
                num_tokens.append(n)
                budget -= n
                i += 1
        for seq in self.running[i:]:  # left out of this step: their drafts would be stale by the next
            seq.draft_token_ids.clear()
        if not preempted:
            self._admit(seqs, num_tokens, budget)
        return seqs, num_tokens

    def _admit(self, seqs: list[Sequence], num_tokens: list[int], budget: int) -> None:
        """Admits waiting requests, oldest first, while the budget, the seats and the free blocks last, and
        the request first in line does not wait for the prompt it shares to be computed."""
        while self.waiting and budget and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.prompt_pending:
                break
            cached_prefix = self.block_manager.find_cached_prefix(seq)
            num_cached = len(cached_prefix) * self.block_manager.block_size
            n = fit_chunk(seq.images, num_cached, min(len(seq) - num_cached, budget))
            if not n or not self.block_manager.allocate(seq, n, cached_prefix):
                break
            self.waiting.popleft()
            seq.num_computed_tokens = num_cached
            if seq.num_output_tokens == 0:  # a prompt's own hits; a re-admitted request only recomputes itself
                self.block_manager.record_lookup(seq, num_cached)
                seq.num_cached_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            num_tokens.append(n)
            budget -= n

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.draft_token_ids.clear()
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule_ahead(self, in_flight: list[Sequence], tokens_in_flight: list[int],
                       sample_rows: list[int]) -> tuple[list[Sequence], list[int], list[int], list[int]] | None:
        """The step after the one in flight (requests `in_flight` computing `tokens_in_flight`, the rows in
        `sample_rows` sampling), scheduled and allocated before that step's tokens are known, as schedule()
        would make it once they are: each request that samples in flight computes that token, the others go
        on with their prompts, and waiting requests are admitted. Requests that finish in flight compute one
        token that is thrown away; a seat they free goes to a waiting request one step later.

        Returns (seqs, num_tokens, ahead, follows): ahead, the tokens each request has in flight; follows, for
        the leading len(follows) requests, the sampled row of the step in flight that is their input token.
        None, with nothing admitted, where the plain schedule must wait for the step: the requests that
        sample in flight do not lead the running list, or a request would be preempted; and where a step ahead
        would compute nothing but tokens thrown away: every running request reaches its length limit with the
        token it samples in flight, and none waits (a lone request's last token, its first with max_tokens 1)."""
        if self._all_end_in_flight(in_flight, sample_rows):
            return None
        follows = [i for i, row in enumerate(sample_rows) if not in_flight[row].is_finished]  # aborted, stopped
        seqs = [in_flight[sample_rows[i]] for i in follows]
        if self.running[:len(seqs)] != seqs or len(seqs) > self.max_num_batched_tokens:
            return None
        num_tokens, ahead = [1] * len(seqs), [tokens_in_flight[sample_rows[i]] for i in follows]
        for seq, n_flying in zip(seqs, ahead):
            if not self.block_manager.allocate(seq, n_flying + 1):
                return None
        budget = self.max_num_batched_tokens - len(seqs)
        flying = dict(zip(map(id, in_flight), tokens_in_flight)) if len(self.running) > len(seqs) else {}
        for seq in self.running[len(seqs):]:  # prompt chunks in flight, and requests the budget left out
            if not budget:
                break
            n_flying = flying.get(id(seq), 0)
            start = seq.num_computed_tokens + n_flying
            n = fit_chunk(seq.images, start, min(len(seq) - start, budget))
            if not n:
                continue
            if not self.block_manager.allocate(seq, n_flying + n):
                return None
            seqs.append(seq)
            num_tokens.append(n)
            ahead.append(n_flying)
            budget -= n
        num_running = len(seqs)
        self._admit(seqs, num_tokens, budget)
        ahead += [0] * (len(seqs) - num_running)
        return seqs, num_tokens, ahead, follows

    def _all_end_in_flight(self, in_flight: list[Sequence], sample_rows: list[int]) -> bool:
        """Whether no request waits and every running one samples in the step in flight a token that reaches its
        length limit (Sequence.append_token finishes it, whatever the token). Rows of requests that finished
        before that step (it was launched ahead of their last token) take nothing from it."""
        if self.waiting:
            return False
        ending = 0
        for row in sample_rows:
            seq = in_flight[row]
            if not seq.is_finished:
                if len(seq) + 1 < seq.max_len:
                    return False  # usually the first row: a step is not walked whole
                ending += 1
        return ending == len(self.running)

    def update(self, seqs: list[Sequence], num_tokens: list[int], sampled: list[int | None],
               logprobs: list | None = None) -> list[tuple[Sequence, int | None]]:
        """Applies a finished step: advances each request, appends sampled tokens (with their logprobs, per
        request, when given), retires finished ones. Requests that finished while it ran (aborted, or stopped by
        the step before) take nothing from it. Returns the others with their tokens."""
        results = []
        finished = False
        logprobs = logprobs or [None] * len(seqs)
        for seq, n, token_id, token_logprobs in zip(seqs, num_tokens, sampled, logprobs):
            if seq.is_finished:
                continue
            if isinstance(token_id, list):  # a verification step's tokens: accepted drafts, then the model's own
                finished |= self._append_verified(seq, token_id, token_logprobs)
                results.append((seq, seq.token_ids[-1]))
                continue
            seq.num_computed_tokens += n
            self.block_manager.commit(seq)
            self.block_manager.free_out_of_window(seq)
            if token_id is not None and seq.append_token(token_id, token_logprobs):
                finished = True
            results.append((seq, token_id))
        if finished:
            self._retire()
        return results

    def _append_verified(self, seq: Sequence, tokens: list[int], logprobs: list | None) -> bool:
        """Applies a verification step: appends its tokens until one finishes the request, counts as computed
        the tokens whose KV the step wrote and that stayed (the input token and the accepted drafts; a
        request that finishes keeps fewer), and frees the blocks taken for the rejected drafts. Returns
        whether the request finished."""
        seq.draft_token_ids.clear()
        finished = False
        for i, token_id in enumerate(tokens):
            if seq.append_token(token_id, logprobs[i] if logprobs else None):
                finished = True
                break
        seq.num_computed_tokens = len(seq.token_ids) - 1
        self.block_manager.release_uncomputed(seq)
        self.block_manager.commit(seq)
        self.block_manager.free_out_of_window(seq)
        return finished

    def fail(self, seqs: list[Sequence], error: str) -> None:
        """Finishes requests whose step raised; their partially written blocks are never committed."""
        for seq in seqs:
            seq.finish("error", error)
        self._retire()

    def abort(self, seq: Sequence) -> None:
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self.block_manager.free(seq)  # a preempted request holds nothing; this only resets it
        seq.finish("abort")
        self._retire()

    def _retire(self) -> None:
        """Frees the blocks of finished running requests and drops them from the running list."""
        still_running = []
        for seq in self.running:
            if seq.is_finished:
                self.block_manager.free(seq)
            else:
                still_running.append(seq)
        self.running = still_running
