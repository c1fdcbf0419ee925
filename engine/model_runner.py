"""Owns a decoder model and its KV cache; turns a scheduled step into one forward pass and sampled ids.

A step is launched (staged, uploaded, run and sampled, its sampled ids copied towards pinned host memory)
and finished (its ids read once they have arrived) in two calls, so the engine can launch the next step
before reading this one's ids. Such a step's leading requests continue the one in flight: it stages, in
place of their input ids, the rows of that step's sampled ids they take; the device swaps the ids in before
the forward (see execute).

A step launched that way whose sampling rows include constrained requests (engine/constraints.py) runs its
forward at once but samples later (sample()): their masks depend on the tokens of the step in flight, which
their constraints must accept first. The engine samples it as soon as it has applied that step.

The parts it is built of: engine/kv_cache.py sizes and allocates the cache, engine/step_inputs.py stages a
step's inputs, engine/cuda_graphs.py captures and replays the forward, engine/sampler.py draws the tokens.

Start-up ends once the KV cache is sized: the warm-up that only makes steps faster (the LM head run at every row
count, the CUDA graphs) is left to warm_up_next(), which the engine calls while it is idle and before the first
decode step (engine/engine_core.py); until then steps run eagerly.
"""
import itertools
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from engine.config import EngineConfig
from engine.constraints import TokenMasks
from engine.cuda_graphs import CudaGraphs
from engine.eagle3_drafter import Eagle3Drafter, check_eagle3
from engine.embedding import forward_decoder
from engine.images import StepImages, step_images
from engine.kv_cache import allocate_kv_cache
from engine.mrope import step_rope_positions
from engine.prompt_logprobs import PromptLogitRows, compute_prompt_logprobs, prompt_logit_rows, record_prompt_logprobs
from engine.sampler import Sampler, logprob_entry
from engine.sampling_params import MAX_LOGPROBS
from engine.sequence import Sequence
from engine.startup_log import note, took
from engine.step_inputs import StagedStep, StepBuffers
from models.eagle3 import Eagle3Head, load_head
from models.parallel_layers import tp_rank, tp_size

log = logging.getLogger(__name__)
LM_HEAD_WARM_UP_ROWS = 32  # row counts per part of the warm-up: a request arriving waits for one part at most


def requested_context(config: EngineConfig, hf_config) -> tuple[int, str]:
    """The longest sequence (prompt and output) before the KV pool is sized, and which bound set it:
    HFENDPOINT_MAX_MODEL_LEN when set and within the model's maximum (max_position_embeddings), else that."""
    model_max = hf_config.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len <= model_max:
        return config.max_model_len, "HFENDPOINT_MAX_MODEL_LEN"
    return model_max, "the model's maximum (max_position_embeddings)"


@dataclass
class LaunchedStep:
    """A step on its way through the device; ModelRunner.finish() returns its sampled ids."""
    seqs: list[Sequence]
    num_tokens: list[int]
    sample_rows: list[int]
    ids: Tensor | None  # the sampled ids: in pinned host memory once `ready` has passed (on the CPU, at once)
    ready: "torch.cuda.Event | None"
    plannable: bool  # no penalties: the next step needs no token of this one on the host
    sampling: list[Sequence] | None = None  # the sequences of sample_rows
    drawn_ahead: list[int] | None = None  # tokens each of them has drawn beyond its token_ids
    logits: Tensor | None = None  # of the sampling rows, until sample() has used them
    logprobs: Tensor | None = None  # sampler.top_logprobs of the rows that ask (logprob_rows), beside ids
    logprob_rows: list[int] | None = None
    prompt_rows: PromptLogitRows | None = None  # the rows whose logits give prompt logprobs (engine/prompt_logprobs.py)
    prompt_logprobs: Tensor | None = None  # theirs, beside ids
    drafts: list[list[int]] | None = None  # a verification step: the draft tokens each sampling row verifies

    @property
    def deferred(self) -> bool:
        """Launched, not yet sampled: ModelRunner.sample() must run before finish()."""
        return self.logits is not None


def verification_rows(seqs: list[Sequence], drafts: list[list[int]]) -> list[Sequence]:
    """The request of each logits row of a verification step: one per draft token, and one more."""
    return [seq for seq, draft in zip(seqs, drafts) for _ in range(len(draft) + 1)]


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded, ranks=None):
        """ranks: on rank 0 of a tensor-parallel engine, the other ranks (engine/tensor_parallel.py's
        TensorParallelRanks), which run every call that goes through collective(); None otherwise."""
        self.config, self.ranks = config, ranks
        self.model = loaded.model
        self.vision = loaded.vision  # a multimodal model's image encoder (engine/images.py), or None
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        self.block_size = config.block_size
        self.vocab_size = loaded.hf_config.vocab_size
        self.hidden_size = loaded.hf_config.hidden_size
        self.is_driver = tp_rank() == 0  # stages steps and samples; the other tensor-parallel ranks follow
        self.sampler = Sampler(self.device)
        self.max_model_len, self.context_bound = requested_context(config, loaded.hf_config)
        self.can_generate = getattr(self.model, "lm_head", None) is not None  # bare decoders only embed
        self.graphs = CudaGraphs(config)
        self.lm_head_rows: list[int] = []  # row counts the warm-up has still to run the LM head at (on CUDA)
        self.warm_up_s = 0.0
        self.num_blocks = 0
        self.drafter: Eagle3Drafter | None = None  # the drafts of HFENDPOINT_SPECULATIVE=eagle3 (engine/speculation.py)
        if not self.can_generate:
            return
        head = self._draft_head(config, loaded.hf_config) if config.speculative_method == "eagle3" else None
        extra = Eagle3Drafter.block_bytes(head[0], config.block_size, self.dtype) if head else 0
        self.num_blocks = allocate_kv_cache(self.model, config, self.max_model_len, loaded.model_dir, extra)
        if head:
            self.drafter = self._eagle3_drafter(*head)
        if self.num_blocks * self.block_size < self.max_model_len:  # one request must fit in the pool
            self.max_model_len = self.num_blocks * self.block_size
            self.context_bound = "what the KV pool holds for one request"
        if self.is_driver:
            note(f"max_model_len {self.max_model_len}, set by {self.context_bound},")
        self.buffers = StepBuffers(config, self.max_model_len, self.device, shifted_positions=self.model.uses_mrope)
        self.token_masks: TokenMasks | None = None  # made for the first step with a constrained request
        if self.device.type == "cuda":  # two: a step's ids may still be on their way while the next is launched
            rows = config.max_num_seqs * (1 + config.num_speculative_tokens)  # verification: a row per draft token
            self.host_ids = [(torch.zeros(2 * rows, dtype=torch.int64, pin_memory=True),
                              torch.zeros(rows * (1 + 2 * MAX_LOGPROBS), pin_memory=True),
                              torch.cuda.Event()) for _ in range(2)]
            self.num_launched = 0
            self.lm_head_rows = list(range(1, config.max_num_seqs + 1))
            if not config.enforce_eager:
                self.graphs.plan_all()
        if ranks:
            ranks.release_at_shutdown(self.graphs.captured)

    def _draft_head(self, config: EngineConfig, hf_config) -> tuple[Eagle3Head, tuple[int, ...]]:
        """The EAGLE-3 head of HFENDPOINT_SPECULATIVE=eagle3:PATH and the target layers it reads; ValueError
        naming the setting when it cannot serve this model."""
        check_eagle3(config, self.model, tp_size())
        try:
            return load_head(config.draft_head, hf_config.get_text_config(), self.max_model_len, self.dtype,
                             self.device)
        except (ValueError, OSError) as exc:
            raise ValueError(f"HFENDPOINT_SPECULATIVE={config.speculative}: {exc}") from None

    def _eagle3_drafter(self, head: Eagle3Head, layers: tuple[int, ...]) -> Eagle3Drafter:
        """The drafter over the KV pool's blocks, fed the target's auxiliary states by every forward."""
        head.share_embeddings(self.model.model.embed_tokens.weight)
        drafter = Eagle3Drafter(head, self.num_blocks, self.block_size)
        self.model.set_aux_sink(layers, drafter.store)
        return drafter

    @property
    def warming_up(self) -> bool:
        """Whether part of the warm-up is still to run (warm_up_next)."""
        return bool(self.lm_head_rows or self.graphs.pending)

    def warm_up_next(self) -> None:
        """Runs the next part of the warm-up that start-up leaves for later, so that the engine is ready sooner:
        the LM head at the next LM_HEAD_WARM_UP_ROWS row counts while some are left, then the largest CUDA graph
        not captured yet. Every tensor-parallel rank runs it (collective), with no step in flight. A part that
        fails ends the warm-up: the steps whose graph it lacks run eagerly."""
        started = time.perf_counter()
        try:
            if self.lm_head_rows:
                rows = self.lm_head_rows[:LM_HEAD_WARM_UP_ROWS]
                del self.lm_head_rows[:LM_HEAD_WARM_UP_ROWS]
                self._warm_lm_head(rows)
            else:
                self.graphs.capture_next(self.model, self.buffers.prepare, self.hidden_size)
        except Exception:  # eager steps serve every request a graph would
            log.exception("warm-up failed: the steps of the CUDA graphs not captured run eagerly")
            self.lm_head_rows.clear()
            self.graphs.pending.clear()
        self.warm_up_s += time.perf_counter() - started
        if not self.warming_up:
            took("warm-up", self.warm_up_s,
                 f"LM head at 1 to {self.config.max_num_seqs} rows, {len(self.graphs.captured)} CUDA graphs")

    @torch.inference_mode()
    def _warm_lm_head(self, row_counts: list[int]) -> None:
        """Runs the LM head once at each of these row counts (the warm-up covers every count a step can sample).
        The first GEMM of a shape cuBLAS has not run holds the host for about as long as a step: each time a
        shrinking decode batch reached such a size, the step launched ahead of the running one waited."""
        hidden = torch.zeros(max(row_counts), self.hidden_size, dtype=self.dtype, device=self.device)
        for rows in row_counts:
            self.model.compute_logits(hidden[:rows])
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], num_tokens: list[int], ahead: list[int] | None = None,
               follows: list[int] = ()) -> LaunchedStep:
        """Starts the step on the device without waiting for it. With ahead, it goes on from the last step
        launched, still unfinished (see StepBuffers.stage), and a step with constrained sampling rows is left
        to sample() once that one has been applied."""
        as_rows = ahead is None and self.buffers.verifies_as_rows(seqs, num_tokens)
        images, rope_positions = self._step_images(seqs, num_tokens, ahead) if self.vision is not None \
            else (None, None)
        # a step with images runs eagerly: no graph holds its image rows or its M-RoPE positions
        graph = self.graphs.shape_for(num_tokens, as_rows) if images is None and rope_positions is None else None
        staged = self.buffers.stage(seqs, num_tokens, graph, ahead, follows, as_rows)
        prompt_rows = prompt_logit_rows(seqs, num_tokens, ahead)
        logits, prompt_logprobs = self.collective("execute", staged, images, prompt_rows, rope_positions)
        if not staged.sample_rows:
            return LaunchedStep(seqs, num_tokens, [], None, None, plannable=True, prompt_rows=prompt_rows,
                                prompt_logprobs=prompt_logprobs)
        sampling = seqs if len(staged.sample_rows) == len(seqs) else [seqs[i] for i in staged.sample_rows]
        if any(seq.draft_token_ids for seq in sampling):
            step = LaunchedStep(seqs, num_tokens, staged.sample_rows, None, None, False, sampling, logits=logits,
                                prompt_rows=prompt_rows, prompt_logprobs=prompt_logprobs)
            self.verify(step)
            return step
        drawn_ahead = [1] * len(follows) + [0] * (len(sampling) - len(follows))  # the leading rows all sample
        plan = self.sampler.plan_for(sampling)
        step = LaunchedStep(seqs, num_tokens, staged.sample_rows, None, None, not plan.penalised, sampling,
                            drawn_ahead, logits, prompt_rows=prompt_rows, prompt_logprobs=prompt_logprobs)
        if ahead is None or not plan.constrained:
            self.sample(step)
        return step

    @torch.inference_mode()
    def sample(self, step: LaunchedStep) -> None:
        """Samples a launched step (with the masks of its constrained rows, from their constraints' state now)
        and starts copying its ids, and logprobs, to the host."""
        sampling, plan = step.sampling, self.sampler.plan_for(step.sampling)
        masks = None
        if plan.constrained:
            masks = self._token_masks(step.logits.shape[1]).build(sampling)
        self.last_sampled, logprobs = self.sampler.sample(step.logits, sampling, step.drawn_ahead, masks)
        step.logits, step.logprob_rows = None, plan.logprob_rows
        step.ids, step.logprobs, step.ready = self._to_host(self.last_sampled, logprobs)

    @torch.inference_mode()
    def verify(self, step: LaunchedStep) -> None:
        """Samples a verification step (Sampler.verify): every row of each request's draft tokens and its
        last; starts copying the drawn tokens and acceptances (and logprobs) to the host."""
        step.drafts = [list(seq.draft_token_ids) for seq in step.sampling]
        row_seqs = verification_rows(step.sampling, step.drafts)
        targets = np.fromiter(itertools.chain.from_iterable(draft + [-1] for draft in step.drafts), dtype=np.int64,
                              count=len(row_seqs))
        masks = None
        if any(seq.constraint is not None for seq in step.sampling):
            masks = self._token_masks(step.logits.shape[1]).build(step.sampling, step.drafts)
        packed, logprobs = self.sampler.verify(step.logits, row_seqs, targets, masks)
        step.logits, step.logprob_rows = None, self.sampler.plan_for(row_seqs).logprob_rows
        step.ids, step.logprobs, step.ready = self._to_host(packed, logprobs)

    def _token_masks(self, vocab_size: int) -> TokenMasks:
        """The bitmask buffers, made for the first step with a constrained request: a row per request and
        per draft token it may verify."""
        if self.token_masks is None:
            rows = self.config.max_num_seqs * (1 + self.config.num_speculative_tokens)
            self.token_masks = TokenMasks(vocab_size, rows, self.sampler.uploads)
        return self.token_masks

    def finish(self, step: LaunchedStep) -> tuple[list[int | None], list | None]:
        """The sampled token of each of the step's sequences (None: a prompt chunk that does not reach the
        end of its tokens), once the device has sent them: the step's one wait. With them, each sequence's
        logprobs (the sampled token's, the top ids, theirs; None where not asked), or None when none asked."""
        if step.ready is not None:
            step.ready.synchronize()
        if step.prompt_logprobs is not None:
            record_prompt_logprobs(step.seqs, step.prompt_rows, step.prompt_logprobs.cpu())
        sampled = [None] * len(step.seqs)
        if step.drafts is not None:
            return self._verified(step, sampled)
        if step.ids is not None:
            for row, token_id in zip(step.sample_rows, step.ids.tolist()):
                sampled[row] = token_id
        return sampled, self._logprobs(step)

    def _verified(self, step: LaunchedStep, sampled: list) -> tuple[list, list | None]:
        """The tokens each request of a verification step takes: its accepted draft tokens, up to the first
        it rejects, then the token drawn in that row (or in its last row when it accepts them all); with
        each token's logprobs where asked."""
        values = step.ids.tolist()
        drawn, accepted = values[:len(values) // 2], values[len(values) // 2:]
        row_logprobs = self._row_logprobs(step, verification_rows(step.sampling, step.drafts))
        per_seq = [None] * len(step.seqs) if row_logprobs else None
        first = 0
        for i, draft in enumerate(step.drafts):
            taken = next((j for j in range(len(draft)) if not accepted[first + j]), len(draft))
            sampled[step.sample_rows[i]] = draft[:taken] + [drawn[first + taken]]
            if row_logprobs:
                per_seq[step.sample_rows[i]] = row_logprobs[first:first + taken + 1]
            first += len(draft) + 1
        return sampled, per_seq

    def _logprobs(self, step: LaunchedStep) -> list | None:
        row_logprobs = self._row_logprobs(step, step.sampling)
        if row_logprobs is None:
            return None
        per_seq = [None] * len(step.seqs)
        for row, values in enumerate(row_logprobs):
            per_seq[step.sample_rows[row]] = values
        return per_seq

    @staticmethod
    def _row_logprobs(step: LaunchedStep, row_seqs: list[Sequence]) -> list | None:
        """Each sampling row's (logprob, top ids, their logprobs), None where its request does not ask; None
        when no row asks."""
        if step.logprobs is None:
            return None
        per_row = [None] * len(row_seqs)
        for row, values in zip(step.logprob_rows, step.logprobs.tolist()):
            per_row[row] = logprob_entry(values, row_seqs[row].params.logprobs)
        return per_row

    def _to_host(self, ids: Tensor, logprobs: Tensor | None) -> tuple[Tensor, Tensor | None,
                                                                     "torch.cuda.Event | None"]:
        """Starts copying sampled ids (and logprobs) into pinned memory, alternating between two buffers (the
        other may hold those of the step launched before, not read yet); returns them and their ready event."""
        if self.device.type != "cuda":
            return ids, logprobs, None
        self.num_launched += 1
        id_buffer, logprob_buffer, ready = self.host_ids[self.num_launched % 2]
        id_buffer = id_buffer[:len(ids)]
        id_buffer.copy_(ids, non_blocking=True)
        if logprobs is not None:  # a contiguous view: a strided copy to the host would not be asynchronous
            logprob_buffer = logprob_buffer[:logprobs.numel()].view(logprobs.shape)
            logprob_buffer.copy_(logprobs, non_blocking=True)
        ready.record()
        return id_buffer, logprob_buffer if logprobs is not None else None, ready

    def _step_images(self, seqs: list[Sequence], num_tokens: list[int], ahead: list[int] | None
                     ) -> tuple[StepImages | None, np.ndarray | None]:
        """The soft tokens of the images a prefill step computes (their encoder runs now, once per image), and
        an M-RoPE model's [3, T] positions for a step that computes part of a prompt with images (else None)."""
        starts = [seq.num_computed_tokens + (ahead[i] if ahead else 0) for i, seq in enumerate(seqs)]
        rope_positions = step_rope_positions(seqs, starts, num_tokens) if self.model.uses_mrope else None
        return step_images(seqs, starts, num_tokens, self.vision), rope_positions

    @torch.inference_mode()
    def execute(self, staged: StagedStep, images: StepImages | None = None, prompt_rows: PromptLogitRows | None = None,
                rope_positions: np.ndarray | None = None) -> tuple[Tensor | None, Tensor | None]:
        """The device side of a step, run by every tensor-parallel rank: upload, forward (or graph replay), the
        logits of the rows that sample and the prompt logprobs of prompt_rows (on rank 0; None elsewhere, when no
        row samples and when no request asks). images: the step's image rows (rank 0 encodes them and sends the
        soft tokens), rope_positions its M-RoPE positions [3, T] on the host; such steps run eagerly."""
        if not self.is_driver:
            self.buffers.restage(staged)
        step = self.buffers.upload(staged)
        if staged.num_follows:
            self._take_sampled_ids(step.input_ids[:staged.num_follows])
        if staged.graph:
            hidden = self.graphs.replay(staged.graph)
        elif images is not None or rope_positions is not None:
            images = images.on(self.device) if images is not None else None
            step.meta.image_spans = images.spans if images is not None else None  # spans: Gemma 3's rule
            positions = torch.from_numpy(rope_positions).to(self.device) if rope_positions is not None else None
            hidden = self.model(step.input_ids, step.positions, step.meta,
                                (images.rows, images.embeds) if images is not None else None, positions)
        else:
            hidden = self.model(step.input_ids, step.positions, step.meta)
        logits = self.model.compute_logits(hidden[step.logits_indices]) if staged.sample_rows else None
        return logits, compute_prompt_logprobs(self.model, hidden, prompt_rows) if prompt_rows else None

    def _take_sampled_ids(self, ids: Tensor) -> None:
        """Input ids staged as rows of the last step's sampled ids become those ids on the device; rank 0,
        which sampled them, sends them to the other tensor-parallel ranks."""
        if self.is_driver:
            ids.copy_(self.last_sampled[ids])
        if tp_size() > 1:
            dist.broadcast(ids, src=0)

    def forward_packed(self, token_lists: list[list[int]]) -> tuple[Tensor, Tensor]:
        """Hidden states of packed sequences, attending only within each, on every tensor-parallel rank (the
        forward engine/embedding.py's Embedder runs)."""
        return self.collective("execute_packed", token_lists)

    @torch.inference_mode()
    def execute_packed(self, token_lists: list[list[int]]) -> tuple[Tensor, Tensor]:
        return forward_decoder(self.model, token_lists)

    def collective(self, method: str, *args):
        """Calls a method that every tensor-parallel rank must run in step (its forward holds all-reduces)
        with picklable arguments: the other ranks, if any, are sent (method, args) first."""
        if self.ranks:
            self.ranks.send_call(method, args)
        return getattr(self, method)(*args)
