"""Programmatic dependent launch (Hopper and later): a kernel may start while the one before it on the stream
is finishing, so the launch and ramp-up of each of a decode step's many small kernels overlap the tail of the
previous one (with kernels/triton_linear.py, a chain of norms and decode-size GEMMs runs faster than with
cuBLAS and plain launches).

The contract, kept by every kernel launched with `launch_options`: `wait_for_previous` comes before its
first read of memory the previous kernel writes and its first write of memory another kernel reads or writes
(it returns once the previous kernel has finished and its writes are visible, and since that kernel had waited
in turn, once all earlier work has), and `release_next`, which lets the next kernel launch, comes after it.
So a kernel starts only once everything before the previous kernel has finished: what that earlier work wrote
(weights, a step's uploaded inputs, a residual or routing from further back) may be read before the wait, and
those reads overlap the previous kernel's tail. Kernels launched without the option (cuBLAS, torch) start
only after the previous kernel ends, as always.
"""
import torch
import triton
import triton.language as tl

from kernels import gpu_features


def launch_options(tensor: torch.Tensor) -> dict:
    """Keyword arguments for a Triton launch on tensor's device: USE_PDL for the kernel, and launch_pdl, where
    the device has dependent launch and HFENDPOINT_GPU_FEATURES leaves it on (kernels/gpu_features.py)."""
    if gpu_features.has("dependent_launch", tensor):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


@triton.jit
def wait_for_previous(USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release_next(USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
