"""Routed MLPs (mixtures of experts) for Qwen3-MoE and gpt-oss: one module, driven by the config.

A router (a linear layer over the hidden state, replicated on every rank; biased for gpt-oss) scores the
experts; each token goes to its top-k, weighted by the softmax of the scores (over the k chosen when the config
renormalises: Qwen3-MoE's norm_topk_prob, and always for gpt-oss, whose softmax over its top-k logits is the
same thing). The router, its top-k and the experts run in kernels.routed_experts: SiLU-and-mul for Qwen3-MoE,
gpt-oss's clamped SwiGLU.

Tensor parallelism splits every expert's intermediate features across the ranks, as the dense MLP does: a
rank holds its slice of each expert's gate, up and down projections, computes its partial sum of every
token's output, and one all-reduce per layer adds them (the down projection's bias on rank 0 only).

Parameters are stacked per layer as the kernel wants them: experts.gate_up_proj [E, 2I/N, H] (this rank's gate
rows, then its up rows), experts.down_proj [E, H, I/N], and for gpt-oss experts.gate_up_proj_bias [E, 2I/N]
and experts.down_proj_bias [E, H]. Checkpoints name them (moe_checkpoint_target maps the names):
- Qwen3-MoE: mlp.gate.weight [E, H]; mlp.experts.{e}.gate_proj.weight, up_proj.weight [I, H], down_proj.weight
  [H, I].
- gpt-oss: mlp.router.weight [E, H] and bias [E]; mlp.experts.gate_up_proj [E, H, 2I] (gate and up features
  interleaved: gate j at column 2j, up j at 2j + 1) and gate_up_proj_bias [E, 2I] likewise, down_proj
  [E, I, H], down_proj_bias [E, H]. The published checkpoints store the two projections in MXFP4
  (config.quantization_config.quant_method "mxfp4") as gate_up_proj_blocks/_scales, rows [E, 2I] still
  interleaved, and down_proj_blocks/_scales, rows [E, H]. We keep them in MXFP4 (kernels/mxfp4.py): the packed
  codes as experts.gate_up_proj [E, 2I/N, H/2] and down_proj [E, H, I/N/2] (uint8, rows reordered and split as
  above), their scales as gate_up_proj_scales [E, 2I/N, H/32] and down_proj_scales [E, H, I/N/32], and the
  fused MoE dequantizes them as it reads them.
"""
import re
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kernels import Mxfp4Weight, gpu_features, routed_experts
from kernels.mxfp4 import GROUP_SIZE
from models.all_reduce import RankPartial
from models.parallel_layers import ParallelModule, check_shape, copy_part, divide, read

MOE_MODEL_TYPES = ("qwen3_moe", "gpt_oss")

_PER_EXPERT_WEIGHT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_MXFP4_WEIGHT = re.compile(r"(.*\.mlp\.experts\.(?:gate_up|down)_proj)_(blocks|scales)$")
_QWEN3_ROUTER = re.compile(r"(.*\.mlp)\.gate\.weight$")
GPT_OSS_SWIGLU_ALPHA = 1.702  # transformers' configs before swiglu_alpha existed: the value gpt-oss hard-codes
CHECKPOINT_LAYOUTS = {  # how a checkpoint stores the experts
    "per_expert": "one tensor per expert and projection",
    "interleaved": "stacked tensors with gate and up features interleaved",
    "mxfp4": "MXFP4 blocks and scales",
}


@dataclass(frozen=True)
class MoeSpec:
    """What a family's config says about its routed MLP."""
    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    renormalize: bool  # softmax over the k chosen experts (else over all)
    bias: bool  # router and expert biases (gpt-oss)
    activation: str  # kernels.fused_moe's
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    checkpoint_layout: str = "per_expert"  # "per_expert" (Qwen3-MoE), "interleaved" or "mxfp4" (gpt-oss)


def moe_spec(config) -> MoeSpec:
    if config.model_type == "qwen3_moe":
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported for Qwen3-MoE experts (supported: "
                             "'silu')")
        return MoeSpec(config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                       renormalize=bool(config.norm_topk_prob), bias=False, activation="silu")
    if config.model_type == "gpt_oss":
        quantization = getattr(config, "quantization_config", None) or {}
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization.quant_method
        if method not in (None, "mxfp4"):
            raise ValueError(f"gpt-oss quantization {method!r} is not supported (supported: mxfp4, or none)")
        return MoeSpec(config.num_local_experts, config.num_experts_per_tok, config.intermediate_size,
                       renormalize=True, bias=True, activation="clamped_swiglu",
                       swiglu_alpha=getattr(config, "swiglu_alpha", GPT_OSS_SWIGLU_ALPHA),
                       swiglu_limit=config.swiglu_limit,
                       checkpoint_layout="mxfp4" if method == "mxfp4" else "interleaved")
    raise ValueError(f"model type {config.model_type!r} has no routed MLP (supported: {', '.join(MOE_MODEL_TYPES)})")


def require_mxfp4(device: torch.device) -> None:
    """Refuses, at load rather than at the first step's compile, MXFP4 experts on a GPU that cannot read them."""
    if device.type == "cuda" and not gpu_features.device_supports("mxfp4", device):
        needed = ".".join(map(str, gpu_features.MIN_CAPABILITY["mxfp4"]))
        has = ".".join(map(str, torch.cuda.get_device_capability(device)))
        raise ValueError(f"this model's experts are MXFP4, which needs compute capability {needed} or later "
                         f"(an A10G, A100, L4 or newer); this GPU has {has}: deploy it on one of those")


def is_moe_layer(config, layer_idx: int) -> bool:
    """Whether layer `layer_idx` has a routed MLP (else a dense one): every gpt-oss layer; for Qwen3-MoE each
    decoder_sparse_step-th layer outside mlp_only_layers."""
    if config.model_type == "gpt_oss":
        return True
    if config.model_type == "qwen3_moe":
        return (layer_idx not in (config.mlp_only_layers or []) and config.num_experts > 0
                and (layer_idx + 1) % config.decoder_sparse_step == 0)
    return False


def check_moe_tensor_parallel(config, size: int) -> None:
    """Each of `size` ranks must get a whole number of every expert's intermediate features (of whole MXFP4
    scale groups for a quantized gpt-oss down projection)."""
    spec = moe_spec(config)
    quantized = spec.checkpoint_layout == "mxfp4"
    if spec.intermediate_size % (size * (GROUP_SIZE if quantized else 1)):
        parts = "whole parts of 32-value MXFP4 groups" if quantized else "whole parts"
        raise ValueError(f"tensor_parallel_size={size} does not split the experts' intermediate size "
                         f"{spec.intermediate_size} into {parts}: pick a tensor-parallel size that does")


def moe_checkpoint_target(name: str) -> tuple[str, object] | None:
    """(our parameter, slice index) for a routed layer's checkpoint tensor whose name is not ours, or None:
    `...mlp.experts.{e}.gate_proj.weight` -> (`...mlp.experts.gate_up_proj`, (e, "gate")), likewise up and
    down; `...experts.gate_up_proj_blocks` -> (`...experts.gate_up_proj`, "blocks"), `..._scales` ->
    (`...experts.gate_up_proj_scales`, "scales"), likewise down; Qwen3-MoE's router `...mlp.gate.weight` ->
    (`...mlp.router.weight`, None)."""
    if match := _PER_EXPERT_WEIGHT.match(name):
        experts, expert, projection = match.groups()
        return f"{experts}.{'down_proj' if projection == 'down' else 'gate_up_proj'}", (int(expert), projection)
    if match := _MXFP4_WEIGHT.match(name):
        projection, half = match.groups()
        return (projection if half == "blocks" else f"{projection}_scales"), half
    if match := _QWEN3_ROUTER.match(name):
        return f"{match.group(1)}.router.weight", None
    return None


class Router(nn.Module):
    """The weight [E, H] (and bias) of the experts' scores; every rank holds the whole of it. MoeMLP hands it to
    kernels.routed_experts, which computes the scores with the top-k."""

    def __init__(self, hidden_size: int, num_experts: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None


class Experts(ParallelModule):
    """Every expert's gate/up and down projections, stacked, this rank's slice of the intermediate features."""

    def __init__(self, spec: MoeSpec, hidden_size: int):
        super().__init__()
        self.layout = spec.checkpoint_layout
        self.num_experts, self.hidden_size = spec.num_experts, hidden_size
        self.intermediate_size = spec.intermediate_size
        self.inter = divide(spec.intermediate_size, self.tp_size, "the experts' intermediate size")
        experts, inter = spec.num_experts, self.inter
        if self.layout == "mxfp4":  # packed codes, two a byte, and one scale per group of each row
            self.gate_up_proj = self._mxfp4_parameter(experts, 2 * inter, hidden_size, "gate_up_proj")
            self.gate_up_proj_scales = self._mxfp4_parameter(experts, 2 * inter, hidden_size, "gate_up_proj", True)
            self.down_proj = self._mxfp4_parameter(experts, hidden_size, inter, "down_proj")
            self.down_proj_scales = self._mxfp4_parameter(experts, hidden_size, inter, "down_proj", True)
        else:
            self.gate_up_proj = self._parameter(experts, 2 * inter, hidden_size, loader=self.load_gate_up)
            self.down_proj = self._parameter(experts, hidden_size, inter, loader=self.load_down)
        self.gate_up_proj_bias = self.down_proj_bias = None
        if spec.bias:
            self.gate_up_proj_bias = self._parameter(experts, 2 * inter, loader=self.load_gate_up_bias)
            self.down_proj_bias = self._parameter(experts, hidden_size, loader=self.load_down_bias)

    def _mxfp4_parameter(self, experts: int, rows: int, cols: int, name: str, scales: bool = False) -> nn.Parameter:
        """uint8 [experts, rows, cols / 2] codes, or [experts, rows, cols / 32] scales, of weight `name`."""
        width = cols // GROUP_SIZE if scales else cols // 2

        def loader(param: Tensor, loaded, index) -> None:
            self._load_mxfp4(param, name, loaded, index)

        return self._parameter(experts, rows, width, loader=loader, dtype=torch.uint8)

    @property
    def gate_up_weight(self) -> Tensor | Mxfp4Weight:
        if self.layout == "mxfp4":
            return Mxfp4Weight(self.gate_up_proj, self.gate_up_proj_scales)
        return self.gate_up_proj

    @property
    def down_weight(self) -> Tensor | Mxfp4Weight:
        if self.layout == "mxfp4":
            return Mxfp4Weight(self.down_proj, self.down_proj_scales)
        return self.down_proj

    def checkpoint_slices(self, leaf: str) -> list:
        """The slice indices a checkpoint fills parameter `leaf` with (models/loader.py checks them all)."""
        if leaf.endswith("_bias") or self.layout == "interleaved":
            return [None]
        if self.layout == "mxfp4":
            return ["scales" if leaf.endswith("_scales") else "blocks"]
        projections = ("gate", "up") if leaf == "gate_up_proj" else ("down",)
        return [(expert, projection) for expert in range(self.num_experts) for projection in projections]

    # ---- loaders: weight_loader(param, checkpoint tensor or safetensors slice[, index]) ------------------

    def load_gate_up(self, param: Tensor, loaded, index=None) -> None:
        if index == "blocks":  # an MXFP4 checkpoint for a model whose config does not say so
            self._check_layout("mxfp4")
        if index is None:  # [E, H, 2I], interleaved: this rank's features are one run of columns
            self._check_layout("interleaved")
            check_shape(loaded, (self.num_experts, self.hidden_size, 2 * self.intermediate_size))
            part = read(loaded, 2, 2 * self.tp_rank * self.inter, 2 * self.inter).transpose(1, 2)
            return self._store_interleaved(param.data, part)
        expert, projection = index
        self._check_layout("per_expert")
        rows = param.data[expert].narrow(0, 0 if projection == "gate" else self.inter, self.inter)
        copy_part(rows, loaded, 0, self.tp_rank, self.tp_size)

    def load_down(self, param: Tensor, loaded, index=None) -> None:
        if index == "blocks":  # an MXFP4 checkpoint for a model whose config does not say so
            self._check_layout("mxfp4")
        if index is None:  # [E, I, H]
            self._check_layout("interleaved")
            check_shape(loaded, (self.num_experts, self.intermediate_size, self.hidden_size))
            param.data.copy_(read(loaded, 1, self.tp_rank * self.inter, self.inter).transpose(1, 2))
            return
        expert, _ = index
        self._check_layout("per_expert")
        copy_part(param.data[expert], loaded, 1, self.tp_rank, self.tp_size)

    def load_gate_up_bias(self, param: Tensor, loaded) -> None:
        check_shape(loaded, (self.num_experts, 2 * self.intermediate_size))
        self._store_interleaved(param.data, read(loaded, 1, 2 * self.tp_rank * self.inter, 2 * self.inter))

    def load_down_bias(self, param: Tensor, loaded) -> None:
        copy_part(param.data, loaded, None, 0, 1)

    def _store_interleaved(self, destination: Tensor, part: Tensor) -> None:
        """part [E, 2I/N, ...] with gate and up rows alternating -> destination's gate rows, then its up rows."""
        destination[:, :self.inter].copy_(part[:, 0::2])
        destination[:, self.inter:].copy_(part[:, 1::2])

    def _check_layout(self, layout: str) -> None:
        if self.layout != layout:
            raise ValueError(f"holds experts as {CHECKPOINT_LAYOUTS[layout]}, but this model's config expects "
                             f"{CHECKPOINT_LAYOUTS[self.layout]}")

    def _load_mxfp4(self, param: Tensor, name: str, loaded, half: str) -> None:
        """This rank's rows of weight `name`'s MXFP4 blocks or scales, as the checkpoint packs them, into param:
        gate/up rows reordered as the bf16 layout's, blocks' groups flattened into rows of bytes."""
        experts, hidden, inter = self.num_experts, self.hidden_size, self.intermediate_size
        if name == "gate_up_proj":  # rows: gate and up interleaved, this rank's are one run
            rows, groups, dim, length = 2 * inter, hidden // GROUP_SIZE, 1, 2 * self.inter
        else:  # rows: hidden features; this rank's intermediate features are a run of scale groups
            rows, groups, dim, length = hidden, inter // GROUP_SIZE, 2, self.inter // GROUP_SIZE
        check_shape(loaded, (experts, rows, groups, GROUP_SIZE // 2) if half == "blocks" else (experts, rows, groups))
        part = read(loaded, dim, self.tp_rank * length, length)
        if part.dtype != torch.uint8:
            raise ValueError(f"is {part.dtype}, but MXFP4 {half} are uint8")
        part = part.flatten(2).to(param.device)
        if name == "gate_up_proj":
            self._store_interleaved(param.data, part)
        else:
            param.data.copy_(part)


class MoeMLP(nn.Module):
    """The routed MLP of a decoder layer: x [T, H] -> [T, H]."""

    def __init__(self, config):
        super().__init__()
        self.spec = spec = moe_spec(config)
        if spec.checkpoint_layout == "mxfp4":
            require_mxfp4(torch.get_default_device())
        self.router = Router(config.hidden_size, spec.num_experts, spec.bias)
        self.experts = Experts(spec, config.hidden_size)

    def forward(self, x: Tensor) -> Tensor | RankPartial:
        spec, experts, router = self.spec, self.experts, self.router
        down_bias = experts.down_proj_bias if experts.tp_rank == 0 else None
        y = routed_experts(x, router.weight, router.bias, spec.top_k, spec.renormalize, experts.gate_up_weight,
                           experts.down_weight, experts.gate_up_proj_bias, down_bias, spec.activation,
                           spec.swiglu_alpha, spec.swiglu_limit)
        return RankPartial(y) if experts.tp_size > 1 else y  # summed by the norm that reads it
