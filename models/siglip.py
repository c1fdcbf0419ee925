"""The SigLIP vision transformer (the vision tower of Gemma 3), in torch: patches -> per-patch hidden states.

Images arrive at the tower's own resolution (the model's image processor resized and normalised them), so the
learned position embeddings apply as they are. Attention is scaled_dot_product_attention over all patches of
an image (no mask); the module names follow transformers' SiglipVisionModel, so a checkpoint's names load
unchanged.
"""

import torch.nn.functional as F
from torch import Tensor, nn

ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}  # config's hidden_act: F.gelu's approximate


class SiglipEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, kernel_size=config.patch_size,
                                         stride=config.patch_size)
        self.position_embedding = nn.Embedding((config.image_size // config.patch_size) ** 2, config.hidden_size)

    def forward(self, pixel_values: Tensor) -> Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight


class SiglipAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        size = config.hidden_size
        self.num_heads = config.num_attention_heads
        if size % self.num_heads:
            raise ValueError(f"vision hidden_size {size} is not a multiple of num_attention_heads {self.num_heads}")
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(size, size) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        batch, length, size = x.shape
        q, k, v = (proj(x).view(batch, length, self.num_heads, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)  # scale: head_dim ** -0.5, as SigLIP's
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, size))


class SiglipMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision hidden_act {config.hidden_act!r} is not supported (supported: "
                             f"{', '.join(ACTIVATIONS)})")
        self.approximate = ACTIVATIONS[config.hidden_act]
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = SiglipAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = SiglipMLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(config) for _ in range(config.num_hidden_layers))


class SiglipVisionTransformer(nn.Module):
    """pixel_values [N, C, image_size, image_size] -> hidden states [N, patches, hidden] after the final norm.
    The pooling head (vision_use_head) is not built: Gemma 3 reads the patches' states, and its loader skips the
    head's weights."""

    def __init__(self, config):
        super().__init__()
        self.image_size, self.num_channels = config.image_size, config.num_channels
        self.embeddings = SiglipEmbeddings(config)
        self.encoder = SiglipEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: Tensor) -> Tensor:
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)
