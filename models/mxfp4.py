"""MXFP4 weights (the OCP microscaling format gpt-oss ships its experts in), dequantized at load.

Each run of 32 consecutive values along a row shares one scale, an E8M0 byte s meaning 2^(s - 127); each value
is a 4-bit E2M1 code (sign bit, then 0, 0.5, 1, 1.5, 2, 3, 4 or 6), two codes to a byte, the low nibble first.
A checkpoint stores a weight [..., K] as `<name>_blocks` [..., K / 32, 16] uint8 and `<name>_scales`
[..., K / 32] uint8.
"""
import torch
from torch import Tensor

GROUP_SIZE = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> values [..., G * 32] in dtype (on blocks' device)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != GROUP_SIZE // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)}: expected "
                         f"blocks [..., G, {GROUP_SIZE // 2}] with scales [..., G]")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # [..., G, 32], low nibble first
    exponents = scales.to(device=blocks.device, dtype=torch.float32) - SCALE_BIAS
    return (table[codes] * torch.exp2(exponents).unsqueeze(-1)).flatten(-2).to(dtype)
