"""MXFP4 weights (the OCP microscaling format gpt-oss ships its experts in), kept packed on the device.

Each run of 32 consecutive values along a row shares one scale, an E8M0 byte s meaning 2^(s - 127); each value
is a 4-bit E2M1 code (sign bit, then 0, 0.5, 1, 1.5, 2, 3, 4 or 6), two codes to a byte, the low nibble first.
A checkpoint stores a weight [..., K] as `<name>_blocks` [..., K / 32, 16] uint8 and `<name>_scales`
[..., K / 32] uint8; we keep the blocks with their groups flattened, [..., K / 2].

The fused MoE (kernels/triton_moe.py) reads the packed bytes and scales and dequantizes in registers; the torch
reference dequantizes a whole weight first.
"""
from dataclasses import dataclass

import torch
from torch import Tensor

GROUP_SIZE = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


@dataclass(frozen=True)
class Mxfp4Weight:
    """A stacked weight [E, N, K] in MXFP4: blocks [E, N, K / 2] uint8 (two codes a byte) and scales
    [E, N, K / 32] uint8."""
    blocks: Tensor
    scales: Tensor

    def __post_init__(self):
        check_mxfp4(self.blocks, self.scales)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the values it encodes."""
        return (*self.blocks.shape[:-1], 2 * self.blocks.shape[-1])

    def is_contiguous(self) -> bool:
        return self.blocks.is_contiguous() and self.scales.is_contiguous()

    def dequantize(self, dtype: torch.dtype) -> Tensor:
        return dequantize_mxfp4(self.blocks, self.scales, dtype)


def check_mxfp4(blocks: Tensor, scales: Tensor) -> None:
    """ValueError unless blocks [..., K / 2] and scales [..., K / 32] are uint8 and fit each other."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape[:-1] or blocks.shape[-1] != scales.shape[-1] * GROUP_SIZE // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)}: expected "
                         f"blocks [..., K / 2] with scales [..., K / {GROUP_SIZE}]")


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """blocks [..., K / 2] uint8 and scales [..., K / 32] uint8 -> values [..., K] in dtype (on blocks' device)."""
    check_mxfp4(blocks, scales)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # low nibble first
    values = table[codes].unflatten(-1, (-1, GROUP_SIZE))
    exponents = scales.to(device=blocks.device, dtype=torch.float32) - SCALE_BIAS
    return (values * torch.exp2(exponents).unsqueeze(-1)).flatten(-2).to(dtype)
