"""Helpers for the tensor-parallel tests."""
import torch


def prompts(lengths, seed=1, vocab=320) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie nobody has reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
