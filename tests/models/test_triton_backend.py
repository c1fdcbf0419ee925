"""The decoder driven through the Triton kernels (interpreted on the CPU) still matches transformers.

TRITON_INTERPRET must be set before triton is imported, so the check runs in a fresh interpreter, with
kernels' CUDA backend forced onto CPU tensors.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

CHECK = textwrap.dedent(
    """
    import sys, tempfile, torch
    import kernels
    triton_backend = kernels._backend("cuda")
    kernels._backend = lambda device_type: triton_backend
    from decoder_testing import attach_kv_cache, paged_step, save_tiny_model, varlen_metadata
    from models.registry import load_model

    name = sys.argv[1]
    path = tempfile.mkdtemp()
    reference = save_tiny_model(name, path)
    model = load_model(path, torch.float32, torch.device("cpu")).model
    attach_kv_cache(model, num_blocks=16, block_size=4)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 320, (n,), generator=generator) for n in (14, 6)]
    tables = [[9, 2, 12, 5], [7, 0]]
    with torch.no_grad():
        expected = [reference(p[None]).logits[0] for p in prompts]
        hidden = model(prompts[0], torch.arange(14), varlen_metadata([14]))
        torch.testing.assert_close(model.compute_logits(hidden), expected[0], atol=1e-4, rtol=1e-4)
        for chunks in ([(0, 5)], [(5, 6), (0, 5)], [(11, 1), (5, 1)], [(12, 2)]):
            meta, positions = paged_step(chunks, tables[: len(chunks)], 4)
            ids = torch.cat([prompts[b][c : c + n] for b, (c, n) in enumerate(chunks)])
            want = torch.cat([expected[b][c : c + n] for b, (c, n) in enumerate(chunks)])
            torch.testing.assert_close(model.compute_logits(model(ids, positions, meta)), want, atol=1e-4, rtol=1e-4)
    """
)


@pytest.mark.parametrize("family", ["llama-gqa", "qwen3", "phi3-longrope", "gemma3"])
def test_decoder_through_triton_kernels_matches_transformers(family):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(HERE), ROOT])}
    result = subprocess.run([sys.executable, "-c", CHECK, family], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
