"""kernels/gpu_features.py decides every Hopper-only path, and HFENDPOINT_GPU_FEATURES turns them off: each
dispatch site takes its portable path where the GPU lacks a feature or the switch turns it off (checked on the CPU
by pretending a compute capability: tests/gpu_capability.py)."""
from types import SimpleNamespace

import pytest
import torch
from gpu_capability import pretend_capability

from kernels import gpu_features, triton_attention, triton_fp8, triton_linear
from kernels.dependent_launch import launch_options
from models.fp8 import Fp8Format, fp8_gemm_for

HOPPER, ADA, AMPERE, TURING = (9, 0), (8, 9), (8, 6), (7, 5)
PORTABLE = frozenset(gpu_features.PORTABLE)


def test_the_switch_reads_auto_portable_and_single_features():
    assert gpu_features.parse("auto") == gpu_features.parse("") == frozenset()
    assert gpu_features.parse("portable") == PORTABLE
    assert gpu_features.parse("Portable, no-e4m3") == PORTABLE | {"e4m3"}
    assert gpu_features.parse("no-dependent-launch,no_scaled_mm") == {"dependent_launch", "scaled_mm"}
    with pytest.raises(ValueError, match="unknown word 'no-tma'.*no-FEATURE"):
        gpu_features.parse("no-tma")


def test_configure_turns_features_off_for_later_launches():
    """The process-wide set, as the engine applies it before loading: the interpreter's descriptors go with it."""
    before = gpu_features.disabled()
    x = torch.empty(2, 2)
    gpu_features.configure(frozenset())
    try:
        assert gpu_features.has("descriptors", x)
        gpu_features.configure(frozenset({"descriptors"}))
        assert not gpu_features.has("descriptors", x)
    finally:
        gpu_features.configure(before)
    with pytest.raises(ValueError, match="unknown GPU features"):
        gpu_features.configure(frozenset({"tma"}))


@pytest.mark.parametrize("capability,disabled,expected", [
    (HOPPER, frozenset(), {"USE_PDL": True, "launch_pdl": True}),
    (HOPPER, PORTABLE, {"USE_PDL": False}),
    (ADA, frozenset(), {"USE_PDL": False}),
])
def test_dependent_launch_only_where_the_gpu_has_it_and_the_switch_allows(monkeypatch, capability, disabled,
                                                                          expected):
    pretend_capability(monkeypatch, capability, disabled)
    assert launch_options(torch.empty(1)) == expected


@pytest.mark.parametrize("capability,disabled,descriptors", [
    (HOPPER, frozenset(), True), (HOPPER, PORTABLE, False), (ADA, frozenset(), False), (TURING, frozenset(), False),
])
def test_rows_past_the_pointer_tiles_take_descriptors_or_cublas(monkeypatch, capability, disabled, descriptors):
    """Above POINTER_ROWS the GEMM reads through tensor descriptors; without them those rows go to cuBLAS (None),
    and the pointer rows below keep the Triton kernel everywhere."""
    pretend_capability(monkeypatch, capability, disabled)
    weight = torch.empty(256, 256)
    config = triton_linear._decode_config(torch.empty(triton_linear.POINTER_ROWS + 1, 256), weight)
    assert (config is not None and config[6]) if descriptors else config is None
    assert triton_linear._decode_config(torch.empty(triton_linear.POINTER_ROWS, 256), weight)[6] is False


@pytest.mark.parametrize("capability,disabled,gluon", [
    (HOPPER, frozenset(), True), (ADA, frozenset(), True), (HOPPER, PORTABLE, False),
    (HOPPER, frozenset({"gluon"}), False), (AMPERE, frozenset(), False),
])
def test_large_fp8_decode_batches_take_gluon_only_where_allowed(monkeypatch, capability, disabled, gluon):
    pretend_capability(monkeypatch, capability, disabled)
    k_cache = torch.empty(8, 16, 2, 128, dtype=torch.float8_e4m3fn)
    num_seqs = triton_attention.UNSPLIT_PROGRAMS_PER_SM * triton_attention.num_sms(k_cache.device)
    assert triton_attention._gluon_takes(torch.bfloat16, 4, 128, k_cache, num_seqs, 0, None) is gluon


@pytest.mark.parametrize("capability,disabled,ptx", [
    (ADA, frozenset(), True), (HOPPER, PORTABLE, True), (HOPPER, frozenset({"e4m3"}), False), (AMPERE, frozenset(),
                                                                                                False),
])
def test_e4m3_values_convert_by_ptx_only_with_e4m3_conversions(monkeypatch, capability, disabled, ptx):
    pretend_capability(monkeypatch, capability, disabled)
    assert triton_fp8.ptx_conversion(torch.empty(1)) is ptx


@pytest.mark.parametrize("capability,disabled,method", [
    (HOPPER, frozenset(), "scaled_mm"), (HOPPER, PORTABLE, "triton"), (ADA, frozenset(), "triton"),
    (HOPPER, frozenset({"e4m3"}), None), (AMPERE, frozenset(), None),
])
def test_fp8_weights_take_scaled_mm_triton_or_are_dequantized(monkeypatch, capability, disabled, method):
    """torch._scaled_mm on Hopper, our Triton FP8 GEMM with e4m3 conversions but without it, dequantized weights
    (None) below."""
    pretend_capability(monkeypatch, capability, disabled)
    layer = SimpleNamespace(quant=Fp8Format(None, (), "scaled_mm"), weight=torch.empty(32, 32), dtype=torch.bfloat16)
    assert fp8_gemm_for(layer, torch.device("cpu")) == method
