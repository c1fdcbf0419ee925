"""How fast a checkpoint's bytes leave the page cache, and reach the GPU, by each way of reading them: what bounds
the start-up's weights line apart from the engine (its threads, its weight loaders).

    PYTHONPATH=. python3 bench/weight_read.py qwen3-8b        # a bench/models shape: random weights, written once
    PYTHONPATH=. python3 bench/weight_read.py /path/to/model  # a directory of *.safetensors

Each way reads every tensor of every file once, after a first pass that brings the files into the page cache:
- `mmap to host`: safetensors' slices (views of the mapped files, as the loader reads them) copied into a host
  buffer, chunk by chunk: the cost of faulting the mapped pages in.
- `read to host`: the files read() into the same buffer: the page cache's copy speed without faults.
- `mmap to GPU` (CUDA only): each slice copied to a device tensor as the weight loaders do (pageable memory,
  staged by the driver).
- `read to GPU` (CUDA only): the files read() into two pinned chunks in turn, each copied to the device
  asynchronously while the other fills: what a loader that reads files could reach.
The filesystem the files are on is printed first (tmpfs maps its pages one at a time, a disk's page cache maps
several around each fault).
"""
import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from models.loader import safetensors_files

CHUNK_BYTES = 16 << 20


def filesystem_of(path: str) -> str:
    """The type of the filesystem holding path, from the longest mount point above it."""
    path, best, kind = os.path.realpath(path), "", "unknown"
    with open("/proc/self/mounts", encoding="utf-8") as mounts:
        for line in mounts:
            _, mount_point, fs_type = line.split()[:3]
            if os.path.commonpath([path, mount_point]) == mount_point and len(mount_point) > len(best):
                best, kind = mount_point, fs_type
    return f"{kind} (mounted at {best})"


def mapped_tensors(files: list[str]):
    """Each tensor of the files as safetensors' slice hands it to the loader: a view of the mapped file."""
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - a safe_open handle has keys() but cannot be iterated
                yield f.get_slice(name)[:]


def mmap_to_host(files: list[str]) -> int:
    buffer, total = np.empty(CHUNK_BYTES, dtype=np.uint8), 0
    for tensor in mapped_tensors(files):
        source = tensor.reshape(-1).view(torch.uint8).numpy()
        for start in range(0, source.size, CHUNK_BYTES):
            length = min(CHUNK_BYTES, source.size - start)
            np.copyto(buffer[:length], source[start:start + length])
            total += length
    return total


def read_to_host(files: list[str]) -> int:
    buffer, total = memoryview(np.empty(CHUNK_BYTES, dtype=np.uint8)), 0
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while read := f.readinto(buffer):
                total += read
    return total


def mmap_to_gpu(files: list[str]) -> int:
    total = 0
    for tensor in mapped_tensors(files):
        torch.empty_like(tensor, device="cuda").copy_(tensor)
        total += tensor.numel() * tensor.element_size()
    torch.cuda.synchronize()
    return total


def read_to_gpu(files: list[str]) -> int:
    chunks = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    views = [memoryview(chunk.numpy()) for chunk in chunks]
    copied = [torch.cuda.Event() for _ in range(2)]
    target, stream, total, turn = torch.empty(CHUNK_BYTES, dtype=torch.uint8, device="cuda"), torch.cuda.Stream(), 0, 0
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while True:
                copied[turn].synchronize()  # the device has copied what this chunk held before
                read = f.readinto(views[turn])
                if not read:
                    break
                with torch.cuda.stream(stream):
                    target[:read].copy_(chunks[turn][:read], non_blocking=True)
                    copied[turn].record(stream)
                total += read
                turn ^= 1
    torch.cuda.synchronize()
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a bench/models shape (random weights, bench/random_model.py) or a directory")
    args = ap.parse_args()
    if Path(args.model).is_dir():
        model_dir = args.model
    else:
        from random_model import make_random_model

        model_dir = make_random_model(args.model, device="cuda" if torch.cuda.is_available() else "cpu")
    files = safetensors_files(model_dir)
    print(f"{model_dir}: {len(files)} files on {filesystem_of(files[0])}")
    read_to_host(files)  # into the page cache
    ways = {"mmap to host": mmap_to_host, "read to host": read_to_host}
    if torch.cuda.is_available():
        ways |= {"mmap to GPU": mmap_to_gpu, "read to GPU": read_to_gpu}
    for name, way in ways.items():
        started = time.perf_counter()
        total = way(files)
        seconds = time.perf_counter() - started
        print(f"{name:<13} {total / 2**30:6.2f} GiB in {seconds:6.2f} s: {total / seconds / 1e9:6.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
