"""The engine's one configuration object, built once (from the environment or keyword overrides)."""
import dataclasses
import os
from dataclasses import dataclass

import torch

from models.fp8 import FP8_GEMMS

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn}  # auto: the model's dtype
TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def default_cache_dir() -> str:
    """The user's cache folder ($XDG_CACHE_HOME, else ~/.cache), nanovllm-endpoint inside it."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.expanduser("~/.cache"),
                        "nanovllm-endpoint")


@dataclass
class EngineConfig:
    model: str                          # resolved local path (dir or .gguf file)
    max_model_len: int = 4096           # HFENDPOINT_MAX_MODEL_LEN (capped by the model's max_position_embeddings)
    gpu_memory_utilization: float = 0.9  # HFENDPOINT_GPU_MEMORY_UTILIZATION
    enforce_eager: bool = False         # HFENDPOINT_ENFORCE_EAGER
    max_num_batched_tokens: int = 8192  # HFENDPOINT_MAX_BATCHED_TOKENS
    max_num_seqs: int = 256             # HFENDPOINT_MAX_SEQS
    tensor_parallel_size: int = 1       # HFENDPOINT_TENSOR_PARALLEL_SIZE
    block_size: int = 16                # HFENDPOINT_KV_BLOCK_SIZE
    cpu_kv_cache_gb: float = 1.0        # HFENDPOINT_CPU_KV_CACHE_GB (KV budget on CPU)
    num_kv_blocks: int | None = None    # HFENDPOINT_NUM_KV_BLOCKS (override, tests force tiny pools)
    dtype: str = "auto"                 # HFENDPOINT_DTYPE: auto = bfloat16 on CUDA, float32 on CPU
    device: str = "auto"                # HFENDPOINT_DEVICE
    max_embedding_batch_tokens: int = 16384  # HFENDPOINT_MAX_EMBEDDING_BATCH_TOKENS
    overlap_steps: bool = True          # HFENDPOINT_OVERLAP_STEPS: launch step N+1 before step N's results
    cache_dir: str = dataclasses.field(default_factory=default_cache_dir)  # HFENDPOINT_CACHE_DIR: GGUF metadata
    fp8_gemm: str = "scaled_mm"         # HFENDPOINT_FP8_GEMM: FP8 checkpoints' GEMM on Hopper (models/fp8.py)
    kv_cache_dtype: str = "auto"        # HFENDPOINT_KV_CACHE_DTYPE: auto = the model's dtype, fp8 = e4m3 (2x tokens)
    data_parallel_size: int = 1         # HFENDPOINT_DATA_PARALLEL_SIZE: engines, each on its own GPUs

    def __post_init__(self):
        for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs", "tensor_parallel_size",
                     "data_parallel_size", "block_size", "max_embedding_batch_tokens"):
            value = getattr(self, name)
            _check(name, isinstance(value, int) and not isinstance(value, bool) and value >= 1, "an integer >= 1")
        _check("block_size", self.block_size & (self.block_size - 1) == 0, "a power of two (the kernels need it)")
        _check("num_kv_blocks", self.num_kv_blocks is None or
               (isinstance(self.num_kv_blocks, int) and self.num_kv_blocks >= 1), "an integer >= 1 or unset")
        _check("gpu_memory_utilization", isinstance(self.gpu_memory_utilization, (int, float))
               and 0 < self.gpu_memory_utilization <= 1, "a number in (0, 1]")
        _check("cpu_kv_cache_gb", isinstance(self.cpu_kv_cache_gb, (int, float)) and self.cpu_kv_cache_gb > 0,
               "a number > 0")
        _check("dtype", self.dtype in DTYPES, f"one of {', '.join(DTYPES)}")
        _check("kv_cache_dtype", self.kv_cache_dtype in KV_CACHE_DTYPES, f"one of {', '.join(KV_CACHE_DTYPES)}")
        _check("device", self.device in ("auto", "cpu") or self.device.startswith("cuda"),
               "auto, cpu, cuda or cuda:N")
        _check("enforce_eager", isinstance(self.enforce_eager, bool), "a boolean")
        _check("overlap_steps", isinstance(self.overlap_steps, bool), "a boolean")
        _check("cache_dir", isinstance(self.cache_dir, str), "a directory path")
        self.cache_dir = os.path.expanduser(self.cache_dir.strip()) or default_cache_dir()  # blank: the default
        _check("fp8_gemm", self.fp8_gemm in FP8_GEMMS, f"one of {', '.join(FP8_GEMMS)}")
        _check("device", self.tensor_parallel_size == 1 or self.device in ("auto", "cuda", "cpu"),
               "auto, cuda or cpu with tensor_parallel_size > 1 (rank r runs on cuda:r; pick the GPUs with "
               "CUDA_VISIBLE_DEVICES)")

    @classmethod
    def from_env(cls, model: str, env=os.environ) -> "EngineConfig":
        """Reads every HFENDPOINT_* variable that is set; a bad value raises ValueError naming it."""
        values = {}
        for field in dataclasses.fields(cls):
            name = ENV_NAMES.get(field.name)
            raw = env.get(name) if name else None
            if raw is None:
                continue
            try:
                values[field.name] = _parse(field.name, raw.strip())
                cls(model=model, **{field.name: values[field.name]})
            except ValueError as exc:
                raise ValueError(f"{name}={raw!r} is invalid: {exc}") from None
        return cls(model=model, **values)

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.torch_dtype


ENV_NAMES = {
    "max_model_len": "HFENDPOINT_MAX_MODEL_LEN",
    "gpu_memory_utilization": "HFENDPOINT_GPU_MEMORY_UTILIZATION",
    "enforce_eager": "HFENDPOINT_ENFORCE_EAGER",
    "max_num_batched_tokens": "HFENDPOINT_MAX_BATCHED_TOKENS",
    "max_num_seqs": "HFENDPOINT_MAX_SEQS",
    "tensor_parallel_size": "HFENDPOINT_TENSOR_PARALLEL_SIZE",
    "data_parallel_size": "HFENDPOINT_DATA_PARALLEL_SIZE",
    "block_size": "HFENDPOINT_KV_BLOCK_SIZE",
    "cpu_kv_cache_gb": "HFENDPOINT_CPU_KV_CACHE_GB",
    "num_kv_blocks": "HFENDPOINT_NUM_KV_BLOCKS",
    "dtype": "HFENDPOINT_DTYPE",
    "device": "HFENDPOINT_DEVICE",
    "max_embedding_batch_tokens": "HFENDPOINT_MAX_EMBEDDING_BATCH_TOKENS",
    "overlap_steps": "HFENDPOINT_OVERLAP_STEPS",
    "cache_dir": "HFENDPOINT_CACHE_DIR",
    "fp8_gemm": "HFENDPOINT_FP8_GEMM",
    "kv_cache_dtype": "HFENDPOINT_KV_CACHE_DTYPE",
}


def _check(name: str, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}")


def parse_bool(raw: str) -> bool:
    """A boolean as the environment spells it (1/true/yes/on, 0/false/no/off or empty, any case); ValueError
    for anything else."""
    word = raw.strip().lower()
    if word not in TRUE_WORDS + FALSE_WORDS:
        raise ValueError(f"expected a boolean ({'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS[:-1])})")
    return word in TRUE_WORDS


def _parse(name: str, raw: str):
    default = {f.name: f.default for f in dataclasses.fields(EngineConfig)}[name]
    if isinstance(default, bool):
        return parse_bool(raw)
    if isinstance(default, float):
        try:
            return float(raw)
        except ValueError:
            raise ValueError("expected a number") from None
    if isinstance(default, int) or name == "num_kv_blocks":
        try:
            return int(raw)
        except ValueError:
            raise ValueError("expected an integer") from None
    return raw
