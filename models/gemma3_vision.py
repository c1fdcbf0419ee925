"""Gemma 3's image encoder: the SigLIP tower (models/siglip.py) and the multimodal projector, from preprocessed
pixels to the soft tokens the decoder reads in place of the image token's embedding.

The projector average-pools the tower's patch grid down to mm_tokens_per_image tokens (a square grid), applies
a (1 + w) RMSNorm in float32 and projects to the decoder's width with one matrix (mm_input_projection_weight,
[vision hidden, text hidden]). The decoder's embedding scale does not apply to these rows.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.loader import NameMap
from models.siglip import SiglipVisionTransformer

# The encoder's tensors in a checkpoint, under model. or at the top, the tower's with or without vision_model.
# (the layouts transformers 4 and 5 write); the rest (the decoder, the tower's unused pooling head) is not ours.
CHECKPOINT_REWRITES = ((r"^model\.(?=vision_tower\.|multi_modal_projector\.)", ""),
                       (r"^vision_tower\.vision_model\.", "vision_tower."))
CHECKPOINT_SKIPPED = r"^(?!vision_tower\.|multi_modal_projector\.)|^vision_tower\.head\."


class Gemma3RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, config):
        super().__init__()
        vision, text = config.vision_config, config.get_text_config()
        self.patches_per_side = vision.image_size // vision.patch_size
        tokens_per_side = round(config.mm_tokens_per_image ** 0.5)
        if tokens_per_side ** 2 != config.mm_tokens_per_image or self.patches_per_side % tokens_per_side:
            raise ValueError(f"mm_tokens_per_image={config.mm_tokens_per_image} must be a square whose side divides "
                             f"the tower's {self.patches_per_side} patches per side")
        self.kernel = self.patches_per_side // tokens_per_side
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision.hidden_size, text.hidden_size))
        self.mm_soft_emb_norm = Gemma3RMSNorm(vision.hidden_size, vision.layer_norm_eps)

    def forward(self, patches: Tensor) -> Tensor:
        """[N, patches, vision hidden] -> [N, mm_tokens_per_image, text hidden]."""
        batch, _, size = patches.shape
        grid = patches.transpose(1, 2).reshape(batch, size, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.kernel).flatten(2).transpose(1, 2)
        return (self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight).type_as(patches)


class Gemma3VisionEncoder(nn.Module):
    """pixel_values [N, C, image_size, image_size] -> soft tokens [N, tokens_per_image, text hidden]. Also says
    where they go: the prompt holds image_token_id tokens_per_image times for each image."""

    def __init__(self, config):
        super().__init__()
        self.image_token_id = config.image_token_id
        self.bidirectional_images = True  # an image's soft tokens attend to each other both ways in the decoder
        self.tokens_per_image = config.mm_tokens_per_image
        self.vision_tower = SiglipVisionTransformer(config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)

    @property
    def pixel_shape(self) -> tuple[int, int, int]:
        tower = self.vision_tower
        return (tower.num_channels, tower.image_size, tower.image_size)

    def soft_token_count(self, pixel_values: Tensor | None, grid=None) -> int:
        """Every image's number of soft tokens; ValueError when its pixels are not the tower's shape."""
        if pixel_values is not None and tuple(pixel_values.shape) != self.pixel_shape:
            raise ValueError(f"pixel values of shape {tuple(pixel_values.shape)}; the image encoder takes "
                             f"{self.pixel_shape}")
        return self.tokens_per_image

    def embed_images(self, pixels: list[Tensor], grids=None) -> list[Tensor]:
        """Each image's soft tokens [tokens_per_image, text hidden], the images encoded in one batch."""
        return list(self(torch.stack(pixels)))

    def forward(self, pixel_values: Tensor) -> Tensor:
        return self.multi_modal_projector(self.vision_tower(pixel_values))


def checkpoint_names() -> NameMap:
    """The encoder's parameters by their checkpoint names, everything else skipped (for models/loader.py)."""
    return NameMap({}, rewrites=CHECKPOINT_REWRITES, skip=CHECKPOINT_SKIPPED)
