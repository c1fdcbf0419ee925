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
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from engine.config import EngineConfig
from engine.constraints import TokenMasks
from engine.cuda_graphs import CudaGraphs
from engine.embedding import forward_decoder
from engine.kv_cache import allocate_kv_cache
from engine.prompt_logprobs import PromptLogitRows, compute_prompt_logprobs, prompt_logit_rows, record_prompt_logprobs
from engine.sampler import Sampler, logprob_entry
from engine.sampling_params import MAX_LOGPROBS
from engine.sequence import Sequence
from engine.step_inputs import StagedStep, StepBuffers
from models.parallel_layers import tp_rank, tp_size


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

    @property
    def deferred(self) -> bool:
        """Launched, not yet sampled: ModelRunner.sample() must run before finish()."""
        return self.logits is not None


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded, ranks=None):
        """ranks: on rank 0 of a tensor-parallel engine, the other ranks (engine/tensor_parallel.py's
        TensorParallelRanks), which run every call that goes through collective(); None otherwise."""
        self.config, self.ranks = config, ranks
        self.model = loaded.model
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        self.block_size = config.block_size
        self.vocab_size = loaded.hf_config.vocab_size
        self.hidden_size = loaded.hf_config.hidden_size
        self.is_driver = tp_rank() == 0  # stages steps and samples; the other tensor-parallel ranks follow
        self.sampler = Sampler(self.device)
        self.max_model_len = min(config.max_model_len, loaded.hf_config.max_position_embeddings)
        self.can_generate = getattr(self.model, "lm_head", None) is not None  # bare decoders only embed
        self.graphs = CudaGraphs(config)
        self.num_blocks = 0
        if not self.can_generate:
            return
        self.num_blocks = allocate_kv_cache(self.model, config, self.max_model_len, loaded.model_dir)
        self.max_model_len = min(self.max_model_len, self.num_blocks * self.block_size)  # one request fits
        self.buffers = StepBuffers(config, self.max_model_len, self.device)
        self.token_masks: TokenMasks | None = None  # made for the first step with a constrained request
        if self.device.type == "cuda":  # two: a step's ids may still be on their way while the next is launched
            self.host_ids = [(torch.zeros(config.max_num_seqs, dtype=torch.int64, pin_memory=True),
                              torch.zeros(config.max_num_seqs * (1 + 2 * MAX_LOGPROBS), pin_memory=True),
                              torch.cuda.Event()) for _ in range(2)]
            self.num_launched = 0
            self._warm_lm_head()
            if not config.enforce_eager:
                self.graphs.capture(self.model, self.buffers.prepare, self.hidden_size)
        if ranks:
            ranks.release_at_shutdown(self.graphs.captured)

    @torch.inference_mode()
    def _warm_lm_head(self) -> None:
        """Runs the LM head once at every row count a step can sample. The first GEMM of a shape cuBLAS has not
        run holds the host for about as long as a step: each time a shrinking decode batch reached such a size,
        the step launched ahead of the running one waited."""
        hidden = torch.zeros(self.config.max_num_seqs, self.hidden_size, dtype=self.dtype, device=self.device)
        for rows in range(1, self.config.max_num_seqs + 1):
            self.model.compute_logits(hidden[:rows])
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], num_tokens: list[int], ahead: list[int] | None = None,
               follows: list[int] = ()) -> LaunchedStep:
        """Starts the step on the device without waiting for it. With ahead, it goes on from the last step
        launched, still unfinished (see StepBuffers.stage), and a step with constrained sampling rows is left
        to sample() once that one has been applied."""
        staged = self.buffers.stage(seqs, num_tokens, self.graphs.shape_for(num_tokens), ahead, follows)
        prompt_rows = prompt_logit_rows(seqs, num_tokens, ahead)
        logits, prompt_logprobs = self.collective("execute", staged, prompt_rows)
        if not staged.sample_rows:
            return LaunchedStep(seqs, num_tokens, [], None, None, plannable=True, prompt_rows=prompt_rows,
                                prompt_logprobs=prompt_logprobs)
        sampling = seqs if len(staged.sample_rows) == len(seqs) else [seqs[i] for i in staged.sample_rows]
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
            if self.token_masks is None:
                self.token_masks = TokenMasks(step.logits.shape[1], self.config.max_num_seqs, self.sampler.uploads)
            masks = self.token_masks.build(sampling)
        self.last_sampled, logprobs = self.sampler.sample(step.logits, sampling, step.drawn_ahead, masks)
        step.logits, step.logprob_rows = None, plan.logprob_rows
        step.ids, step.logprobs, step.ready = self._to_host(self.last_sampled, logprobs)

    def finish(self, step: LaunchedStep) -> tuple[list[int | None], list | None]:
        """The sampled token of each of the step's sequences (None: a prompt chunk that does not reach the
        end of its tokens), once the device has sent them: the step's one wait. With them, each sequence's
        logprobs (the sampled token's, the top ids, theirs; None where not asked), or None when none asked."""
        if step.ready is not None:
            step.ready.synchronize()
        if step.prompt_logprobs is not None:
            record_prompt_logprobs(step.seqs, step.prompt_rows, step.prompt_logprobs.cpu())
        sampled = [None] * len(step.seqs)
        if step.ids is not None:
            for row, token_id in zip(step.sample_rows, step.ids.tolist()):
                sampled[row] = token_id
        return sampled, self._logprobs(step)

    def _logprobs(self, step: LaunchedStep) -> list | None:
        if step.logprobs is None:
            return None
        per_seq = [None] * len(step.seqs)
        sampling = step.sampling
        for row, values in zip(step.logprob_rows, step.logprobs.tolist()):
            per_seq[step.sample_rows[row]] = logprob_entry(values, sampling[row].params.logprobs)
        return per_seq

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

    @torch.inference_mode()
    def execute(self, staged: StagedStep, prompt_rows: PromptLogitRows | None = None
                ) -> tuple[Tensor | None, Tensor | None]:
        """The device side of a step, run by every tensor-parallel rank: upload, forward (or graph replay), the
        logits of the rows that sample and the prompt logprobs of prompt_rows (on rank 0; None elsewhere, when no
        row samples and when no request asks)."""
        if not self.is_driver:
            self.buffers.restage(staged)
        step = self.buffers.upload(staged)
        if staged.num_follows:
            self._take_sampled_ids(step.input_ids[:staged.num_follows])
        if staged.graph:
            hidden = self.graphs.replay(staged.graph)
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
