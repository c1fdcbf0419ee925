"""Tests of the GPU-feature choices on a CPU: make kernels/gpu_features.py answer as a CUDA GPU of a given compute
capability would, for CPU tensors and devices too, so every dispatch site can be checked without the GPU."""
import torch

from kernels import gpu_features


def pretend_capability(monkeypatch, capability: tuple[int, int], disabled: frozenset[str] = frozenset()) -> None:
    """Until the test ends, every device is a GPU of `capability` with `disabled` turned off (as
    HFENDPOINT_GPU_FEATURES would)."""
    monkeypatch.setattr(gpu_features, "_disabled", frozenset(disabled))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(gpu_features, "has",
                        lambda feature, tensor: gpu_features.supported(feature, capability, gpu_features.disabled()))
    monkeypatch.setattr(gpu_features, "device_supports", lambda feature, device, off=None: gpu_features.supported(
        feature, capability, gpu_features.disabled() if off is None else off))
