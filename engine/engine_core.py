"""The engine both front ends drive, the Worker on its thread and LLM on the caller's thread: requests in
(add, abort), steps (step), embeddings (embed) and counters (stats)."""
import logging

from torch import Tensor

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.embedding import Embedder
from engine.errors import PromptRejected
from engine.images import PromptImage, check_step_budget, place_images
from engine.model_runner import LaunchedStep, ModelRunner
from engine.mrope import prompt_rope_positions
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.speculation import NO_SPECULATION, Speculator
from engine.tensor_parallel import TensorParallelRanks
from models.model_files import eos_token_ids

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, loaded, ranks: TensorParallelRanks | None = None):
        """ranks: the other tensor-parallel ranks, whose runners start in step with this one's and then
        follow its calls; stopped if this runner cannot start."""
        self.model = config.model
        try:
            self.runner = ModelRunner(config, loaded, ranks)
        except BaseException:
            if ranks:
                ranks.shutdown()
            raise
        self.embedder = Embedder.for_decoder(config, loaded, self.runner.forward_packed, self.runner.max_model_len)
        self.max_model_len = self.runner.max_model_len
        self.eos_token_ids = eos_token_ids(loaded.hf_config, loaded.model_dir)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, self.runner.model.kv_window)
        self.scheduler = Scheduler(config, self.block_manager)
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.overlap = config.overlap_steps
        self.in_flight: LaunchedStep | None = None  # launched, not yet finished
        self.speculator = (Speculator(config.speculative_method, config.num_speculative_tokens, config.max_num_seqs,
                                      self.runner.drafter) if config.num_speculative_tokens else None)
        self.draft_next = False  # the step after the one in flight drafts (so it was not launched ahead)

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        """PromptRejected saying what is wrong with a prompt the engine cannot serve (ValueError: a model that
        serves no generation)."""
        if not self.runner.can_generate:
            raise ValueError(f"model {self.model} is an embedding model (no LM head): it serves embeddings only")
        check_prompt(prompt_token_ids, self.max_model_len, self.runner.vocab_size)

    def make_sequence(self, request_id, prompt_token_ids: list[int], params, constraint=None,
                      shares_prompt_with: Sequence | None = None, images: list[PromptImage] = ()) -> Sequence:
        """constraint: what tokens the request may take (engine/constraints.py); shares_prompt_with: a request
        with the same prompt (n choices of one completion), whose prompt blocks this one takes from the prefix
        cache once they are computed. images: the prompt's images, in the order of their runs of image tokens
        (engine/images.py); an image belongs to one prompt (the choices of one request share it, and its soft
        tokens, computed once)."""
        self.check_prompt(prompt_token_ids)
        images = list(images)
        self.check_images(prompt_token_ids, images)
        seq = Sequence(request_id, prompt_token_ids, params, self.max_model_len, self.eos_token_ids, constraint,
                       shares_prompt_with, images)
        if images and self.runner.model.uses_mrope:
            seq.rope_positions, seq.rope_delta = prompt_rope_positions(len(prompt_token_ids), images,
                                                                       self.runner.vision.spatial_merge_size)
        return seq

    def check_images(self, prompt_token_ids: list[int], images: list[PromptImage]) -> None:
        """Places the images on their runs of image tokens; PromptRejected when they and the prompt do not match or
        an image takes more tokens than a step; ValueError when the model reads no images or an image's pixels (and
        grid) do not fit the encoder (what the handler's processor made: ours to fix)."""
        vision = self.runner.vision
        if vision is None:
            if images:
                raise ValueError(f"model {self.model} does not read images (served as a text model)")
            return
        lengths = []
        for i, image in enumerate(images):
            try:
                lengths.append(vision.soft_token_count(image.pixel_values, image.grid))
            except ValueError as exc:
                raise ValueError(f"image {i}: {exc}") from None
        place_images(prompt_token_ids, images, vision.image_token_id, lengths)
        check_step_budget(lengths, self.max_num_batched_tokens)

    def add(self, seq: Sequence) -> None:
        """Queues a request made by make_sequence; step() computes it."""
        self.scheduler.add(seq)

    def abort(self, seq: Sequence) -> None:
        """Ends a request with finish_reason "abort" and frees its blocks; a request that is finished, or was
        never added, is left as it is."""
        if seq in self.scheduler.running or seq in self.scheduler.waiting:
            self.scheduler.abort(seq)

    def has_work(self) -> bool:
        """Whether a request is waiting or running."""
        return self.scheduler.has_work()

    def embed(self, token_lists: list[list[int]]) -> Tensor:
        """Pooled float32 vectors [n, H] on the CPU, computed between steps (engine/embedding.py)."""
        return self.embedder.embed(token_lists)

    def step(self) -> list[tuple[Sequence, int | None]]:
        """Computes one step. Returns each of its requests with its new token (None when it sampled nothing),
        but not those that finished while it ran; a step that raises finishes its requests with
        finish_reason "error".

        With overlap on, the next step is scheduled (Scheduler.schedule_ahead) and launched before this one's
        sampled ids are read; it takes them on the device. The host applies step N while the device computes
        step N+1, which the next call returns. Rows of requests that step N finished compute one token that
        is thrown away.

        A step N+1 with constrained rows runs its forward ahead like any other, but is sampled only here,
        after step N's tokens are on the host and the constraints have accepted them: the masks are filled
        while the device runs N+1's forward, which waits for them only if that takes longer than the forward.

        With speculation on (engine/speculation.py), a step whose requests draft is neither launched ahead nor
        followed by a step launched ahead: its drafts need the tokens before them, and how many tokens each
        request takes is known only once it is verified. The speculator decides per step which way pays."""
        launched, self.in_flight = self.in_flight, None
        drafting = launched is None and self._draft()
        seqs, num_tokens = (launched.seqs, launched.num_tokens) if launched else self.scheduler.schedule()
        if not seqs:
            return []
        if launched is None and self.runner.warming_up and decoding_only(seqs, num_tokens):
            self.finish_warm_up()  # decode (or verification) rows only: from here on the graphs pay
        try:
            launched = launched or self.runner.launch(seqs, num_tokens)
            if self.overlap and launched.plannable and not self.runner.warming_up:  # warm-up needs none in flight
                self.in_flight = self._launch_next(launched)
            sampled, logprobs = self.runner.finish(launched)
        except Exception as exc:  # one bad step must not take the engine down
            log.exception("engine step failed; its requests end with finish_reason 'error'")
            self.in_flight = None
            return self._fail(seqs, exc)
        if self.speculator:
            self._measure(launched, sampled, drafting)
        results = self.scheduler.update(seqs, num_tokens, sampled, logprobs)
        if self.in_flight is not None and self.in_flight.deferred:
            try:
                self.runner.sample(self.in_flight)
            except Exception as exc:  # a constraint that fails ends its step's requests
                log.exception("sampling a step failed; its requests end with finish_reason 'error'")
                failed, self.in_flight = self.in_flight.seqs, None
                results += self._fail(failed, exc)
        return results

    @property
    def warming_up(self) -> bool:
        """Whether the runner's warm-up (the LM head's shapes, the CUDA graphs) has parts still to run."""
        return self.runner.warming_up

    def warm_up_next(self) -> None:
        """One part of the runner's warm-up (ModelRunner.warm_up_next), between steps; the engine thread calls it
        while idle, so a request that arrives waits for one part at most."""
        if self.in_flight is None and self.runner.warming_up:
            self.runner.collective("warm_up_next")

    def finish_warm_up(self) -> None:
        """The rest of the runner's warm-up, at once (nothing may be in flight)."""
        while self.runner.warming_up:
            self.runner.collective("warm_up_next")

    def _draft(self) -> bool:
        """Gives the running requests draft tokens when the next step is to draft (it is scheduled next). A step
        that chose drafting for the next may have finished all of its requests: then none is left to draft for."""
        running = self.scheduler.running
        drafting = bool(running) and (self.draft_next or bool(self.speculator and self.speculator.decide(running)))
        self.draft_next = False
        if drafting:
            self.speculator.propose(running)
        return drafting

    def _measure(self, launched: LaunchedStep, sampled: list, drafting: bool) -> None:
        """Counts a step's verified drafts and times it for the speculator's choice of mode; a step of a batch
        too large to draft is not measured (it costs nothing per request), nor one launched ahead for requests
        that all finished meanwhile: the next step() call returns it, which may come after the engine idled."""
        if launched.drafts is not None:
            self.speculator.verified(launched.seqs, sampled)
        if not self.speculator.may_draft(len(launched.seqs)) or all(seq.is_finished for seq in launched.seqs):
            self.speculator.step_skipped()
            return
        num_running = len(launched.seqs)
        if drafting:
            decoding = decoding_only(launched.seqs, launched.num_tokens)
            gained = sum(len(tokens) if isinstance(tokens, list) else tokens is not None
                         for tokens in sampled) - num_running
        else:  # no request verifies a draft: a decoding step computes one token per request, gains none
            decoding, gained = launched.num_tokens.count(1) == num_running, 0
            if self.speculator.could_pay(num_running):
                self.speculator.check_aside(launched.seqs)
        self.speculator.step_done(num_running, drafting, decoding, gained)

    def _fail(self, seqs: list[Sequence], exc: Exception) -> list[tuple[Sequence, None]]:
        failed = [seq for seq in seqs if not seq.is_finished]
        self.scheduler.fail(failed, f"{type(exc).__name__}: {exc}")
        return [(seq, None) for seq in failed]

    def _launch_next(self, launched: LaunchedStep) -> LaunchedStep | None:
        """The step after `launched`, launched before its sampled ids are read, or None when the scheduler
        must wait for them."""
        if self.speculator and self.speculator.decide(self.scheduler.running, launched):
            self.draft_next = True  # drafts need this step's tokens
            return None
        planned = self.scheduler.schedule_ahead(launched.seqs, launched.num_tokens, launched.sample_rows)
        if planned is None or not planned[0]:
            return None
        seqs, num_tokens, ahead, follows = planned
        return self.runner.launch(seqs, num_tokens, ahead, follows)

    def stats(self) -> dict:
        bm = self.block_manager
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "num_free_blocks": bm.num_free_blocks, "num_total_blocks": len(bm.blocks),
                "prefix_cache_hit_rate": bm.hit_rate, "num_preemptions": self.scheduler.num_preemptions,
                **(self.speculator.stats() if self.speculator else NO_SPECULATION)}


def check_prompt(prompt_token_ids: list[int], max_model_len: int, vocab_size: int) -> None:
    """PromptRejected saying what is wrong with a prompt no engine of this model can serve."""
    if not prompt_token_ids:
        raise PromptRejected("the prompt is empty: it needs at least one token")
    if len(prompt_token_ids) + 1 > max_model_len:
        raise PromptRejected(f"the prompt has {len(prompt_token_ids)} tokens; with at least one token to "
                             f"generate it must be shorter than max_model_len={max_model_len}")
    low, high = min(prompt_token_ids), max(prompt_token_ids)
    if low < 0 or high >= vocab_size:
        raise PromptRejected(f"token id {low if low < 0 else high} is outside the vocabulary [0, {vocab_size})")


def decoding_only(seqs: list[Sequence], num_tokens: list[int]) -> bool:
    """Whether every row of a step decodes: one token, plus the draft tokens it verifies (no prompt chunk)."""
    return all(n == 1 + len(seq.draft_token_ids) for seq, n in zip(seqs, num_tokens))
