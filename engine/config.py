"""The engine's one configuration object, built once (from the environment or keyword overrides)."""
import dataclasses
import os
from dataclasses import dataclass

import torch

from kernels import gpu_features
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
    max_model_len: int | None = None    # HFENDPOINT_MAX_MODEL_LEN; None: the model's maximum (ModelRunner caps it)
    gpu_memory_utilization: float = 0.9  # HFENDPOINT_GPU_MEMORY_UTILIZATION
    enforce_eager: bool = False         # HFENDPOINT_ENFORCE_EAGER
    max_num_batched_tokens: int = 8192  # HFENDPOINT_MAX_BATCHED_TOKENS
    max_num_seqs: int = 256             # HFENDPOINT_MAX_SEQS
    tensor_parallel_size: int = 1       # HFENDPOINT_TENSOR_PARALLEL_SIZE
    block_size: int = 16                # HFENDPOINT_KV_BLOCK_SIZE
    cpu_kv_cache_gb: float = 1.0        # HFENDPOINT_CPU_KV_CACHE_GB (KV budget on CPU)
    num_kv_blocks: int | None = None    # HFENDPOINT_NUM_KV_BLOCKS (override, tests force tiny pools)
    dtype: str = "auto"                 # HFENDPOINT_DTYPE: auto_dtype (bfloat16 or float16 on CUDA, float32 on CPU)
    device: str = "auto"                # HFENDPOINT_DEVICE
    max_embedding_batch_tokens: int = 16384  # HFENDPOINT_MAX_EMBEDDING_BATCH_TOKENS
    overlap_steps: bool = True          # HFENDPOINT_OVERLAP_STEPS: launch step N+1 before step N's results
    cache_dir: str = dataclasses.field(default_factory=default_cache_dir)  # HFENDPOINT_CACHE_DIR: GGUF metadata
    fp8_gemm: str = "scaled_mm"         # HFENDPOINT_FP8_GEMM: FP8 checkpoints' GEMM on Hopper (models/fp8.py)
    kv_cache_dtype: str = "auto"        # HFENDPOINT_KV_CACHE_DTYPE: auto = the model's dtype, fp8 = e4m3 (2x tokens)
    gpu_features: str = "auto"          # HFENDPOINT_GPU_FEATURES: features turned off (kernels/gpu_features.py)
    speculative: str = "off"            # HFENDPOINT_SPECULATIVE: off | ngram | suffix [:k=N] | eagle3:PATH [,k=N]
    data_parallel_size: int = 1         # HFENDPOINT_DATA_PARALLEL_SIZE: engines, each on its own GPUs
    p2p_all_reduce: bool = True         # HFENDPOINT_P2P_ALL_REDUCE: decode steps' TP sums over peer memory

    def __post_init__(self):
        for name in ("max_num_batched_tokens", "max_num_seqs", "tensor_parallel_size", "data_parallel_size",
                     "block_size", "max_embedding_batch_tokens"):
            value = getattr(self, name)
            _check(name, isinstance(value, int) and not isinstance(value, bool) and value >= 1, "an integer >= 1")
        _check("block_size", self.block_size & (self.block_size - 1) == 0, "a power of two (the kernels need it)")
        for name in UNSET_INTS:
            value = getattr(self, name)
            _check(name, value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1),
                   "an integer >= 1 or unset")
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
        _check("p2p_all_reduce", isinstance(self.p2p_all_reduce, bool), "a boolean")
        _check("cache_dir", isinstance(self.cache_dir, str), "a directory path")
        self.cache_dir = os.path.expanduser(self.cache_dir.strip()) or default_cache_dir()  # blank: the default
        _check("speculative", isinstance(self.speculative, str), SPECULATIVE_FORMS)
        self.speculative_method, self.num_speculative_tokens, self.draft_head = parse_speculative(self.speculative)
        _check("fp8_gemm", self.fp8_gemm in FP8_GEMMS, f"one of {', '.join(FP8_GEMMS)}")
        _check("gpu_features", isinstance(self.gpu_features, str), gpu_features.SPEC_HELP)
        self.disabled_gpu_features = gpu_features.parse(self.gpu_features)
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
            return auto_dtype(self.torch_device, self.disabled_gpu_features)
        return DTYPES[self.dtype]

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.torch_dtype

    def check_device(self) -> None:
        """Refuse, before anything loads, what the device cannot run: bfloat16 without bfloat16 arithmetic, an FP8
        KV cache without e4m3 conversions (kernels/gpu_features.py; HFENDPOINT_GPU_FEATURES may turn either
        off)."""
        device = self.torch_device
        if device.type != "cuda":
            return
        if self.torch_dtype == torch.bfloat16:
            self._require(device, "bfloat16", "HFENDPOINT_DTYPE=bfloat16", "use float16 or auto")
        if self.kv_cache_dtype == "fp8":
            self._require(device, "e4m3", "HFENDPOINT_KV_CACHE_DTYPE=fp8", "unset it or use auto")

    def _require(self, device: torch.device, feature: str, setting: str, fix: str) -> None:
        if not gpu_features.device_supports(feature, device, self.disabled_gpu_features):
            needed = ".".join(map(str, gpu_features.MIN_CAPABILITY[feature]))
            has = ".".join(map(str, torch.cuda.get_device_capability(device)))
            raise ValueError(f"{setting} needs {feature} (compute capability {needed} or later); this GPU has "
                             f"{has} with HFENDPOINT_GPU_FEATURES={self.gpu_features}: {fix}")


def auto_dtype(device: torch.device, disabled_features: frozenset[str] = frozenset()) -> torch.dtype:
    """HFENDPOINT_DTYPE=auto: bfloat16 on a GPU that has it, float16 on one without (compute capability below
    8.0: a T4), float32 on the CPU."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if gpu_features.device_supports("bfloat16", device, disabled_features) else torch.float16


UNSET_INTS = ("max_model_len", "num_kv_blocks")  # None: chosen at start-up (the model's maximum, what fits)
SPECULATIVE_METHODS = ("off", "ngram", "suffix", "eagle3")
DEFAULT_DRAFT_TOKENS, MAX_DRAFT_TOKENS = 4, 16
SPECULATIVE_FORMS = (f"off, ngram or suffix, optionally with the most draft tokens per step as ':k=N' "
                     f"(1 <= N <= {MAX_DRAFT_TOKENS}; default {DEFAULT_DRAFT_TOKENS}), e.g. ngram:k=4; or "
                     "eagle3:PATH with an EAGLE-3 draft head's directory, optionally ',k=N', e.g. eagle3:/heads/h,k=3")


def parse_speculative(spec: str) -> tuple[str, int, str | None]:
    """(method, most draft tokens per step, the draft head's directory for eagle3 else None) of a
    speculative-decoding setting; ("off", 0, None) when off."""
    method, _, options = spec.strip().partition(":")
    method, path = method.strip().lower(), None
    if method == "eagle3":
        path, comma, tail = options.rpartition(",")
        path, options = (path, tail) if comma and tail.partition("=")[0].strip().lower() == "k" else (options, "")
        path = path.strip()
        _check("speculative", bool(path), SPECULATIVE_FORMS)
    k = DEFAULT_DRAFT_TOKENS
    if options:
        name, _, value = options.partition("=")
        _check("speculative", name.strip().lower() == "k" and value.strip().isdigit(), SPECULATIVE_FORMS)
        k = int(value)
    _check("speculative", method in SPECULATIVE_METHODS and 1 <= k <= MAX_DRAFT_TOKENS
           and not (method == "off" and options), SPECULATIVE_FORMS)
    return method, 0 if method == "off" else k, path


ENV_NAMES = {
    "max_model_len": "HFENDPOINT_MAX_MODEL_LEN",
    "gpu_memory_utilization": "HFENDPOINT_GPU_MEMORY_UTILIZATION",
    "enforce_eager": "HFENDPOINT_ENFORCE_EAGER",
    "max_num_batched_tokens": "HFENDPOINT_MAX_BATCHED_TOKENS",
    "max_num_seqs": "HFENDPOINT_MAX_SEQS",
    "tensor_parallel_size": "HFENDPOINT_TENSOR_PARALLEL_SIZE",
    "p2p_all_reduce": "HFENDPOINT_P2P_ALL_REDUCE",
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
    "gpu_features": "HFENDPOINT_GPU_FEATURES",
    "speculative": "HFENDPOINT_SPECULATIVE",
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
    if isinstance(default, int) or name in UNSET_INTS:
        try:
            return int(raw)
        except ValueError:
            raise ValueError("expected an integer") from None
    return raw
