"""EAGLE-3 draft heads as published (Li et al., "EAGLE-3"; the checkpoints of the EAGLE repository, SpecForge
and vLLM's speculators): a checkpoint directory whose config.json is a Llama config with draft_vocab_size
(architectures such as LlamaForCausalLMEagle3), and weights

    fc.weight            [H, 3 Ht]  the target's three auxiliary hidden states, concatenated, fused into one
    midlayer.*           one Llama decoder layer whose q/k/v projections read 2 H features, with hidden_norm
                         beside input_layernorm (speculators' checkpoints name it layers.0.*)
    norm.weight          the final RMSNorm
    lm_head.weight       [draft_vocab_size, H]
    d2t                  a draft token d is target token d + d2t[d] (absent: the same ids)
    embed_tokens.weight  optional; without it the head embeds with the target's embeddings

The auxiliary hidden states are the target's residual stream entering three layers (id j: the input of layer
j, 0 the embeddings), by default layers 2, L/2 and L-3 of L, or those the config lists
(eagle_aux_hidden_state_layer_ids, at the top or in eagle_config), concatenated in that order.

One head step at position p reads the token at p + 1 and a hidden state for position p: the fused auxiliary
states of the target there, or the head's own output at p - 1 when it drafts on from its previous guess. Its
layer input is concat(input_layernorm(embedding), hidden_norm(hidden)); the residual is the hidden state as
given (normed first when the config sets norm_before_residual). The layer's output (before `norm`) is the hidden
state the next step reads; norm and lm_head give the draft's logits.

The head runs on one device whole (not split over tensor-parallel ranks); engine/eagle3_drafter.py drives it.
"""
import glob
import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn

from kernels import rms_norm
from models.rotary import RotaryEmbedding, head_layout, rope_parameters

WEIGHT_PREFIXES = ("model.", "midlayer.", "layers.0.")  # stripped in this order: a layer's names as ours


def read_head_config(path: str):
    """The head's config.json (a transformers LlamaConfig); ValueError saying what is missing. transformers'
    Llama modules are imported here, not with the engine: they pull torch.distributed's tensor ops, a second of
    every start-up."""
    from transformers import LlamaConfig

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path} holds no config.json: give the directory of an EAGLE-3 draft head checkpoint")
    config = LlamaConfig.from_pretrained(path)
    if not getattr(config, "draft_vocab_size", None):
        config.draft_vocab_size = config.vocab_size
    return config


def aux_layer_ids(config, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose input the head reads: the config's list, else layers 2, L/2 and L-3."""
    eagle_config = getattr(config, "eagle_config", None) or {}
    ids = (getattr(config, "eagle_aux_hidden_state_layer_ids", None)
           or eagle_config.get("eagle_aux_hidden_state_layer_ids"))
    if ids is None:
        ids = (2, num_target_layers // 2, num_target_layers - 3)
    ids = tuple(int(i) for i in ids)
    if len(ids) != 3 or len(set(ids)) != 3 or not all(0 <= i < num_target_layers for i in ids):
        raise ValueError(f"the head reads the inputs of target layers {list(ids)}; it needs 3 distinct layers of "
                         f"the target's {num_target_layers}: list them as eagle_aux_hidden_state_layer_ids in the "
                         "head's config.json")
    return ids


def read_head_weights(path: str) -> dict[str, Tensor]:
    """The checkpoint's tensors under our names (model.safetensors files, else pytorch_model.bin)."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        tensors = {name: tensor for file in files for name, tensor in load_file(file).items()}
    elif os.path.isfile(bin_file := os.path.join(path, "pytorch_model.bin")):
        tensors = torch.load(bin_file, map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{path} holds no *.safetensors or pytorch_model.bin: give an EAGLE-3 head's directory")
    renamed = {}
    for name, tensor in tensors.items():
        for prefix in WEIGHT_PREFIXES:
            name = name.removeprefix(prefix)
        renamed[name] = tensor
    return renamed


class Eagle3Head(nn.Module):
    """The head's weights and the pieces of one step, for a drafter that keeps the keys and values itself."""

    def __init__(self, config, target_hidden_size: int, max_model_len: int):
        super().__init__()
        hidden = config.hidden_size
        self.config, self.eps = config, config.rms_norm_eps
        self.head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
        self.fc = nn.Linear(3 * target_hidden_size, hidden, bias=False)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(2 * hidden, q_size, bias=bias)
        self.k_proj = nn.Linear(2 * hidden, kv_size, bias=bias)
        self.v_proj = nn.Linear(2 * hidden, kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=bias)
        self.gate_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, hidden, bias=False)
        norms = ("hidden_norm", "input_layernorm", "post_attention_layernorm", "norm")
        for name in norms:
            setattr(self, name, nn.Parameter(torch.ones(hidden)))
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.embed_tokens: Tensor | None = None  # the checkpoint's, or the target's (share_embeddings)
        layout = head_layout(self.head_dim, self.head_dim)
        self.rotary = RotaryEmbedding(layout, max_model_len, rope_parameters(config), max_model_len)

    def load(self, tensors: dict[str, Tensor]) -> None:
        """Copies the checkpoint's tensors (read_head_weights) into the head; ValueError naming a tensor that is
        missing or of the wrong shape."""
        names = {f"self_attn.{p}_proj.{kind}": f"{p}_proj.{kind}" for p in "qkvo" for kind in ("weight", "bias")}
        names |= {f"mlp.{p}_proj.weight": f"{p}_proj.weight" for p in ("gate", "up", "down")}
        names |= {f"{norm}.weight": norm for norm in ("hidden_norm", "input_layernorm", "post_attention_layernorm",
                                                      "norm")}
        params = dict(self.named_parameters()) | {"d2t": self.d2t}
        loaded = set()
        for name, tensor in tensors.items():
            ours = names.get(name, name)
            if ours == "embed_tokens.weight":
                self.embed_tokens = tensor
                continue
            if ours not in params:
                continue  # t2d (the target-to-draft mask) and extras the head does not run
            if tuple(tensor.shape) != tuple(params[ours].shape):
                raise ValueError(f"the head's tensor {name} has shape {tuple(tensor.shape)}; its config.json "
                                 f"makes it {tuple(params[ours].shape)}")
            with torch.no_grad():
                params[ours].copy_(tensor)
            loaded.add(ours)
        optional = {"d2t"} if self.config.draft_vocab_size == self.config.vocab_size else set()
        missing = sorted(set(params) - loaded - optional)
        if missing:
            raise ValueError(f"the head's checkpoint lacks {', '.join(missing)}")

    def place(self, device: torch.device, dtype: torch.dtype) -> "Eagle3Head":
        """Moves the head to the device, its weights in dtype (the rotary table stays float32)."""
        self.to(device)
        for param in self.parameters():
            param.data = param.data.to(dtype)
        if self.embed_tokens is not None:
            self.embed_tokens = self.embed_tokens.to(device, dtype)
        return self.eval()

    def share_embeddings(self, weight: Tensor) -> None:
        """Embeds with the target's embeddings when the checkpoint has none of its own."""
        if self.embed_tokens is None:
            self.embed_tokens = weight

    def embed(self, token_ids: Tensor) -> Tensor:
        return F.embedding(token_ids, self.embed_tokens)

    def layer_input(self, embeds: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """The attention's input concat(input_layernorm(embeds), hidden_norm(hidden)) [T, 2 H] and the
        residual [T, H]."""
        normed = rms_norm(hidden, self.hidden_norm, self.eps)
        residual = normed if self.norm_before_residual else hidden
        return torch.cat((rms_norm(embeds, self.input_layernorm, self.eps), normed), dim=-1), residual

    def qkv(self, x: Tensor) -> Tensor:
        """q, k and v of the layer input, side by side [T, (n_q + 2 n_kv) D] (the layout of qkv_prologue)."""
        return torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)

    def after_attention(self, attention: Tensor, residual: Tensor) -> Tensor:
        """The layer's output (the next step's hidden state) from the attention's [T, n_q D] and the residual."""
        x = self.o_proj(attention) + residual
        normed = rms_norm(x, self.post_attention_layernorm, self.eps)
        return x + self.down_proj(F.silu(self.gate_proj(normed)) * self.up_proj(normed))

    def draft_tokens(self, hidden: Tensor) -> Tensor:
        """The head's most likely next token of each row, as target token ids."""
        draft = self.lm_head(rms_norm(hidden, self.norm, self.eps)).argmax(-1)
        return draft + self.d2t[draft]


def load_head(path: str, target_config, max_model_len: int, dtype: torch.dtype, device: torch.device
              ) -> tuple[Eagle3Head, tuple[int, ...]]:
    """The head at `path` for this target, and the target layers it reads; ValueError when it does not fit
    the target (see check_head)."""
    config = read_head_config(path)
    layers = aux_layer_ids(config, target_config.num_hidden_layers)
    tensors = read_head_weights(path)
    check_head(config, target_config, "embed_tokens.weight" in tensors)
    target_hidden = getattr(config, "target_hidden_size", None) or config.hidden_size
    head = Eagle3Head(config, target_hidden, max_model_len)
    head.load(tensors)
    return head.place(device, dtype), layers


def check_head(config, target_config, own_embeddings: bool) -> None:
    """Refuses a head trained for another target: its vocabulary, the width of the states it fuses, and (when
    it shares the target's embeddings) its own width must be the target's."""
    target_hidden = getattr(config, "target_hidden_size", None) or config.hidden_size
    checks = [("vocab_size", config.vocab_size, target_config.vocab_size),
              ("target_hidden_size (else hidden_size)", target_hidden, target_config.hidden_size)]
    if not own_embeddings:
        checks.append(("hidden_size (it has no embed_tokens: it shares the target's)", config.hidden_size,
                       target_config.hidden_size))
    for name, head_value, target_value in checks:
        if head_value != target_value:
            raise ValueError(f"the head's {name} is {head_value}, the target model's {target_value}: give an "
                             "EAGLE-3 head trained for this model")
    if not 0 < config.draft_vocab_size <= config.vocab_size:
        raise ValueError(f"the head's draft_vocab_size {config.draft_vocab_size} must be in 1..vocab_size")
