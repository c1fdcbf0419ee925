"""Every Triton and Gluon kernel the engine launches compiles for each GPU generation we claim, with the constexprs
and specializations the engine's own launch code gives it there, and fits that GPU's shared memory: a kernel that
cannot lower on a target fails here, not on a customer's GPU. Real compilation (Triton's bundled ptxas), no GPU,
no interpreter: tests/kernels/compile_for_target.py runs once per target in a process of its own, two at a time."""
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kernels import gpu_features

HERE = Path(__file__).resolve().parent
TARGETS = {75: "T4", 80: "A100", 86: "A10G", 89: "L4", 90: "H100", 100: "B200"}
FP8_KERNELS = ("kernels.triton_fp8_gemm._fp8_gemm_kernel",)
HOPPER_KERNELS = ("kernels.triton_linear._descriptor_linear_kernel", "kernels.triton_fp8_gemm._quantize_rows_kernel")
EVERYWHERE = ("kernels.triton_norm._rms_norm_kernel", "kernels.triton_all_reduce_norm._all_reduce_rms_norm_kernel",
              "kernels.triton_linear._linear_kernel",
              "kernels.triton_activation._act_and_mul_kernel", "kernels.triton_sampling._gumbel_argmax_kernel",
              "kernels.triton_sampling._token_bitmask_kernel", "kernels.triton_prologue._prologue_kernel",
              "kernels.triton_attention._prefill_kernel", "kernels.triton_attention._decode_kernel",
              "kernels.triton_moe._select_experts_kernel", "kernels.triton_moe._align_kernel",
              "kernels.triton_moe._route_kernel",
              "kernels.triton_moe._gate_up_kernel", "kernels.triton_moe._down_kernel")


def _compile(target: int, cache_dir: Path) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(cache_dir / str(target)), TRITON_DEFAULT_FP_FUSION="1")
    return subprocess.run([sys.executable, str(HERE / "compile_for_target.py"), str(target)], env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Each target's run, compiled from an empty Triton cache (a cached kernel would not be compiled again)."""
    cache_dir = tmp_path_factory.mktemp("triton-cache")
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = dict(zip(TARGETS, pool.map(lambda target: _compile(target, cache_dir), TARGETS)))
    return runs


@pytest.mark.parametrize("target", TARGETS)
def test_every_launched_kernel_compiles_for_the_target(compiled, target):
    run = compiled[target]
    assert run.returncode == 0, f"sm_{target} ({TARGETS[target]}):\n{run.stderr[-4000:]}"
    summary = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("{")))
    assert summary["gpu"] == TARGETS[target]
    assert summary["shared_memory_over"] == []
    capability = divmod(target, 10)
    expected = set(EVERYWHERE)
    if gpu_features.supported("e4m3", capability):
        expected |= set(FP8_KERNELS)
    if gpu_features.supported("gluon", capability):
        expected.add("kernels.gluon_decode._decode_kernel")
    if gpu_features.supported("descriptors", capability):
        expected |= set(HOPPER_KERNELS)
    assert set(summary["kernels"]) == expected
