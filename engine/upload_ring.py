"""Small host arrays to the device through pinned buffers allocated once.

`tensor.pin_memory().to(device, non_blocking=True)` asks torch's caching host allocator for page-locked
memory on every call, and allocates more (cudaHostAlloc) whenever it has no free block of the size asked for
(a new batch size, or its blocks still in flight). With the sampler uploading that way the host stalled at
batch changes, each stall delaying the step the engine launches ahead of the one running; with this ring it
does not. The ring cycles through a few pinned
buffers; a buffer is refilled only once the copy from it has finished, which with several buffers in the
ring happened steps ago.
"""
import numpy as np
import torch
from torch import Tensor

SLOTS = 8
SLOT_BYTES = 1 << 16  # a slot grows (once) for a larger array


class UploadRing:
    def __init__(self, device: torch.device, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES):
        self.device = device
        self.on_cuda = device.type == "cuda"
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(slots)] \
            if self.on_cuda else []
        self.copied = [torch.cuda.Event() for _ in self.slots]
        self.next_slot = 0

    def upload(self, array: np.ndarray) -> Tensor:
        """A device copy of array, whose copy has been queued on the current stream (on the CPU: the array
        itself as a tensor)."""
        if not self.on_cuda:
            return torch.from_numpy(array)
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        index = self.next_slot
        self.next_slot = (index + 1) % len(self.slots)
        self.copied[index].synchronize()
        if tensor.nbytes > self.slots[index].numel():
            self.slots[index] = torch.empty(tensor.nbytes, dtype=torch.uint8, pin_memory=True)
        staged = self.slots[index][:tensor.nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        out = staged.to(self.device, non_blocking=True)
        self.copied[index].record()
        return out
