"""Offline batch generation on the caller's thread, like Nano-vLLM's LLM."""
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from engine.startup_log import note, timed
from engine.tensor_parallel import load_on_all_ranks
from models.model_files import load_tokenizer

# Offline batches care for throughput only: prefill steps of twice the online budget (as vLLM's offline LLM
# takes) halve their count and host work. The handler keeps the smaller default, which bounds how long a
# prefill step holds up the streams that are decoding.
OFFLINE_MAX_BATCHED_TOKENS = 16384


class LLM:
    def __init__(self, model_path: str, **config_overrides):
        note("engine starting")
        config_overrides.setdefault("max_num_batched_tokens", OFFLINE_MAX_BATCHED_TOKENS)
        self.config = EngineConfig(model=model_path, **config_overrides)
        with ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as pool:  # it loads while the engine does
            # a .gguf file's tokenizer is its metadata's, converted under cache_dir as the weights' loader finds it
            tokenizer = pool.submit(timed, "tokenizer", load_tokenizer, model_path, self.config.cache_dir)
            loaded, self.ranks = load_on_all_ranks(self.config)
            if loaded.kind != "decoder":  # never with ranks: tensor parallelism refuses encoders before it starts
                raise ValueError(f"model {model_path} is an embedding model: it cannot generate")
            self.core = EngineCore(self.config, loaded, self.ranks)
            self.tokenizer = tokenizer.result()
        note("engine ready")

    def shutdown(self) -> None:
        """Stops the tensor-parallel ranks (with one rank there is nothing to stop)."""
        if self.ranks:
            self.ranks.shutdown()

    def generate(self, prompts: list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False, constraints: list | None = None, images: list | None = None
                 ) -> list[dict]:
        """Runs every prompt to completion; returns [{"text", "token_ids", "logprobs", "prompt_logprobs"}] in prompt
        order (text is None for a model without a tokenizer; logprobs, per token, and prompt_logprobs, per prompt
        token, where the params ask). constraints: one per prompt (or None), engine/constraints.py. images: per
        prompt, its images (engine/images.py's PromptImage, in the order of their runs of image tokens), for a model
        that reads images.

        Returns with no step in flight: where the last requests stop on a token the scheduler could not foresee, a
        step was launched ahead for them, and it is finished here, so that its time is this call's and every call
        starts from an idle engine (its prompts launched by its own first step, with speculation on or off)."""
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        constraints = constraints or [None] * len(prompts)
        images = images or [()] * len(prompts)
        if not len(sampling_params) == len(constraints) == len(images) == len(prompts):
            raise ValueError(f"{len(prompts)} prompts, {len(sampling_params)} sampling params, "
                             f"{len(constraints)} constraints and {len(images)} image lists")
        seqs = [self.core.make_sequence(i, self._encode(prompt), params, constraint, images=prompt_images)
                for i, (prompt, params, constraint, prompt_images)
                in enumerate(zip(prompts, sampling_params, constraints, images))]
        for seq in seqs:
            self.core.add(seq)
        done, started = 0, time.perf_counter()
        while self.core.has_work() or self.core.in_flight is not None:
            for seq, _ in self.core.step():
                if seq.finish_reason == "error":
                    for other in seqs:
                        self.core.abort(other)
                    raise RuntimeError(f"generation failed: {seq.error}")
                done += seq.is_finished
            if progress:
                print(f"\r{done}/{len(seqs)} done, {time.perf_counter() - started:.1f} s", end="", file=sys.stderr)
        if progress:
            print(file=sys.stderr)
        return [{"text": self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
                 if self.tokenizer else None, "token_ids": seq.output_token_ids, "logprobs": seq.logprobs,
                 "prompt_logprobs": seq.prompt_logprobs}
                for seq in seqs]

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise ValueError(f"{self.config.model} has no tokenizer: pass prompts as token-id lists")
        return self.tokenizer.encode(prompt)

