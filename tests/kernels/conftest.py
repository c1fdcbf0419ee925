"""Kernel tests run the Triton kernels on CUDA when present, else on CPU under Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET before anything imports triton)."""
import pytest
import torch

pytest.importorskip("triton")


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Make every floating torch.empty / empty_like come back full of NaN, so unwritten outputs fail."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(tensor):
        if tensor.is_floating_point():
            tensor.fill_(float("nan"))
        return tensor

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(empty_like(*a, **kw)))


@pytest.fixture(autouse=True)
def release_gpu_memory():
    """On CUDA, give each test's cached blocks back, so that parallel test workers sharing the GPU do not run
    it out of memory with blocks they no longer use."""
    yield
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
