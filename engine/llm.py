"""Offline batch generation on the caller's thread, like Nano-vLLM's LLM."""
import os
import sys
import time

from transformers import AutoTokenizer

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from engine.tensor_parallel import load_on_all_ranks

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Offline batches care for throughput only: prefill steps of twice the online budget (as vLLM's offline LLM
# takes) halve their count and host work. The handler keeps the smaller default, which bounds how long a
# prefill step holds up the streams that are decoding.
OFFLINE_MAX_BATCHED_TOKENS = 16384


class LLM:
    def __init__(self, model_path: str, **config_overrides):
        config_overrides.setdefault("max_num_batched_tokens", OFFLINE_MAX_BATCHED_TOKENS)
        self.config = EngineConfig(model=model_path, **config_overrides)
        loaded, self.ranks = load_on_all_ranks(self.config)
        if loaded.kind != "decoder":  # never with ranks: tensor parallelism refuses encoders before it starts
            raise ValueError(f"model {model_path} is an embedding model: it cannot generate")
        self.core = EngineCore(self.config, loaded, self.ranks)
        self.tokenizer = load_tokenizer(loaded.model_dir)

    def shutdown(self) -> None:
        """Stops the tensor-parallel ranks (with one rank there is nothing to stop)."""
        if self.ranks:
            self.ranks.shutdown()

    def generate(self, prompts: list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False) -> list[dict]:
        """Runs every prompt to completion; returns [{"text", "token_ids"}] in prompt order
        (text is None for a model without a tokenizer)."""
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        seqs = [self.core.make_sequence(i, self._encode(prompt), params)
                for i, (prompt, params) in enumerate(zip(prompts, sampling_params))]
        for seq in seqs:
            self.core.add(seq)
        done, started = 0, time.perf_counter()
        while self.core.has_work():
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
                 if self.tokenizer else None, "token_ids": seq.output_token_ids} for seq in seqs]

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise ValueError(f"{self.config.model} has no tokenizer: pass prompts as token-id lists")
        return self.tokenizer.encode(prompt)


def load_tokenizer(model_dir: str):
    """The tokenizer in a model directory (for a .gguf file, the one its metadata was converted into), or None."""
    if not any(os.path.isfile(os.path.join(model_dir, name)) for name in TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(model_dir)
