"""The model's tokenizer (from a model directory or a .gguf file) and the token ids embeddings are made of."""

from typing import TYPE_CHECKING

from models import model_files

if TYPE_CHECKING:  # the tokenizer's modules load with it, on start-up's tokenizer thread
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(model_path: str, cache_dir: str | None = None) -> "PreTrainedTokenizerBase":
    """The model's fast tokenizer (a .gguf file's converted under cache_dir, see models/model_files.py)."""
    tokenizer = model_files.load_tokenizer(model_path, cache_dir)
    if tokenizer is None or not tokenizer.is_fast:
        raise ValueError(f"{model_path} has no fast tokenizer (tokenizer.json); streaming detokenization needs one")
    return tokenizer


def embedding_token_ids(tokenizer: "PreTrainedTokenizerBase", texts: list[str],
                        keep_last: int | None) -> list[list[int]]:
    """The one place that decides which special tokens an embedding input carries.

    The tokenizer's own post-processor knows the model: encoders get [CLS] ... [SEP], decoder embedding
    models (Qwen3-Embedding) get their trailing end-of-text token. With keep_last, a longer input keeps
    its last tokens and its special tokens, keep_last in all (vLLM's truncate_prompt_tokens); without it
    nothing is cut (nor warned about: the caller refuses what is too long).
    """
    if keep_last is None:
        encoded = tokenizer(texts, add_special_tokens=True, verbose=False)
    else:
        tokenizer.truncation_side = "left"  # read at each call; the caller's tokenizer is its own copy
        encoded = tokenizer(texts, add_special_tokens=True, truncation=True, max_length=keep_last)
    return [list(ids) for ids in encoded["input_ids"]]
