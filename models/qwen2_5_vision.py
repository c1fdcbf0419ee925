"""Qwen2.5-VL's image encoder: its vision transformer and patch merger, from the processor's flattened patches to
the soft tokens the decoder reads in place of the image pad tokens.

The processor (transformers' Qwen2-VL image processor) resizes an image to a multiple of patch_size x
spatial_merge_size within its min and max pixels and flattens it into a grid (t, h, w) of patches, each row
C x temporal_patch_size x patch_size x patch_size values, ordered so that the spatial_merge_size x
spatial_merge_size patches of one merged token are consecutive. The patch embedding is a convolution whose
kernel equals its stride, so over those rows it is one matrix product. Each block rotates q and k by the patch's
(row, column) in the grid (2D rotary: the first half of the rotary frequencies by row, the second by column),
and attends within windows of window_size pixels (whole merged tokens, windows in row-major order) except the
blocks that fullatt_block_indexes names, which attend over the whole image (each frame of it). Attention is
scaled_dot_product_attention over segments that never cross an image, so images encoded together never see each
other. The merger normalises each patch, concatenates the patches of a merged token and projects them to the
decoder's width. Module names follow transformers' Qwen2_5_VisionTransformerPretrainedModel.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.llama import RMSNorm
from models.loader import NameMap

VISION_NORM_EPS = 1e-6  # transformers' Qwen2.5-VL vision norms (not in the config)
# The tower's tensors in a checkpoint, under model.visual. (transformers 5) or visual. (the hub's transformers 4
# layout); the decoder's are not ours.
CHECKPOINT_REWRITES = ((r"^(model\.)?visual\.", "tower."),)
CHECKPOINT_SKIPPED = r"^(?!tower\.)"


def rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def segment_attention(q: Tensor, k: Tensor, v: Tensor, bounds: list[int]) -> Tensor:
    """Bidirectional attention within each segment [bounds[i], bounds[i + 1]) of the rows of q, k, v [N, heads,
    D], in one SDPA call: the segments padded to the longest, padded keys masked."""
    starts = torch.tensor(bounds[:-1], device=q.device)
    lengths = torch.tensor(bounds[1:], device=q.device) - starts
    keep = lengths > 0
    starts, lengths = starts[keep], lengths[keep]
    offsets = torch.arange(int(lengths.max()), device=q.device)
    valid = offsets < lengths[:, None]
    rows = torch.where(valid, starts[:, None] + offsets, 0)

    def padded(x: Tensor) -> Tensor:  # [segments, heads, longest, D]
        return x[rows].transpose(1, 2)

    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=valid[:, None, None, :])
    return out.transpose(1, 2)[valid]


class VisionAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_heads
        if config.hidden_size % self.num_heads:
            raise ValueError(f"vision hidden_size {config.hidden_size} is not a multiple of num_heads {self.num_heads}")
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, bounds: list[int]) -> Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, -1).unbind(1)
        q, k = ((t.float() * cos + rotate_half(t.float()) * sin).to(x.dtype) for t in (q, k))
        return self.proj(segment_attention(q, k, v, bounds).reshape(x.shape))


class VisionMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"vision hidden_act {config.hidden_act!r} is not supported (supported: silu)")
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, VISION_NORM_EPS)
        self.norm2 = RMSNorm(config.hidden_size, VISION_NORM_EPS)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, bounds: list[int]) -> Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, bounds)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, config):
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(config.hidden_size, config.in_channels, *kernel))

    def forward(self, patches: Tensor) -> Tensor:
        return F.linear(patches.to(self.proj.weight.dtype), self.proj.weight.flatten(1))


class PatchMerger(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.merged_size = config.hidden_size * config.spatial_merge_size ** 2
        self.ln_q = RMSNorm(config.hidden_size, VISION_NORM_EPS)
        self.mlp = nn.Sequential(nn.Linear(self.merged_size, self.merged_size), nn.GELU(),
                                 nn.Linear(self.merged_size, config.out_hidden_size))

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_size))


class GridLayout:
    """Where the patches of images with grids (t, h, w) sit: each patch's (row, column), the order that makes every
    attention window contiguous, and the segments of the windowed and of the full-attention blocks in that
    order."""

    def __init__(self, grids: list[tuple[int, int, int]], merge: int, window: int):
        rows, columns, order, windows, frames = [], [], [], [0], [0]
        unit = merge * merge
        first = 0
        for t, h, w in grids:
            merged_h, merged_w = h // merge, w // merge
            unit_row = torch.arange(merged_h).repeat_interleave(merged_w).repeat(t)
            unit_column = torch.arange(merged_w).repeat(merged_h * t)
            frame = torch.arange(t).repeat_interleave(merged_h * merged_w)
            inner_row, inner_column = torch.arange(merge).repeat_interleave(merge), torch.arange(merge).repeat(merge)
            rows.append((unit_row[:, None] * merge + inner_row).flatten())
            columns.append((unit_column[:, None] * merge + inner_column).flatten())
            across = -(-merged_w // window)
            window_id = (frame * -(-merged_h // window) + unit_row // window) * across + unit_column // window
            units = torch.argsort(window_id, stable=True)
            order.append(((units[:, None] * unit + torch.arange(unit)).flatten()) + first)
            sizes = torch.bincount(window_id) * unit
            windows.extend((windows[-1] + sizes[sizes > 0].cumsum(0)).tolist())
            frames.extend((frames[-1] + h * w * torch.arange(1, t + 1)).tolist())
            first += t * h * w
        self.rows, self.columns = torch.cat(rows), torch.cat(columns)
        self.order = torch.cat(order)
        self.window_bounds, self.image_bounds = windows, frames


class Qwen2_5VisionTransformer(nn.Module):
    """Patches [N, C * temporal_patch_size * patch_size^2] of images with grids (t, h, w) -> their soft tokens
    [N / spatial_merge_size^2, out_hidden_size], image after image."""

    def __init__(self, config):
        super().__init__()
        self.merge = config.spatial_merge_size
        if config.window_size % (config.patch_size * self.merge):
            raise ValueError(f"vision window_size {config.window_size} is not a multiple of patch_size x "
                             f"spatial_merge_size ({config.patch_size * self.merge})")
        self.window = config.window_size // config.patch_size // self.merge  # in merged tokens per side
        self.full_attention_blocks = frozenset(config.fullatt_block_indexes)
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)
        head_dim = config.hidden_size // config.num_heads
        if head_dim % 4:
            raise ValueError(f"a vision head of {head_dim} dimensions: 2D rotary needs a multiple of 4")
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        spatial = head_dim // 2
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial),
                             persistent=False)

    def rotary(self, layout: GridLayout, device: torch.device) -> tuple[Tensor, Tensor]:
        """cos and sin [N, 1, head_dim] of each patch, rows by its grid row, then columns by its column."""
        angles = torch.cat((layout.rows[:, None] * self.inv_freq.cpu(), layout.columns[:, None] * self.inv_freq.cpu()),
                           dim=-1)
        angles = torch.cat((angles, angles), dim=-1)[:, None].to(device)
        return angles.cos(), angles.sin()

    def forward(self, patches: Tensor, grids: list[tuple[int, int, int]]) -> Tensor:
        layout = GridLayout(grids, self.merge, self.window)
        order = layout.order.to(patches.device)
        x = self.patch_embed(patches)[order]
        cos, sin = (part[order] for part in self.rotary(layout, patches.device))
        # full attention over each frame, in window order too: windows never cross frames
        for i, block in enumerate(self.blocks):
            bounds = layout.image_bounds if i in self.full_attention_blocks else layout.window_bounds
            x = block(x, cos, sin, bounds)
        return self.merger(x[torch.argsort(order)])


class Qwen2_5VisionEncoder(nn.Module):
    """Qwen2.5-VL's image encoder as the engine uses it (engine/images.py): the prompt holds image_token_id once
    per merged token of each image, and an image's soft tokens take M-RoPE positions from its grid."""

    def __init__(self, config):
        super().__init__()
        vision = config.vision_config
        self.image_token_id = config.image_token_id
        self.bidirectional_images = False  # the decoder attends causally over image tokens too
        self.spatial_merge_size = vision.spatial_merge_size
        self.patch_values = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
        self.tower = Qwen2_5VisionTransformer(vision)

    def soft_token_count(self, pixel_values: Tensor | None, grid: tuple[int, int, int] | None) -> int:
        """The image's number of soft tokens; ValueError when its grid or patches do not fit the encoder."""
        if grid is None or len(grid) != 3 or min(grid) < 1 or grid[1] % self.spatial_merge_size or \
                grid[2] % self.spatial_merge_size:
            raise ValueError(f"an image needs its patch grid (t, h, w), h and w multiples of "
                             f"{self.spatial_merge_size} (the processor's image_grid_thw), got {grid}")
        patches = math.prod(grid)
        if pixel_values is not None and tuple(pixel_values.shape) != (patches, self.patch_values):
            raise ValueError(f"pixel values of shape {tuple(pixel_values.shape)}; the image encoder takes "
                             f"{(patches, self.patch_values)} for a grid of {grid}")
        return patches // self.spatial_merge_size ** 2

    def embed_images(self, pixels: list[Tensor], grids: list[tuple[int, int, int]]) -> list[Tensor]:
        """Each image's soft tokens [count, text hidden], the images encoded in one batch."""
        tokens = self.tower(torch.cat(pixels), grids)
        return list(tokens.split([math.prod(grid) // self.spatial_merge_size ** 2 for grid in grids]))


def checkpoint_names() -> NameMap:
    """The encoder's parameters by their checkpoint names, everything else skipped (for models/loader.py)."""
    return NameMap({}, rewrites=CHECKPOINT_REWRITES, skip=CHECKPOINT_SKIPPED)
