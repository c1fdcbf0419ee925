"""Linear layers and embeddings split across the ranks of a tensor-parallel group (Megatron style).

The group is torch.distributed's default process group (one rank per GPU); without one, every class is the
plain layer (world size 1 is the degenerate case, not a separate code path). With N ranks each rank holds:

- ColumnParallelLinear / MergedColumnParallelLinear: 1/N of the output features (of each merged projection:
  q|k|v split by heads, gate|up); no communication, the output stays split.
- RowParallelLinear: 1/N of the input features; the partial products are summed by the norm that reads them
  (a RankPartial, models/all_reduce.py).
- VocabParallelEmbedding: a contiguous 1/N of the vocabulary; ids outside it give zeros, one all-reduce.
- ParallelLMHead: the same vocabulary rows; logits are gathered on rank 0 (the rank that samples).

Every parameter carries weight_loader(param, loaded[, index]) copying this rank's part of a checkpoint
tensor. `loaded` is a torch Tensor or a safetensors slice; a slice reads only the rows asked for, so each
rank reads only its own part of the file. A merged projection takes its parts one by one (index: which part)
or, from checkpoints that store it fused (Phi-3's qkv_proj and gate_up_proj), all at once (no index).

The linear layers hold FP8 checkpoints as they are (e4m3 weight, float32 `weight_scale` per output row and
K group, see models/fp8.py) until process_weights_after_loading() turns them into what forward() uses.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from kernels import dequantize_fp8, fp8_linear, gated_linear, gelu_tanh_and_mul, linear, silu_and_mul
from models.all_reduce import RankPartial
from models.fp8 import E4M3, Fp8Format, finish_fp8, is_fp8


def tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


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


class RowRange:
    """Rows start..start+length of a safetensors slice, itself read lazily like a slice (one part of a
    checkpoint tensor that fuses several projections)."""

    def __init__(self, loaded, start: int, length: int):
        self.loaded, self.start, self.length = loaded, start, length

    def get_shape(self) -> list[int]:
        return [self.length, *shape_of(self.loaded)[1:]]

    def get_dtype(self) -> str:
        return self.loaded.get_dtype()

    def __getitem__(self, index: tuple) -> Tensor:
        first = index[0] if isinstance(index, tuple) else index
        start, stop = first.start or 0, self.length if first.stop is None else first.stop
        return read(self.loaded, 0, self.start + start, stop - start)[(slice(None), *index[1:])]


def rows_of(loaded, start: int, length: int):
    """Rows start..start+length of a checkpoint tensor or slice, without reading the others."""
    return loaded.narrow(0, start, length) if isinstance(loaded, Tensor) else RowRange(loaded, start, length)


def check_shape(loaded, expected: tuple[int, ...]) -> None:
    if shape_of(loaded) != tuple(expected):
        raise ValueError(f"has shape {shape_of(loaded)}, the model expects {tuple(expected)}")


def check_dtype(destination: Tensor, loaded) -> None:
    """FP8 values go only into FP8 parameters: a cast either way would drop their scales."""
    if is_fp8(loaded) != (destination.dtype == E4M3):
        raise ValueError("is FP8 but the model expects no FP8 weight here" if is_fp8(loaded) else
                         "is not FP8 but the quantization_config says it is (list the layers a checkpoint leaves "
                         "unquantized in modules_to_not_convert or ignore)")


def copy_part(destination: Tensor, loaded, dim: int | None, rank: int, size: int) -> None:
    """Copies part `rank` of `size` equal parts of `loaded` along dim into destination (all of it when dim
    is None), after checking the checkpoint tensor's full shape."""
    full = list(destination.shape)
    if dim is not None:
        full[dim] *= size
    check_shape(loaded, tuple(full))
    check_dtype(destination, loaded)
    length = 0 if dim is None else destination.shape[dim]
    destination.copy_(read(loaded, dim, rank * length, length))


def copy_scale_rows(destination: Tensor, loaded, fmt: Fp8Format, row_start: int, num_rows: int,
                    group_start: int, in_features: int) -> None:
    """Copies an FP8 weight's scales for its rows row_start.. into destination [rows, K groups], one row per
    weight row. The checkpoint weight (or fused part) they scale has num_rows rows and in_features columns,
    with a scale per block of fmt.block, per row, or one in all; group_start: this rank's first K group."""
    shape = shape_of(loaded)
    rows, groups = destination.shape
    if fmt.block:
        block_rows, block_cols = fmt.block
        check_shape(loaded, (-(-num_rows // block_rows), -(-in_features // block_cols)))
        first, last = row_start // block_rows, (row_start + rows - 1) // block_rows
        blocks = read(loaded, 0, first, last - first + 1).float()
        index = (torch.arange(row_start, row_start + rows) // block_rows - first).to(blocks.device)
        destination.copy_(blocks[index, group_start:group_start + groups])
    elif shape in ((), (1,), (1, 1)):
        destination.copy_(read(loaded).float().reshape(1, 1).expand(rows, groups))
    else:
        if shape != (num_rows,):
            check_shape(loaded, (num_rows, 1))
        destination.copy_(read(loaded, 0, row_start, rows).float().reshape(rows, 1).expand(rows, groups))


def default_weight_loader(param: Tensor, loaded) -> None:
    """Replicated parameters (norms): every rank holds the whole tensor."""
    copy_part(param.data, loaded, None, 0, 1)


# ---- layers -----------------------------------------------------------------------------------------

class ParallelModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()

    def _parameter(self, *shape: int, loader, dtype: torch.dtype | None = None) -> nn.Parameter:
        return _with_loader(torch.empty(*shape, dtype=dtype), loader)


def _with_loader(tensor: Tensor, loader) -> nn.Parameter:
    param = nn.Parameter(tensor, requires_grad=False)
    param.weight_loader = loader
    return param


class ParallelLinear(ParallelModule):
    """What the column- and row-parallel layers share: their weight, FP8 with its scales when the checkpoint's
    is (quant), and x W^T (+ b) by the kernel that suits it."""

    def _weights(self, out_features: int, in_features: int, quant: Fp8Format | None) -> None:
        self.dtype = torch.get_default_dtype()  # the model's: dequantized FP8 weights take it
        self.quant, self.fp8_method, self.scale_block = quant, None, None
        self.weight = self._parameter(out_features, in_features, loader=self.weight_loader,
                                      dtype=E4M3 if quant else None)
        self.weight_scale = None
        if quant:
            self.weight_scale = self._parameter(out_features, quant.groups(in_features), loader=self.scale_loader,
                                                dtype=torch.float32)

    def keep_unquantized(self) -> None:
        """A projection the FP8 checkpoint left in its original dtype (modules_to_not_convert / ignore)."""
        self.quant, self.weight_scale = None, None
        self.weight = self._parameter(*self.weight.shape, loader=self.weight_loader, dtype=self.dtype)

    def dequantize_weight(self) -> None:
        """The FP8 weight times its per-row scales [N, K groups] in the model's dtype; the plain GEMM from then
        on."""
        weight, scale = self.weight.data, self.weight_scale.data
        group = self.quant.block[1] if self.quant.block else weight.shape[1]
        self.weight = _with_loader(dequantize_fp8(weight, scale, (1, group), self.dtype), self.weight_loader)
        self.weight_scale, self.scale_block = None, None

    def set_fp8_weight(self, weight: Tensor, scale: Tensor, block: tuple[int, int]) -> None:
        """The FP8 GEMM's weight and scales [ceil(N / rows), ceil(K / cols)] for block = (rows, cols)."""
        self.weight = _with_loader(weight, self.weight_loader)
        self.weight_scale, self.scale_block = nn.Parameter(scale, requires_grad=False), block

    def process_weights_after_loading(self) -> None:
        if self.weight_scale is not None:
            finish_fp8(self)

    def _project(self, x: Tensor, bias: Tensor | None) -> Tensor:
        if self.scale_block is None:
            return linear(x, self.weight, bias)
        return fp8_linear(x, self.weight, self.weight_scale, self.scale_block, bias, self.fp8_method)


class ColumnParallelLinear(ParallelLinear):
    """y = x W^T (+ b) for this rank's output features [out_features / N]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, quant: Fp8Format | None = None):
        super().__init__()
        local = divide(out_features, self.tp_size, "the output size")
        self._weights(local, in_features, quant)
        self.bias = self._parameter(local, loader=self.weight_loader) if bias else None

    def weight_loader(self, param: Tensor, loaded) -> None:
        copy_part(param.data, loaded, 0, self.tp_rank, self.tp_size)

    def scale_loader(self, param: Tensor, loaded) -> None:
        local = param.shape[0]
        copy_scale_rows(param.data, loaded, self.quant, self.tp_rank * local, local * self.tp_size, 0,
                        self.weight.shape[1])

    def forward(self, x: Tensor) -> Tensor:
        return self._project(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several projections of one input in a single matmul (q|k|v, gate|up), each split across ranks, so a
    rank's output is its part of each projection back to back. Checkpoints store them apart (loading passes
    the projection's index) or fused (no index: every part from one tensor)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 quant: Fp8Format | None = None):
        super().__init__(in_features, sum(output_sizes), bias, quant)
        self.output_sizes = [divide(size, self.tp_size, "a merged projection's output size") for size in output_sizes]

    def _parts(self, index: int | None) -> list[tuple[int, int, int]]:
        """(part index, the checkpoint rows holding it, where they start in `loaded`) for each part loaded."""
        full = [size * self.tp_size for size in self.output_sizes]
        if index is not None:
            return [(index, full[index], 0)]
        return [(i, full[i], sum(full[:i])) for i in range(len(full))]

    def weight_loader(self, param: Tensor, loaded, index: int | None = None) -> None:
        if index is None:
            check_shape(loaded, (sum(self.output_sizes) * self.tp_size, *param.shape[1:]))
        for part, rows, start in self._parts(index):
            destination = param.data.narrow(0, sum(self.output_sizes[:part]), self.output_sizes[part])
            copy_part(destination, rows_of(loaded, start, rows) if index is None else loaded, 0, self.tp_rank,
                      self.tp_size)

    def scale_loader(self, param: Tensor, loaded, index: int | None = None) -> None:
        parts = self._parts(index)
        num_rows = parts[0][1] if index is not None else sum(rows for _, rows, _ in parts)
        for part, _, start in parts:
            local = self.output_sizes[part]
            destination = param.data.narrow(0, sum(self.output_sizes[:part]), local)
            copy_scale_rows(destination, loaded, self.quant, start + self.tp_rank * local, num_rows, 0,
                            self.weight.shape[1])


class GateUpParallelLinear(MergedColumnParallelLinear):
    """An MLP's gate and up projections (each split across ranks) and its activation: act(gate) * up."""

    def __init__(self, in_features: int, intermediate_size: int, activation: str, bias: bool = False,
                 quant: Fp8Format | None = None):
        super().__init__(in_features, [intermediate_size] * 2, bias, quant)
        self.activation = activation  # kernels.gated_linear's: "silu" or "gelu_tanh"

    def forward(self, x: Tensor) -> Tensor:
        if self.scale_block is None:  # one launch at decode sizes
            return gated_linear(x, self.weight, self.bias, self.activation)
        gate_up = self._project(x, self.bias)
        return silu_and_mul(gate_up) if self.activation == "silu" else gelu_tanh_and_mul(gate_up)


class RowParallelLinear(ParallelLinear):
    """y = x W^T (+ b) where x holds this rank's input features [in_features / N]; with N > 1, y is this rank's
    RankPartial (the bias in rank 0's), summed over the ranks by the norm that reads it (models/all_reduce.py)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, quant: Fp8Format | None = None):
        super().__init__()
        local = divide(in_features, self.tp_size, "the input size")
        self._weights(out_features, local, quant)
        self.bias = self._parameter(out_features, loader=default_weight_loader) if bias else None

    def weight_loader(self, param: Tensor, loaded) -> None:
        copy_part(param.data, loaded, 1, self.tp_rank, self.tp_size)

    def scale_loader(self, param: Tensor, loaded) -> None:
        local = self.weight.shape[1]
        copy_scale_rows(param.data, loaded, self.quant, 0, param.shape[0], self.tp_rank * param.shape[1],
                        local * self.tp_size)

    def forward(self, x: Tensor) -> Tensor | RankPartial:
        y = self._project(x, self.bias if self.tp_rank == 0 else None)
        return RankPartial(y) if self.tp_size > 1 else y


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
        logits = linear(hidden, self.weight)
        if self.tp_size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(logits, parts, dst=0)
        return torch.cat(parts, dim=-1)[:, :self.num_embeddings] if self.tp_rank == 0 else None
