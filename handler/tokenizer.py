"""The model's tokenizer (from a model directory or a .gguf file) and the token ids embeddings are made of."""

from transformers import PreTrainedTokenizerBase

from models import model_files


def load_tokenizer(model_path: str, cache_dir: str | None = None) -> PreTrainedTokenizerBase:
    """The model's fast tokenizer (a .gguf file's converted under cache_dir, see models/model_files.py)."""
    tokenizer = model_files.load_tokenizer(model_path, cache_dir)
    if tokenizer is None or not tokenizer.is_fast:
        raise ValueError(f"{model_path} has no fast tokenizer (tokenizer.json); streaming detokenization needs one")
    return tokenizer


def embedding_token_ids(tokenizer: PreTrainedTokenizerBase, texts: list[str], max_length: int) -> list[list[int]]:
    """The one place that decides which special tokens an embedding input carries.

    The tokenizer's own post-processor knows the model: encoders get [CLS] ... [SEP], decoder embedding
    models (Qwen3-Embedding) get their trailing end-of-text token. Long inputs are truncated to the
    model's limit, keeping the special tokens, as sentence-transformers does.
    """
    encoded = tokenizer(texts, add_special_tokens=True, truncation=True, max_length=max_length)
    return [list(ids) for ids in encoded["input_ids"]]
