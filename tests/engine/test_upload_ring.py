"""UploadRing: every upload arrives intact, whatever its dtype, shape and size, and however often the ring
wraps around while earlier uploads are still queued."""
import numpy as np
import pytest
import torch

from engine.upload_ring import UploadRing


def test_on_the_cpu_the_array_itself_is_the_tensor():
    array = np.arange(6, dtype=np.int64).reshape(2, 3)
    out = UploadRing(torch.device("cpu")).upload(array)
    assert out.dtype == torch.int64 and out.tolist() == array.tolist()
    array[0, 0] = 7
    assert out[0, 0] == 7  # no copy on the CPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned buffers and device copies need CUDA")
def test_a_slot_is_refilled_only_after_its_copy_ran():
    ring = UploadRing(torch.device("cuda"), slots=2, slot_bytes=4096)
    torch.cuda._sleep(200_000_000)  # about 0.1 s: the copies queue behind it while the ring wraps three times
    arrays = [np.full(16, i, dtype=np.int64) for i in range(6)]
    outs = [ring.upload(array) for array in arrays]
    assert [out.cpu().tolist() for out in outs] == [array.tolist() for array in arrays]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned buffers and device copies need CUDA")
def test_uploads_of_any_dtype_shape_and_size_arrive_intact():
    ring = UploadRing(torch.device("cuda"), slots=3, slot_bytes=64)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((5, 7)).astype(np.float32), rng.integers(0, 2**62, 9), rng.random(4) > 0.5,
              np.empty(0, dtype=np.int64), rng.integers(-5, 5, 1000).astype(np.int32),  # grows a slot
              np.asfortranarray(rng.standard_normal((3, 4))), *(rng.integers(0, 100, 16) for _ in range(7))]
    outs = [ring.upload(array) for array in arrays]
    for array, out in zip(arrays, outs):
        assert out.device.type == "cuda" and out.shape == array.shape
        assert np.array_equal(out.cpu().numpy(), array)
