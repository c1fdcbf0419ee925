"""Time to first token for a 1,024-token prompt and time per output token at batch 1, 8, 64 and 256,
through the engine's own step loop (random Qwen3-0.6B-shaped weights unless --model is given). Decode steps
overlap the host's work with the previous step's GPU time unless --no-overlap is given. --fp8 times the
model's block-wise FP8 copy next (bench/random_model.py), each on an engine of its own.

--json-schema also times every row under a JSON-schema grammar (an array of at least 1,000 strings, so no row
ends within the run) and --top-logprobs K every row asking for K logprobs per token, each against the
unconstrained time at the same batch in the same run; --temperature T the same for every row sampling at T
(the plain runs are greedy). Random weights come with no tokenizer: the grammar is
compiled for a synthetic byte-level vocabulary of the model's size (single bytes, pseudo-words with and
without a leading space, and a few percent of punctuation tokens, quotes among them, as in a real BPE vocab).
"""
import argparse
import gc
import json
import random
import statistics
import time
from random import randint, seed

import torch
from transformers import AutoConfig

from engine import LLM, SamplingParams
from random_model import (
    add_all_reduce_argument,
    add_fp8_arguments,
    add_gpu_features_argument,
    make_random_model,
    weights_to_run,
)

LONG_JSON = {"type": "array", "items": {"type": "string"}, "minItems": 1000}
PUNCTUATION = ['"', '",', '":', '["', '"]', '{"', '"}', ', "', '": "', '."', ' "', "'", ".", ",", ":", ";", "!", "?",
               "(", ")", "[", "]", "{", "}", "-", "_", "/", "\\", "\\n", "\\u", "\n", "\n\n", "  ", "\t"]


def random_prompt(length: int) -> list[int]:
    return [randint(0, 10000) for _ in range(length)]


def synthetic_vocabulary(size: int) -> list[bytes]:
    """A byte-level vocabulary of `size` distinct tokens: the 256 bytes, then punctuation and pseudo-words."""
    rng = random.Random(0)
    vocab = [bytes([b]) for b in range(256)]
    seen = set(vocab)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + list("aeiou") + ["th", "ng", "st", "er"]
    while len(vocab) < size:
        if rng.random() < 0.03:
            token = rng.choice(PUNCTUATION) + rng.choice(["", "", " ", rng.choice(syllables)])
        else:
            token = rng.choice(["", " ", " ", "  "]) + "".join(rng.choices(syllables, k=rng.randint(1, 4)))
            token = token.capitalize() if rng.random() < 0.2 else token
        raw = token.encode()
        if raw not in seen:
            seen.add(raw)
            vocab.append(raw)
    return vocab


def long_json_grammar(model_path: str):
    """The compiled LONG_JSON grammar for a vocabulary of the model's size (its last token stands for eos)."""
    import xgrammar

    vocab_size = AutoConfig.from_pretrained(model_path).vocab_size
    info = xgrammar.TokenizerInfo(synthetic_vocabulary(vocab_size), vocab_size=vocab_size,
                                  stop_token_ids=[vocab_size - 1])
    return xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(LONG_JSON), any_whitespace=False)


def run_to_first_token(core, prompts, max_tokens, logprobs=None, grammar=None, temperature=0.0) -> list:
    """Admits the prompts and steps until each has its first token; returns the sequences."""
    params = SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=max_tokens, logprobs=logprobs)
    if grammar is not None:  # xgrammar only where a grammar is asked for (the GPU image has none)
        from handler.grammar import GrammarConstraint
    seqs = [core.make_sequence(object(), p, params, GrammarConstraint(grammar) if grammar is not None else None)
            for p in prompts]
    for seq in seqs:
        core.add(seq)
    while any(seq.num_output_tokens == 0 for seq in seqs):
        core.step()
    return seqs


def time_to_first_token(core, prompt_len: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):  # a fresh prompt each time: no prefix-cache hits
        torch.cuda.synchronize()
        start = time.perf_counter()
        seqs = run_to_first_token(core, [random_prompt(prompt_len)], max_tokens=1)
        times.append(time.perf_counter() - start)
        assert seqs[0].is_finished
    return statistics.median(times)


def time_per_output_token(core, batch: int, prompt_len: int, steps: int, **features) -> float:
    """features: run_to_first_token's logprobs, grammar and temperature, for every row. Rows admitted first
    decode while the later ones prefill, so each may generate as many tokens as the context leaves: every row
    runs the whole time, and the batch stays whole."""
    seqs = run_to_first_token(core, [random_prompt(prompt_len) for _ in range(batch)],
                              max_tokens=core.max_model_len - prompt_len, **features)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        core.step()  # returns after a step's sampled ids reached the host (overlapped: the step before)
        times.append(time.perf_counter() - start)
    assert not any(seq.is_finished for seq in seqs), "every row ran the whole time"
    for seq in seqs:
        core.abort(seq)
    return statistics.median(times)


def measure(path: str, args, **settings) -> tuple[list[tuple[str, str, float]], list[tuple]]:
    """(metric, shape, ms) rows for the model at path, and (batch, feature, plain ms, with ms) for the features
    asked for, on an engine of its own (freed before returning)."""
    llm = LLM(path, enforce_eager=args.enforce_eager, tensor_parallel_size=args.tensor_parallel_size,
              kv_cache_dtype=args.kv_cache_dtype, gpu_features=args.gpu_features,
              p2p_all_reduce=args.p2p_all_reduce, **settings)
    core = llm.core
    core.finish_warm_up()  # the prefills measured replay graphs
    core.overlap = not args.no_overlap
    time_to_first_token(core, args.prompt_len, 3)  # warm-up
    ttft = time_to_first_token(core, args.prompt_len, 10)
    rows = [("TTFT", f"1 x {args.prompt_len}", ttft * 1e3)]
    variants = {}
    if args.json_schema:
        variants["json-schema"] = {"grammar": long_json_grammar(path)}
    if args.top_logprobs is not None:
        variants[f"top-logprobs {args.top_logprobs}"] = {"logprobs": args.top_logprobs}
    if args.temperature is not None:
        variants[f"temperature {args.temperature}"] = {"temperature": args.temperature}
    compared = []
    for batch in map(int, args.batches.split(",")):
        tpot = time_per_output_token(core, batch, args.prompt_len, args.steps)
        rows.append(("TPOT", f"batch {batch} x ctx {args.prompt_len}", tpot * 1e3))
        for name, features in variants.items():
            time_per_output_token(core, batch, args.prompt_len, 8, **features)  # warm-up (first masks, kernels)
            with_feature = time_per_output_token(core, batch, args.prompt_len, args.steps, **features)
            compared.append((batch, name, tpot * 1e3, with_feature * 1e3))
    llm.shutdown()
    del llm, core
    gc.collect()
    torch.cuda.empty_cache()
    return rows, compared


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--no-overlap", action="store_true", help="read each step's ids before launching the next")
    ap.add_argument("--json-schema", action="store_true", help="also time every row under a long JSON schema")
    ap.add_argument("--top-logprobs", type=int, help="also time every row asking for this many logprobs")
    ap.add_argument("--temperature", type=float, help="also time every row sampling at this temperature")
    add_fp8_arguments(ap, "then the model's block-wise FP8 copy, on an engine of its own")
    add_gpu_features_argument(ap)
    add_all_reduce_argument(ap)
    args = ap.parse_args()
    seed(0)
    path = make_random_model(args.model) if "/" not in args.model else args.model
    print(f"{'weights':16} {'metric':6} {'shape':28} {'ms (median)':>12}")
    compared = []
    for weights, model_path, settings in weights_to_run(path, args):
        rows, featured = measure(model_path, args, **settings)
        for metric, shape, ms in rows:
            print(f"{weights:16} {metric:6} {shape:28} {ms:12.3f}", flush=True)
        compared += [(weights, *row) for row in featured]
    if compared:
        print(f"\n{'weights':16} {'batch':>5} {'feature':18} {'plain ms':>9} {'with ms':>9} {'over':>7}")
        for weights, batch, name, plain, with_feature in compared:
            print(f"{weights:16} {batch:5d} {name:18} {plain:9.3f} {with_feature:9.3f} "
                  f"{100 * (with_feature / plain - 1):6.1f}%")


if __name__ == "__main__":
    main()
