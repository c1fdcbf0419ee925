"""Tiny random cross-encoders (BERT and RoBERTa sequence classifiers with one label) saved with a word-piece
tokenizer, which sentence-transformers' CrossEncoder loads as the reference (tests/ is on the import path)."""
import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertTokenizerFast,
    RobertaConfig,
    RobertaForSequenceClassification,
)

WORDS = ("the a cat dog sat on mat paris is capital of france city river what where who rome italy berlin "
         "germany big small old new").split()
SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=64, initializer_range=0.5, num_labels=1)
# BERT's: two token types, its config silent on [SEP] (the tokenizer's); RoBERTa's, as XLM-R rerankers: one type
MODELS = {"bert": (BertConfig, BertForSequenceClassification, {"type_vocab_size": 2}),
          "roberta": (RobertaConfig, RobertaForSequenceClassification, {"type_vocab_size": 1, "bos_token_id": 2,
                                                                        "eos_token_id": 3})}


def save_cross_encoder(path, kind: str = "bert") -> None:
    """Writes a seeded random cross-encoder of `kind` (bert, roberta) and its tokenizer under path. The wide
    initialisation spreads the scores, so that rankings mean something."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    (path / "vocab.txt").write_text("\n".join(vocab))
    config_class, model_class, extra = MODELS[kind]
    inputs = ["input_ids", "attention_mask"] + (["token_type_ids"] if extra["type_vocab_size"] > 1 else [])
    BertTokenizerFast(str(path / "vocab.txt"), model_input_names=inputs).save_pretrained(path)
    config = config_class(vocab_size=len(vocab), pad_token_id=0, **SHAPE, **extra)
    torch.manual_seed(0)
    model_class(config).save_pretrained(path)
