"""Linear layers and embeddings split across the ranks of a tensor-parallel group (Megatron style).

The group is torch.distributed's default process group (one rank per GPU); without one, every class is the
plain layer (world size 1 is the degenerate case, not a separate code path). With N ranks each rank holds:

- ColumnParallelLinear / MergedColumnParallelLinear: 1/N of the output features (of each merged projection:
  q|k|v split by heads, gate|up); no communication, the output stays split.
- RowParallelLinear: 1/N of the input features; the partial products are summed with one all-reduce.
- VocabParallelEmbedding: a contiguous 1/N of the vocabulary; ids outside it give zeros, one all-reduce.
- ParallelLMHead: the same vocabulary rows; logits are gathered on rank 0 (the rank that samples).

Every parameter carries weight_loader(param, loaded[, index]) copying this rank's part of a checkpoint
tensor. `loaded` is a torch Tensor or a safetensors slice; a slice reads only the rows asked for, so each
rank reads only its own part of the file.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from kernels import linear


def tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def min_over_ranks(value: int) -> int:
    """The smallest of every rank's value (each rank sizes its KV cache from its own free memory; the
    block ids the scheduler hands out must exist on all of them)."""
    if tp_size() == 1:
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {parts}")
    return total // parts


# ---- reading a rank's part of a checkpoint tensor ------------------------------------------------

def shape_of(loaded) -> tuple[int, ...]:
    return tuple(loaded.shape) if isinstance(loaded, Tensor) else tuple(loaded.get_shape())


def read(loaded, dim: int | None = None, start: int = 0, length: int = 0) -> Tensor:
    """Rows start..start+length of `loaded` along dim (all of it when dim is None)."""
    if isinstance(loaded, Tensor):
        return loaded if dim is None else loaded.narrow(dim, start, length)
    index = [slice(None)] * len(loaded.get_shape())
    if dim is not None:
        index[dim] = slice(start, start + length)
    return loaded[tuple(index)]


def check_shape(loaded, expected: tuple[int, ...]) -> None:
    if shape_of(loaded) != tuple(expected):
        raise ValueError(f"has shape {shape_of(loaded)}, the model expects {tuple(expected)}")


def copy_part(destination: Tensor, loaded, dim: int | None, rank: int, size: int) -> None:
    """Copies part `rank` of `size` equal parts of `loaded` along dim into destination (all of it when dim
    is None), after checking the checkpoint tensor's full shape."""
    full = list(destination.shape)
    if dim is not None:
        full[dim] *= size
    check_shape(loaded, tuple(full))
    length = 0 if dim is None else destination.shape[dim]
    destination.copy_(read(loaded, dim, rank * length, length))


def default_weight_loader(param: Tensor, loaded) -> None:
    """Replicated parameters (norms): every rank holds the whole tensor."""
    copy_part(param.data, loaded, None, 0, 1)


# ---- layers -----------------------------------------------------------------------------------------

class ParallelModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()

    def _parameter(self, *shape: int, loader) -> nn.Parameter:
        param = nn.Parameter(torch.empty(*shape))
        param.weight_loader = loader
        return param


class ColumnParallelLinear(ParallelModule):
    """y = x W^T (+ b) for this rank's output features [out_features / N]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        local = divide(out_features, self.tp_size, "the output size")
        self.weight = self._parameter(local, in_features, loader=self.weight_loader)
        self.bias = self._parameter(local, loader=self.weight_loader) if bias else None

    def weight_loader(self, param: Tensor, loaded) -> None:
        copy_part(param.data, loaded, 0, self.tp_rank, self.tp_size)

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several projections of one input in a single matmul (q|k|v, gate|up), each split across ranks, so a
    rank's output is its part of each projection back to back. The checkpoint stores them apart: loading
    passes the projection's index."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = [divide(size, self.tp_size, "a merged projection's output size") for size in output_sizes]

    def weight_loader(self, param: Tensor, loaded, index: int) -> None:
        destination = param.data.narrow(0, sum(self.output_sizes[:index]), self.output_sizes[index])
        copy_part(destination, loaded, 0, self.tp_rank, self.tp_size)


class RowParallelLinear(ParallelModule):
    """y = x W^T (+ b) where x holds this rank's input features [in_features / N]; the partial sums of all
    ranks are added with one all-reduce (the bias once, on rank 0)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        local = divide(in_features, self.tp_size, "the input size")
        self.weight = self._parameter(out_features, local, loader=self.weight_loader)
        self.bias = self._parameter(out_features, loader=default_weight_loader) if bias else None

    def weight_loader(self, param: Tensor, loaded) -> None:
        copy_part(param.data, loaded, 1, self.tp_rank, self.tp_size)

    def forward(self, x: Tensor) -> Tensor:
        y = linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y


class VocabParallelEmbedding(ParallelModule):
    """This rank's contiguous range of ceil(V / N) vocabulary rows (the last range may be short: its
    padding rows are zero and never looked up)."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.rows_per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.num_local = max(0, min(self.rows_per_rank, num_embeddings - self.vocab_start))
        self.weight = self._parameter(self.rows_per_rank, embedding_dim, loader=self.weight_loader)

    def weight_loader(self, param: Tensor, loaded) -> None:
        check_shape(loaded, (self.num_embeddings, self.embedding_dim))
        param.data[:self.num_local].copy_(read(loaded, 0, self.vocab_start, self.num_local))
        param.data[self.num_local:].zero_()

    def forward(self, input_ids: Tensor) -> Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.num_local)
        out = F.embedding(local_ids.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0)
        dist.all_reduce(out)
        return out


class ParallelLMHead(VocabParallelEmbedding):
    """Logits [N, V] from hidden states [N, H]: each rank computes its vocabulary range, rank 0 gathers
    them (only rank 0 samples; the others get None)."""

    def forward(self, hidden: Tensor) -> Tensor | None:
        logits = F.linear(hidden, self.weight)
        if self.tp_size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(logits, parts, dst=0)
        return torch.cat(parts, dim=-1)[:, :self.num_embeddings] if self.tp_rank == 0 else None
