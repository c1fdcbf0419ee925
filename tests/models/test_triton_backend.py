"""The decoder driven through the Triton kernels (interpreted on the CPU) still matches transformers.

TRITON_INTERPRET must be set before triton is imported, so the check runs in a fresh interpreter, with
kernels' CUDA backend forced onto CPU tensors.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # whole decoders through interpreted Triton kernels

pytest.importorskip("triton")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

CHECK = textwrap.dedent(
    """
    import sys, tempfile, torch
    import kernels
    triton_backend = kernels._backend("cuda")
    kernels._backend = lambda device_type: triton_backend
    from decoder_testing import assert_paged_steps_match, save_tiny_model
    from models.registry import load_model

    path = tempfile.mkdtemp()
    reference = save_tiny_model(sys.argv[1], path)
    assert_paged_steps_match(load_model(path, torch.float32, torch.device("cpu")).model, reference)
    """
)


@pytest.mark.parametrize("family", ["llama-gqa", "qwen3", "mistral-window", "phi3-longrope", "gemma3"])
def test_decoder_through_triton_kernels_matches_transformers(family):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(HERE), ROOT])}
    result = subprocess.run([sys.executable, "-c", CHECK, family], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
