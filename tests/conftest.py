"""Without a GPU the Triton kernels run under Triton's interpreter. The flag must be set before anything
imports triton (transformers and sentence-transformers do), so it is set here, before any test module loads."""
import os
import shutil

if shutil.which("nvidia-smi") is None and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"

if os.environ.get("HFENDPOINT_GPU_FEATURES"):
    # On a GPU the kernel tests then run the paths the variable leaves (portable: the pre-Hopper ones on Hopper),
    # as the engine applies it at start (engine.LLM takes its own gpu_features, auto unless told).
    from kernels import gpu_features

    gpu_features.configure(gpu_features.parse(os.environ["HFENDPOINT_GPU_FEATURES"]))

import gc  # after the flag above: torch may import triton

import pytest
import torch

CUDA_TEST_KV_BLOCKS = 1024


@pytest.fixture(autouse=True, scope="session")
def engines_share_the_gpu():
    """On CUDA an engine sizes its KV cache to gpu_memory_utilization of the whole GPU, counting what other
    engines hold as used, so the second of two engines (or of two test workers) would get none: on CUDA, tests'
    engines get a fixed pool unless they ask for one. Session-wide, since module fixtures build engines too."""
    if not torch.cuda.is_available():
        yield
        return
    from engine import kv_cache

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kv_cache, "blocks_fitting_gpu", lambda *args: CUDA_TEST_KV_BLOCKS)
        yield


@pytest.fixture(autouse=True)
def collect_dead_engines():
    """Engines of earlier tests, kept alive by reference cycles, are collected after each test (on CUDA)."""
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
