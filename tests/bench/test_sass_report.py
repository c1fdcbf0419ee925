"""bench/sass_report.py compiles the decode kernel for sm_90 without a GPU and reads its SASS: on CI's Triton too, so
that the tool a kernel change is first read with keeps working."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import gluon_decode
from kernels.triton_attention import FP8_DECODE_TILES

ROOT = Path(__file__).resolve().parents[2]


BF16_SPLIT = ["--cache-dtype", "bf16", "--tiles", "64,4,2,256,128", "--split"]


@pytest.mark.slow
@pytest.mark.parametrize("args,registers", [([], FP8_DECODE_TILES.max_registers),
                                             (["--split"], FP8_DECODE_TILES.split_max_registers), (BF16_SPLIT, 128)])
def test_the_report_reads_the_compiled_decode_loop(args, registers):
    pytest.importorskip("triton")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}  # it compiles, not interprets
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "bench/sass_report.py", *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    used = int(re.search(r"registers (\d+)", out)[1])
    assert 0 < used <= registers
    assert re.search(r"main loop: \d+ instructions", out)
    # Each tile of 64 keys: 16 rows of queries times 64 keys times 128 dims, then 16 x 128 x 64, in m16n8k16 MMAs
    # shared by 4 warps: 16 + 16 per thread.
    assert int(re.search(r"HMMA +(\d+)", out)[1]) == 32


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["2", f"4,{gluon_decode.FOUR_WARP_MAX_REGISTERS}"])  # decode_attention's
def test_the_gluon_kernel_folds_a_page_per_warp_in_mmas_without_barriers(launch):
    """kernels/gluon_decode.py, which the interpreter cannot run, compiled by CI's Triton: a page of 16 keys per warp
    is S^T = K Q^T over 128 dimensions (8 m16n8k16) and O^T = V^T P^T over 128 rows (8 more), P^T two 8x8 blocks
    transposed across the warp; keys and values never go through shared memory, so the loop has no barrier."""
    pytest.importorskip("triton")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "bench/sass_report.py", "--gluon", launch], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert 0 < int(re.search(r"registers (\d+)", out)[1]) <= 168  # at least 2 programs of 4 warps per SM
    assert re.search(r"stack \(spills\) 0 bytes", out)
    ops = dict((op, int(count)) for op, count in re.findall(r"^  (\w+) +(\d+)$", out, re.MULTILINE))
    assert ops.get("HMMA") == 16 and ops.get("MOVM") == 2
    assert not {"BAR", "LDS", "STS", "LDSM"} & set(ops)
