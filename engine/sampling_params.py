"""How one request wants its tokens chosen, validated on construction."""
import math
from dataclasses import dataclass

from kernels import GREEDY_TEMPERATURE

MAX_LOGPROBS = 20  # alternatives per token a request may ask for (vLLM's default limit, OpenAI's)


@dataclass
class SamplingParams:
    temperature: float = 1.0        # below GREEDY_TEMPERATURE (0 included): greedy
    top_p: float = 1.0              # (0, 1]
    top_k: int = -1                 # <= 0: off
    min_p: float = 0.0              # [0, 1]
    presence_penalty: float = 0.0   # [-2, 2], on generated tokens
    frequency_penalty: float = 0.0  # [-2, 2], on generated tokens
    repetition_penalty: float = 1.0  # (0, 2], on prompt and generated tokens
    max_tokens: int | None = 16     # None: until max_model_len
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    logprobs: int | None = None     # None: none; k: the sampled token's logprob and the k most likely tokens'
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before any other processing
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob (from the raw model, given the
    #                                     tokens before it) and the k most likely tokens' at its position

    def __post_init__(self):
        _number("temperature", self.temperature, lambda x: x >= 0, ">= 0")
        _number("top_p", self.top_p, lambda x: 0 < x <= 1, "in (0, 1]")
        _integer("top_k", self.top_k, lambda x: True, "an integer")
        _number("min_p", self.min_p, lambda x: 0 <= x <= 1, "in [0, 1]")
        _number("presence_penalty", self.presence_penalty, lambda x: -2 <= x <= 2, "in [-2, 2]")
        _number("frequency_penalty", self.frequency_penalty, lambda x: -2 <= x <= 2, "in [-2, 2]")
        _number("repetition_penalty", self.repetition_penalty, lambda x: 0 < x <= 2, "in (0, 2]")
        if self.max_tokens is not None:
            _integer("max_tokens", self.max_tokens, lambda x: x >= 1, ">= 1 (or None)")
        if self.seed is not None:
            _integer("seed", self.seed, lambda x: 0 <= x < 2**64, "in [0, 2**64) (or None)")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = tuple(self.stop_token_ids)
        for token in self.stop_token_ids:
            _integer("stop_token_ids", token, lambda x: x >= 0, "non-negative integers")
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, lambda x: 0 <= x <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}] (or None)")
        if self.prompt_logprobs is not None:
            _integer("prompt_logprobs", self.prompt_logprobs, lambda x: 0 <= x <= MAX_LOGPROBS,
                     f"in [0, {MAX_LOGPROBS}] (or None)")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a map from token id to bias, got {self.logit_bias!r}")
            for token, bias in self.logit_bias.items():
                _integer("logit_bias token ids", token, lambda x: x >= 0, "non-negative integers")
                _number(f"logit_bias[{token}]", bias, lambda x: True, "a finite number")

    @property
    def greedy(self) -> bool:
        """Temperatures too small to divide logits by choose the argmax, as temperature 0 does."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)


def _number(name, value, ok, allowed):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _integer(name, value, ok, allowed):
    if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
