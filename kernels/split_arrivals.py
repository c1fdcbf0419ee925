"""How many programs fill the GPU, and counters that let the last of several programs finish a result they
each computed part of (split-K partial products, flash-decoding splits), inside the kernel that computed the
parts: no second launch.

Every counter is zero between launches, because the last arrival sets it back; so one buffer serves every
kernel, step and captured CUDA graph on a device. Launches on one stream may overlap (programmatic dependent
launch), but a kernel touches the counters only after the one before it has finished (the contract of
kernels/dependent_launch.py).
"""
import functools

import torch
import triton
import triton.language as tl


@functools.cache
def num_sms(device: torch.device) -> int:
    """The GPU's multiprocessors, which split counts are chosen to fill (4 for the interpreter on a CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


_buffers: dict[torch.device, list[torch.Tensor]] = {}


def arrival_counters(count: int, device: torch.device) -> torch.Tensor:
    """At least `count` int32 counters, zero between launches. A larger request gets a larger buffer; the
    smaller ones stay allocated for the graphs that captured them. A graph's warm-up step allocates what its
    capture then uses."""
    buffers = _buffers.setdefault(device, [])
    if not buffers or buffers[-1].numel() < count:
        buffers.append(torch.zeros(max(count, 4096), dtype=torch.int32, device=device))
    return buffers[-1]


@triton.jit
def is_last_arrival(counter_ptr, count):
    """Counts this program's arrival; True in the one that arrives last of `count`, which sets the counter back
    to zero. The stores this program made before are visible to the last one (the atomic releases them, and
    acquires the others' for the last); it should read them with cache_modifier=".cg" (L2, not this SM's L1)."""
    tl.debug_barrier()  # every thread's stores come before the arrival
    last = tl.atomic_add(counter_ptr, 1, sem="acq_rel") == count - 1
    if last:
        tl.store(counter_ptr, 0)
    return last
