"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa) over packed variable-length sequences.

Sequences are concatenated into one [T] stream delimited by cu_seqlens, so no pad token is ever
computed: attention runs per sequence through kernels.varlen_attention (causal=False).
The layer is post-norm: x = LN(x + attn(x)); x = LN(x + mlp(x)), with Q, K and V fused in one matmul.
"""
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels import varlen_attention
from models.loader import NameMap, iterate_safetensors, load_weights
from models.model_files import load_tokenizer
from models.parallel_layers import MergedColumnParallelLinear

# RoBERTa-style models number positions from padding_idx + 1 (position padding_idx is reserved for pads).
_POSITION_OFFSET_MODEL_TYPES = ("roberta", "xlm-roberta", "camembert")
_GELU_APPROXIMATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


class BertEmbeddings(nn.Module):

    def __init__(self, config):
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden)
        type_vocab_size = getattr(config, "type_vocab_size", 0) or 0
        self.token_type_embeddings = nn.Embedding(type_vocab_size, hidden) if type_vocab_size > 0 else None
        self.LayerNorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.position_offset = position_offset(config)

    def forward(self, input_ids: Tensor, positions: Tensor, token_type_ids: Tensor | None) -> Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions + self.position_offset)
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                x = x + self.token_type_embeddings.weight[0]
            else:
                x = x + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)


class BertLayer(nn.Module):

    def __init__(self, config):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.scale = self.head_dim ** -0.5
        self.gelu_approximate = _GELU_APPROXIMATIONS[config.hidden_act]
        self.qkv_proj = MergedColumnParallelLinear(hidden, [hidden] * 3, bias=True)
        self.o_proj = nn.Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.up_proj = nn.Linear(hidden, config.intermediate_size)
        self.down_proj = nn.Linear(config.intermediate_size, hidden)
        self.mlp_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)

    def forward(self, x: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).view(num_tokens, 3, self.num_heads, self.head_dim).unbind(1)
        attn = varlen_attention(q, k, v, cu_seqlens, max_seqlen, self.scale, causal=False)
        x = self.attn_norm(x + self.o_proj(attn.reshape(num_tokens, -1)))
        mlp = self.down_proj(F.gelu(self.up_proj(x), approximate=self.gelu_approximate))
        return self.mlp_norm(x + mlp)


class BertModel(nn.Module):

    def __init__(self, config):
        super().__init__()
        check_supported(config)
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    @property
    def max_positions(self) -> int:
        """Longest sequence the position table covers."""
        return self.config.max_position_embeddings - self.embeddings.position_offset

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, positions: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                token_type_ids: Tensor | None = None) -> Tensor:
        """input_ids, positions (0-based within each sequence): [T]; cu_seqlens int32 [B+1] -> hidden [T, H]."""
        x = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.layers:
            x = layer(x, cu_seqlens, max_seqlen)
        return x


class BertClassifier(BertModel):
    """A cross-encoder (BertForSequenceClassification, RobertaForSequenceClassification and XLM-R's): the encoder,
    then the classification head on the first token: a dense layer and tanh (BERT's pooler, RoBERTa's
    classifier.dense), then a projection to num_labels.

    A pair is one token list, [CLS] a [SEP] b [SEP] as the tokenizer builds it; where the model has two token
    types, the tokens after the first [SEP] (sep_token_id, the tokenizer's) are type 1, as the tokenizer marks a
    pair's second text."""

    def __init__(self, config, sep_token_id: int | None):
        super().__init__(config)
        self.num_labels = config.num_labels
        types = self.embeddings.token_type_embeddings
        self.sep_token_id = sep_token_id if types is not None and types.num_embeddings > 1 else None
        if self.sep_token_id is None and types is not None and types.num_embeddings > 1:
            raise ValueError("this cross-encoder has token types but no [SEP] token in its tokenizer to tell a "
                             "pair's second text by")
        self.head_dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.head_out = nn.Linear(config.hidden_size, config.num_labels)

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, positions: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                token_type_ids: Tensor | None = None) -> Tensor:
        if token_type_ids is None and self.sep_token_id is not None:
            token_type_ids = second_text(input_ids, positions, self.sep_token_id)
        return super().forward(input_ids, positions, cu_seqlens, max_seqlen, token_type_ids)

    @torch.inference_mode()
    def classify(self, first_tokens: Tensor) -> Tensor:
        """float32 logits [B, num_labels] from the hidden states of each sequence's first token [B, H]."""
        x = first_tokens.to(self.head_dense.weight.dtype)
        return self.head_out(torch.tanh(self.head_dense(x))).float()


def second_text(input_ids: Tensor, positions: Tensor, sep_token_id: int) -> Tensor:
    """Token types of packed pairs: 1 for the tokens after their sequence's first [SEP], else 0."""
    is_sep = (input_ids == sep_token_id).long()
    seps_before = torch.cumsum(is_sep, 0) - is_sep
    starts = torch.arange(len(input_ids), device=input_ids.device) - positions
    return (seps_before > seps_before[starts]).long()


def sep_token_id(model_dir: str, hf_config) -> int | None:
    """The [SEP] token's id: the config's, else the tokenizer's (BERT configs do not say)."""
    if getattr(hf_config, "sep_token_id", None) is not None:
        return hf_config.sep_token_id
    tokenizer = load_tokenizer(model_dir)
    return tokenizer.sep_token_id if tokenizer is not None else None


def position_offset(config) -> int:
    if config.model_type in _POSITION_OFFSET_MODEL_TYPES:
        return config.pad_token_id + 1
    return 0


def check_supported(config) -> None:
    """Refuse variants this module does not implement, rather than compute wrong vectors."""
    kind = getattr(config, "position_embedding_type", "absolute") or "absolute"
    if kind != "absolute":
        raise ValueError(f"BERT position_embedding_type {kind!r} is not supported (only 'absolute')")
    if config.hidden_act not in _GELU_APPROXIMATIONS:
        raise ValueError(f"BERT hidden_act {config.hidden_act!r} is not supported "
                         f"(supported: {', '.join(_GELU_APPROXIMATIONS)})")
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(f"hidden_size {config.hidden_size} is not divisible by "
                         f"num_attention_heads {config.num_attention_heads}")


# The checkpoint names of BERT, RoBERTa and XLM-R: the model's prefix dropped, encoder.layer.N renamed layers.N,
# old norm names (gamma, beta) renamed, the heads and buffers embedding inference does not use skipped, and
# each layer module renamed to ours (Q, K and V as the three slices of qkv_proj).
LAYER_MODULES = {
    "attention.self.query": ("qkv_proj", 0),
    "attention.self.key": ("qkv_proj", 1),
    "attention.self.value": ("qkv_proj", 2),
    "attention.output.dense": ("o_proj", None),
    "attention.output.LayerNorm": ("attn_norm", None),
    "intermediate.dense": ("up_proj", None),
    "output.dense": ("down_proj", None),
    "output.LayerNorm": ("mlp_norm", None),
}
REWRITES = ((r"^(bert|roberta|model)\.", ""), (r"^encoder\.layer\.", "layers."), (r"\.gamma$", ".weight"),
            (r"\.beta$", ".bias"))
NAMES = NameMap(LAYER_MODULES, REWRITES,
                skip=r"^(pooler\.|cls\.|lm_head\.|classifier\.|embeddings\.(position_ids|token_type_ids)$)")
# A cross-encoder's: its head too (BERT's pooler and classifier; RoBERTa's classifier.dense and out_proj).
CLASSIFIER_NAMES = NameMap({**LAYER_MODULES, "pooler.dense": ("head_dense", None),
                            "classifier.dense": ("head_dense", None), "classifier.out_proj": ("head_out", None),
                            "classifier": ("head_out", None)}, REWRITES,
                           skip=r"^(cls\.|lm_head\.|embeddings\.(position_ids|token_type_ids)$)")


def load_bert(model_dir: str, hf_config, dtype: torch.dtype, device: torch.device,
              classifier: bool = False) -> BertModel:
    """The encoder, or with classifier, the cross-encoder (BertClassifier) with its head."""
    with torch.device(device):
        model = BertClassifier(hf_config, sep_token_id(model_dir, hf_config)) if classifier else BertModel(hf_config)
    load_weights(model, iterate_safetensors(model_dir, lazy=True), model_dir, CLASSIFIER_NAMES if classifier else NAMES)
    return model.to(dtype).eval()
