"""The FP8 (e4m3, torch.float8_e4m3fn) KV cache inside the Triton kernels: how a key or value is stored.

A stored element is x / scale (its KV head's scale, IEEE float32 division), saturated to +-448 and rounded to
the nearest e4m3 value, ties to even: what kernels/reference.py's quantize_kv computes with torch, bit for bit.
Reading: an e4m3 value converts exactly to float16 or float32, and the attention kernels fold the scales into the
softmax scale (keys) and the output (values). Compiled for the GPU, values convert by inline PTX (value_operand
says why); the interpreter, which runs no PTX, converts with `.to()`.

The encoding is integer arithmetic on the float32 bits, not `.to(tl.float8e4nv)`: Triton's interpreter, which
CI runs the kernels under, rounds that conversion wrongly (a mantissa that rounds up past 7 does not carry into
the exponent, and ties are not broken to even), while its conversions from e4m3 are exact. Only a step's new
tokens are encoded, so the few integer operations per element cost nothing next to the attention that reads
the cache.
"""
import torch
import triton
import triton.language as tl

from kernels import gpu_features

E4M3_MAX = tl.constexpr(448.0)
E4M3_MIN_NORMAL = tl.constexpr(0.015625)  # 2^-6: below it e4m3 has subnormals, multiples of 2^-9
SUBNORMAL_MAGIC = tl.constexpr(16384.0)  # 2^14, whose float32 spacing is 2^-9: adding it rounds to that step


@triton.jit
def e4m3_quantized(x, scale):
    """x (any float) / scale, saturated and rounded to e4m3 as the module docstring says, as tl.float8e4nv."""
    y = tl.math.div_rn(x.to(tl.float32), scale)
    y = tl.minimum(tl.maximum(y, -E4M3_MAX), E4M3_MAX)
    bits = y.to(tl.uint32, bitcast=True)
    magnitude = tl.abs(y)
    # Normal: round the float32 mantissa to 3 bits (to nearest, ties to even; a carry moves into the exponent),
    # then rebias the exponent from 127 to 7: 120 << 3 in units of the 3-bit mantissa.
    magnitude_bits = magnitude.to(tl.uint32, bitcast=True)
    normal = ((magnitude_bits + 0x7FFFF + ((magnitude_bits >> 20) & 1)) >> 20) - 960
    # Subnormal: float32 addition rounds |y| + 2^14 to a multiple of 2^-9 (ties to even); the difference of the
    # bits counts the multiples, which is the e4m3 code itself (8 = 2^-6 is the smallest normal, code 0x08).
    subnormal = (magnitude + SUBNORMAL_MAGIC).to(tl.uint32, bitcast=True) - 0x46800000
    code = tl.where(magnitude < E4M3_MIN_NORMAL, subnormal, normal) | ((bits >> 24) & 0x80)
    return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def cache_form(x, scale_ptrs, mask, FP8: tl.constexpr):
    """x as its cache stores it: unchanged in a 16-bit cache; with FP8, quantized with its heads' scales (at
    scale_ptrs). A function of its own because Triton refuses a variable whose type changes inside the dynamic
    `if` around the store."""
    if FP8:
        x = e4m3_quantized(x, tl.load(scale_ptrs, mask=mask, other=1.0))
    return x


@triton.jit
def dot_operand(x, FP8: tl.constexpr):
    """x as tl.dot takes it beside the keys and values of its cache: with an FP8 cache, 16-bit floats become
    float16 (e4m3 converts to float16 exactly, two values per instruction; to bfloat16 it takes a detour
    through float32), float32 stays."""
    if FP8:  # noqa: SIM102 - static ifs: triton 3.6 cannot join a constexpr and a dtype test with `and`
        if x.dtype != tl.float32:
            x = x.to(tl.float16)
    return x


def ptx_conversion(tensor: torch.Tensor) -> bool:
    """Whether kernels on tensor's device convert e4m3 values by inline PTX (value_operand): compiled, not
    interpreted, for a GPU with e4m3 conversions (kernels/gpu_features.py)."""
    return gpu_features.has("e4m3", tensor)


@triton.jit
def value_operand(v, dtype, PTX: tl.constexpr):
    """A tile of values [keys, dims] as tl.dot's second operand beside probabilities of dtype. The MMA wants two
    consecutive keys of one dimension per register, so converting e4m3 in that layout reads shared memory a byte at
    a time. With PTX (an e4m3 tile) four values convert per instruction pair from wide reads, and the float16 tile
    reaches the MMA through shared memory. The asm is marked impure: Triton then leaves the conversion where it is
    instead of moving it into the MMA's layout, which is the point."""
    if PTX:
        v = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [v.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)
    return v.to(dtype)
