"""Engine settings: one dataclass that checks its own values."""
from __future__ import annotations

import dataclasses
import operator
import os
from dataclasses import dataclass, field
from pathlib import Path

from batchgen.schema import INT32_MAX, INT_RANGES

DTYPES = ("auto", "bfloat16", "float16", "float32")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # auto: the model's dtype; fp8 = fp8_e4m3 (float8_e4m3fn)
DEVICES = ("auto", "cuda", "cpu")
QUANTIZATIONS = ("fp8",)  # quantize a bf16/fp16/fp32 checkpoint's linear layers at load (None: as it is)
GENERATION_CONFIGS = ("auto", "none")  # auto: the model's generation_config.json gives sampling defaults
LOAD_FORMATS = ("auto", "dummy")  # dummy: random weights from config.json alone (benchmarks), no *.safetensors


def env_threads(name: str) -> int | None:
    """A thread count from the environment: a whole number >= 1, or unset / "auto" (None)."""
    value = os.environ.get(name, "").strip()
    if value.lower() in ("", "auto"):
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"invalid {name}: {value!r}; give a number of threads >= 1, or auto")
    return int(value)


def _env_on(name: str) -> bool:
    """A switch that is on unless its environment variable is 0."""
    return os.environ.get(name, "1") != "0"


@dataclass
class EngineConfig:
    model: str | None = None  # local HF directory; None = the embedded default model
    dtype: str = "auto"  # auto: the checkpoint's half dtype on CUDA; on CPU bf16 where native, else fp32
    device: str = "auto"
    tensor_parallel_size: int = 1
    # MoE models under TP: each rank holds whole experts (E / tp of them), not a slice of every expert
    expert_parallel: bool = False
    data_parallel_size: int | str = 1  # engine replicas, each on its own GPU or TP group; "auto": every visible GPU
    # None: on a GPU of 70 GiB or more 1024 (vLLM's rule), 2048 for MoE models (wide decode steps pay most
    # for them), else 256 (executor/memory.default_max_num_seqs); never above max_num_batched_tokens
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None  # per-step token budget; None: 8192 on CUDA, 2048 on CPU
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None  # None: the model's max_position_embeddings; at most its context length
    kv_cache_tokens: int | None = None  # KV pool size in tokens; None: from the memory budget
    kv_cache_dtype: str = "auto"  # fp8: half the KV bytes of bf16 (twice the tokens in the pool), lossy
    # fp8: weights per output channel, activations per token (models/quantization.py); FP8 checkpoints need none
    quantization: str | None = None
    cpu_kv_cache_gb: float = 4.0  # KV pool byte budget on CPU
    cuda_graphs: bool = True  # replay captured graphs for decode-only steps on CUDA
    enable_prefix_caching: bool = True  # reuse the KV of prompt prefixes computed before (engine/prefix_cache.py)
    seed: int = 0  # job seed: rows without their own seed get one derived from (seed, id)
    trust_remote_code: bool = False  # only for tokenizers; batchgen never runs a checkpoint's model code
    generation_config: str = "auto"  # auto: sampling defaults from the model's generation_config.json; none: built-ins
    load_format: str = "auto"  # auto: the checkpoint's safetensors; dummy: random weights from --seed (benchmarks)
    # GPU: kernels whose per-row sums do not depend on the step's other rows, so a row's tokens are the same
    # however the job is batched, chunked, cached, resumed or sharded (kernels/invariant_gemm.py)
    batch_invariant: bool = False
    # GPU features to turn off when debugging a GPU or driver problem (BATCHGEN_PDL=0, BATCHGEN_SYMM_ALL_REDUCE=0)
    pdl: bool = field(default_factory=lambda: _env_on("BATCHGEN_PDL"))  # programmatic dependent launch, Hopper+
    symmetric_all_reduce: bool = field(default_factory=lambda: _env_on("BATCHGEN_SYMM_ALL_REDUCE"))  # off: NCCL

    # torch's CPU threads; None (auto): the usable cores less those other processes keep busy, re-measured
    # as the job runs (executor/cpu_threads.py). Env BATCHGEN_CPU_THREADS (a number, or "auto").
    cpu_threads: int | None = field(default_factory=lambda: env_threads("BATCHGEN_CPU_THREADS"))

    def __post_init__(self):
        def need(ok: bool, option: str, what: str):
            if not ok:
                raise ValueError(f"invalid --{option.replace('_', '-')}: {what}")

        def whole(option: str, low: int = 1, high: int = INT32_MAX, optional: bool = True) -> None:
            """An integer option in [low, high] (the CLI's limits: INT32_MAX for counts, schema.INT_RANGES for
            the seed), or None where `optional`. A bool, float or string is refused, not coerced; a NumPy
            integer is kept as a Python int."""
            value = getattr(self, option)
            if value is None and optional:
                return
            try:
                number = None if isinstance(value, bool) else operator.index(value)
            except TypeError:
                number = None
            need(number is not None, option, f"{value!r} is not an integer")
            need(number >= low, option, f"must be >= {low}, got {number}")
            need(number <= high, option, f"must be <= {high}, got {number}")
            setattr(self, option, number)

        def real(option: str) -> None:
            value = getattr(self, option)
            need(isinstance(value, (int, float)) and not isinstance(value, bool), option, f"{value!r} is not a number")

        need(self.dtype in DTYPES, "dtype", f"{self.dtype!r}; choose one of {', '.join(DTYPES)}")
        need(self.device in DEVICES, "device", f"{self.device!r}; choose one of {', '.join(DEVICES)}")
        need(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
             f"{self.kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
        need(self.quantization is None or self.quantization in QUANTIZATIONS, "quantization",
             f"{self.quantization!r}; choose one of {', '.join(QUANTIZATIONS)}, or leave it out")
        whole("tensor_parallel_size", optional=False)
        need(self.data_parallel_size == "auto" or (isinstance(self.data_parallel_size, int)
                                                    and not isinstance(self.data_parallel_size, bool)
                                                    and 1 <= self.data_parallel_size <= INT32_MAX),
             "data_parallel_size", f"{self.data_parallel_size!r}; give a number >= 1 or auto")
        whole("max_num_seqs")  # (None: the engine picks it)
        whole("max_num_batched_tokens")
        if self.max_num_batched_tokens is not None and self.max_num_seqs is not None:
            need(
                self.max_num_batched_tokens >= self.max_num_seqs,
                "max_num_batched_tokens",
                f"{self.max_num_batched_tokens} is below --max-num-seqs ({self.max_num_seqs}); "
                "every running sequence needs room for its decode token",
            )
        real("gpu_memory_utilization")
        need(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "must be in (0, 1]")
        whole("max_model_len")
        whole("kv_cache_tokens")
        real("cpu_kv_cache_gb")
        need(self.cpu_kv_cache_gb > 0, "cpu_kv_cache_gb", "must be > 0")
        whole("seed", *INT_RANGES["seed"], optional=False)  # the range of --seed and of a row's seed
        for switch in BOOL_OPTIONS:
            value = getattr(self, switch)
            need(isinstance(value, bool), switch, f"{value!r}; give True or False")
        need(self.generation_config in GENERATION_CONFIGS, "generation_config",
             f"{self.generation_config!r}; choose one of {', '.join(GENERATION_CONFIGS)}")
        need(self.load_format in LOAD_FORMATS, "load_format",
             f"{self.load_format!r}; choose one of {', '.join(LOAD_FORMATS)}")
        need(self.cpu_threads is None or (isinstance(self.cpu_threads, int) and not isinstance(self.cpu_threads, bool)
                                          and self.cpu_threads >= 1),
             "cpu_threads", f"{self.cpu_threads!r}; give a number of threads >= 1, or None for auto")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# EngineConfig's on/off switches: True or False only (a string such as "false" would be truthy)
BOOL_OPTIONS = ("expert_parallel", "cuda_graphs", "enable_prefix_caching", "trust_remote_code", "batch_invariant",
                "pdl", "symmetric_all_reduce")


# --- environment knobs outside EngineConfig: where the model cache lives, and tracebacks -----------


def cache_dir() -> Path:
    """$BATCHGEN_CACHE, else ~/.cache/batchgen: the converted default model and tuned products."""
    return Path(os.environ.get("BATCHGEN_CACHE") or Path.home() / ".cache" / "batchgen")


def debug() -> bool:
    """$BATCHGEN_DEBUG set (not empty): the CLI prints the traceback of an unexpected error."""
    return bool(os.environ.get("BATCHGEN_DEBUG"))
