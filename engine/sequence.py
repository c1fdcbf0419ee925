"""One request as the engine tracks it: its tokens, how many of them have KV in the cache, and its blocks."""
from enum import Enum, auto

from engine.sampling_params import SamplingParams

# What a request's drafts are expected to achieve before any is verified: optimistic, so drafting starts long
# and is tried at all.
INITIAL_ACCEPTANCE = 0.8
INITIAL_DRAFT_GAIN = 2.0


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """A request's state. There are no phases: a step computes tokens num_computed_tokens.. of token_ids
    (a whole prompt, a chunk of one, a recomputation after preemption or one decode token), and the
    request samples a new token whenever that step reaches the end of token_ids.

    constraint: an opaque object that says which tokens may come next (engine/constraints.py); it accepts
    each token the request takes, once, and the request ends ("stop") when it terminates. shares_prompt_with:
    another request with the same prompt, whose computed prompt blocks this one takes from the prefix cache
    (it is admitted once that one's prompt is computed). images: the prompt's images, placed
    (engine/images.py). rope_positions and rope_delta: an M-RoPE model's prompt positions with images and the
    shift of every token after them (engine/mrope.py); None and 0 otherwise."""

    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "num_computed_tokens", "num_cached_tokens",
                 "block_table", "block_hashes", "num_committed_blocks", "num_freed_blocks", "status", "params",
                 "stop_token_ids", "max_len", "finish_reason", "error", "constraint", "shares_prompt_with", "logprobs",
                 "draft_token_ids", "draft_state", "acceptance", "draft_gain", "aside_draft", "images",
                 "prompt_logprobs", "rope_positions", "rope_delta")

    def __init__(self, request_id, prompt_token_ids: list[int], params: SamplingParams,
                 max_model_len: int, eos_token_ids: tuple[int, ...] = (), constraint=None,
                 shares_prompt_with: "Sequence | None" = None, images: list | None = None):
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0           # prompt tokens served from the prefix cache at admission
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []    # chained hash of each full block of token_ids, computed once
        self.num_committed_blocks = 0        # leading blocks of block_table registered in the prefix cache
        self.num_freed_blocks = 0            # leading blocks of block_table freed: out of the sliding window
        self.status = SequenceStatus.WAITING
        self.params = params
        self.stop_token_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos
                                                                  else frozenset(eos_token_ids))
        limit = max_model_len if params.max_tokens is None else self.num_prompt_tokens + params.max_tokens
        self.max_len = min(limit, max_model_len)
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.constraint = constraint
        self.shares_prompt_with = shares_prompt_with
        self.logprobs: list[tuple[float, list[int], list[float]]] = []  # per output token, when params ask
        self.draft_token_ids: list[int] = []  # guesses of the tokens after token_ids, verified by the next step
        self.draft_state = None               # the drafter's own record of this request (engine/drafters.py)
        self.acceptance = INITIAL_ACCEPTANCE  # recent share of draft tokens the model accepted (moving average)
        self.draft_gain = INITIAL_DRAFT_GAIN  # recent draft tokens accepted per drafting step, misses as 0 (same)
        self.aside_draft: tuple[int, list[int]] | None = None  # a draft checked on the side: (its position, tokens)
        self.images = images or []
        self.rope_positions = None
        self.rope_delta = 0
        # per prompt token, when params ask (None for the first, which nothing predicts), filled as steps compute
        # the positions before each: engine/prompt_logprobs.py
        self.prompt_logprobs: list[tuple[float, list[int], list[float]] | None] | None = (
            None if params.prompt_logprobs is None else [None] * self.num_prompt_tokens)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def needs_prompt_logits(self) -> bool:
        """Its prompt's logprobs are still to compute: its prompt positions must be computed, not taken from the
        prefix cache (once it has an output token, every prompt position has been computed)."""
        return self.prompt_logprobs is not None and self.num_output_tokens == 0

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def prompt_pending(self) -> bool:
        """The prompt of the request this one shares its prompt with is not in the prefix cache yet."""
        leader = self.shares_prompt_with
        return leader is not None and not leader.is_finished and leader.num_computed_tokens < leader.num_prompt_tokens

    def append_token(self, token_id: int, logprobs: tuple[float, list[int], list[float]] | None = None) -> bool:
        """Adds a sampled token (and its logprobs: its own, the top ids, theirs); finishes the request on a stop
        token, when its constraint ends or rejects the token, or at its length limit (returns True)."""
        self.token_ids.append(token_id)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        if token_id in self.stop_token_ids:
            self.finish("stop")
        elif self.constraint is not None and not self.constraint.accept_token(token_id):
            self.finish("error", f"token {token_id} broke the request's constraint")
        elif self.constraint is not None and self.constraint.is_terminated():
            self.finish("stop")
        elif len(self.token_ids) >= self.max_len:
            self.finish("length")
        else:
            return False
        return True

    def finish(self, reason: str, error: str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.error = error
