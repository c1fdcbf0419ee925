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
NAMES = NameMap(
    modules={
        "attention.self.query": ("qkv_proj", 0),
        "attention.self.key": ("qkv_proj", 1),
        "attention.self.value": ("qkv_proj", 2),
        "attention.output.dense": ("o_proj", None),
        "attention.output.LayerNorm": ("attn_norm", None),
        "intermediate.dense": ("up_proj", None),
        "output.dense": ("down_proj", None),
        "output.LayerNorm": ("mlp_norm", None),
    },
    rewrites=((r"^(bert|roberta|model)\.", ""), (r"^encoder\.layer\.", "layers."), (r"\.gamma$", ".weight"),
              (r"\.beta$", ".bias")),
    skip=r"^(pooler\.|cls\.|lm_head\.|classifier\.|embeddings\.(position_ids|token_type_ids)$)",
)


def load_bert(model_dir: str, hf_config, dtype: torch.dtype, device: torch.device) -> BertModel:
    with torch.device(device):
        model = BertModel(hf_config)
    load_weights(model, iterate_safetensors(model_dir, lazy=True), model_dir, NAMES)
    return model.to(dtype).eval()
