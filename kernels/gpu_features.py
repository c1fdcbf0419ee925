"""Which GPU features the kernels and the engine may use, decided here and nowhere else.

Each feature is chosen by the device's compute capability (MIN_CAPABILITY) and may be turned off for the whole
process (HFENDPOINT_GPU_FEATURES, parsed by `parse`, read once by engine/config.py and applied with `configure`
before the model loads), so that a newer GPU runs the paths an older one takes and they can be measured there:

- descriptors: tensor descriptors (TMA copies) in kernels/triton_linear.py's GEMM above its pointer rows;
  without them those rows go to cuBLAS, which beat pointer loads there.
- dependent_launch: programmatic dependent launch (kernels/dependent_launch.py); without it, plain launches.
- gluon: the Gluon decode attention over an FP8 cache (kernels/gluon_decode.py); without it, the Triton kernel.
- scaled_mm: torch._scaled_mm for FP8 weights (models/fp8.py); without it, our Triton FP8 GEMM.
- e4m3: e4m3 conversions in hardware: FP8 weights stay FP8 (our Triton FP8 GEMM), the FP8 KV cache, and the
  attention kernels' PTX conversions; without it FP8 weights are dequantized and an FP8 KV cache is refused.
- bfloat16: bfloat16 arithmetic; without it HFENDPOINT_DTYPE=auto means float16 and bfloat16 is refused.
- mxfp4: MXFP4 experts read packed (tl.dot_scaled in kernels/triton_moe.py), which Triton lowers from Ampere on;
  without it a model with MXFP4 experts is refused at load (dequantized, they would not fit such a GPU).

The interpreter (TRITON_INTERPRET=1, which CI runs the kernels under on CPU tensors) runs no PTX or dependent
launch but does read tensor descriptors (INTERPRETED): `has` answers for it so. Engine-level choices (dtype,
FP8 weights and cache) read `device_supports` for a device instead.
"""
import functools
import os

import torch

MIN_CAPABILITY = {
    "descriptors": (9, 0),
    "dependent_launch": (9, 0),
    "gluon": (8, 9),
    "scaled_mm": (9, 0),
    "e4m3": (8, 9),
    "bfloat16": (8, 0),
    "mxfp4": (8, 0),
}
FEATURES = tuple(MIN_CAPABILITY)
KERNEL_FEATURES = ("descriptors", "dependent_launch", "gluon", "e4m3")  # what kernels/ asks per launch
INTERPRETED = ("descriptors",)  # the kernel features Triton's interpreter runs too
PORTABLE = ("descriptors", "dependent_launch", "gluon", "scaled_mm")  # Hopper's own: what an L4 or L40S lacks
SPEC_HELP = ("a comma list of: auto (every feature the GPU has), portable (no " + ", ".join(PORTABLE) +
             "), or no-FEATURE to turn one off, FEATURE one of " + ", ".join(FEATURES))

_disabled: frozenset[str] = frozenset()


def parse(spec: str) -> frozenset[str]:
    """The features HFENDPOINT_GPU_FEATURES turns off; ValueError saying what is allowed for anything else.
    Words are case-insensitive, `-` and `_` alike: "auto", "portable", "portable,no-e4m3", "no-descriptors"."""
    disabled = set()
    for raw in spec.split(","):
        word = raw.strip().lower().replace("_", "-")
        feature = word.removeprefix("no-").replace("-", "_")
        if word in ("auto", ""):
            continue
        if word == "portable":
            disabled.update(PORTABLE)
        elif word.startswith("no-") and feature in MIN_CAPABILITY:
            disabled.add(feature)
        else:
            raise ValueError(f"unknown word {raw.strip()!r}: expected {SPEC_HELP}")
    return frozenset(disabled)


def configure(disabled: frozenset[str]) -> None:
    """Turn off `disabled` (from parse) for every later launch in this process."""
    global _disabled
    unknown = set(disabled) - set(FEATURES)
    if unknown:
        raise ValueError(f"unknown GPU features {sorted(unknown)}: expected some of {', '.join(FEATURES)}")
    _disabled = frozenset(disabled)
    _enabled.cache_clear()


def disabled() -> frozenset[str]:
    return _disabled


def supported(feature: str, capability: tuple[int, int], off: frozenset[str] = frozenset()) -> bool:
    """Whether a GPU of compute capability `capability` runs `feature` with the features in `off` turned off."""
    return feature not in off and tuple(capability) >= MIN_CAPABILITY[feature]


def device_supports(feature: str, device: torch.device, off: frozenset[str] | None = None) -> bool:
    """supported() for a device (False off CUDA), with this process's disabled features unless `off` is given."""
    if device.type != "cuda":
        return False
    return supported(feature, torch.cuda.get_device_capability(device), _disabled if off is None else off)


def has(feature: str, tensor: torch.Tensor) -> bool:
    """Whether a kernel launched on tensor's device may use `feature` (one of KERNEL_FEATURES). Read per launch:
    a device index (-1 on the CPU, where only the interpreter runs kernels), no device object."""
    return _enabled(feature, tensor.get_device())


@functools.cache
def _enabled(feature: str, device_index: int) -> bool:
    if device_index < 0 or os.environ.get("TRITON_INTERPRET") == "1":
        return feature in INTERPRETED and feature not in _disabled
    return supported(feature, torch.cuda.get_device_capability(device_index), _disabled)
