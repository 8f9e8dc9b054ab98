"""Where and in what the model runs, and how many KV token slots fit: the device, the model's and the
KV pool's dtypes, and the pool's size from the memory left after the weights and a step's activations."""
from __future__ import annotations

import gc
import logging
import os
from pathlib import Path

import torch

from batchgen.executor.kv_cache import KVCache
from batchgen.executor.warmup import synthetic_batch, warm_sampling

log = logging.getLogger("batchgen")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("invalid --device: cuda was asked for but no CUDA GPU is visible; use --device cpu")
    return torch.device(name)


LARGE_GPU_BYTES = 70 * 2**30  # a GPU this large or larger (80 GB A100/H100, H200) takes the wider default


def default_max_num_seqs(device: torch.device, moe: bool = False) -> int:
    """--max-num-seqs when not given: on a GPU of LARGE_GPU_BYTES or more, where the wider decode steps'
    logits and activations fit beside a large KV pool, 1024, and 2048 for a mixture of experts (a decode
    step reads every expert's weights whatever its width, so wider steps share that read among more
    tokens); else 256 (CPUs, smaller GPUs)."""
    if device.type == "cuda" and torch.cuda.get_device_properties(device).total_memory >= LARGE_GPU_BYTES:
        return 2048 if moe else 1024
    return 256


def resolve_max_num_seqs(max_num_seqs: int | None, max_num_batched_tokens: int | None, device: torch.device,
                         moe: bool = False) -> int:
    """--max-num-seqs, or when not given default_max_num_seqs(device, moe), no more than
    --max-num-batched-tokens (every running sequence needs room in a step for its decode token)."""
    if max_num_seqs is not None:
        return max_num_seqs
    return min(default_max_num_seqs(device, moe), max_num_batched_tokens or 2**31)


def free_bytes(device: torch.device) -> int:
    """Memory free for new tensors: the GPU's, or on a CPU the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(option: str, value: int, what: str, size_bytes: int, device: torch.device, advice: str) -> None:
    """ValueError naming --option where what it asks for (size_bytes) is more than the device has free: a
    one-line usage error instead of an allocator's failure after the model has loaded."""
    free = free_bytes(device)
    if size_bytes > free:
        raise ValueError(f"invalid --{option.replace('_', '-')}: {value} {what} need {size_bytes / 2**30:.1f} GiB, "
                         f"and the {device.type.upper()} has {free / 2**30:.1f} GiB free; {advice}")


def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_dtype(name: str, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":  # bf16 where the CPU multiplies it natively (about 2x fp32), else fp32
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    # on a GPU, half precision: the checkpoint's own when it has one, bf16 for fp32 checkpoints
    return DTYPES.get(checkpoint_dtype, torch.bfloat16) if checkpoint_dtype != "float32" else torch.bfloat16


def resolve_kv_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV pool's dtype: the model's, or fp8 e4m3 (kernels/rope_store_kv.py says how values go in)."""
    if name == "auto":
        return model_dtype
    major, minor = torch.cuda.get_device_capability(device) if device.type == "cuda" else (9, 0)
    if (major, minor) < (8, 9):  # (the CPU converts in software)
        raise ValueError(
            f"invalid --kv-cache-dtype: {name} needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
            f"this one is {major}.{minor}; use --kv-cache-dtype auto"
        )
    return torch.float8_e4m3fn


def num_kv_slots(runner) -> int:
    """The KV pool's size in tokens for a ModelRunner whose model is built: --kv-cache-tokens, else
    what the memory budget holds (on a GPU: total x gpu_memory_utilization, minus what is in use, minus
    the activation peak of the largest step, twice with CUDA graphs, whose pool is as large)."""
    cfg = runner.config
    useful = runner.max_num_seqs * runner.max_model_len  # more slots than this can never be used
    per_token = KVCache.bytes_per_token(runner.model_cfg.num_layers, runner.num_kv_heads, runner.head_dim,
                                        runner.kv_dtype)
    if cfg.kv_cache_tokens:
        check_fits("kv_cache_tokens", cfg.kv_cache_tokens, "tokens of KV cache", cfg.kv_cache_tokens * per_token,
                   runner.device, "give fewer, or leave it out to size the pool from the memory left")
        return cfg.kv_cache_tokens
    note = ""
    if runner.device.type == "cpu":
        budget = cfg.cpu_kv_cache_gb * 2**30
    else:
        gc.collect()  # an engine the caller dropped inside some reference cycle: its memory counts as free
        peak = profile_peak_bytes(runner)
        peaks = 2 if cfg.cuda_graphs else 1
        free, total = torch.cuda.mem_get_info(runner.device)
        budget = total * cfg.gpu_memory_utilization - (total - free) - peaks * peak
        note = (f": {total / 2**30:.1f} GiB x {cfg.gpu_memory_utilization} minus {(total - free) / 2**30:.1f} GiB "
                f"in use minus {peaks} x a {peak / 2**30:.1f} GiB activation peak")
        log.info("KV cache budget %.1f GiB%s", budget / 2**30, note)
    slots = min(int(budget // per_token), useful)
    if slots < runner.max_model_len and slots < 16:
        raise ValueError(
            f"no memory left for the KV cache ({slots} token slots from a budget of {budget / 2**30:.1f} GiB"
            f"{note}); raise --gpu-memory-utilization, lower --max-num-batched-tokens, or set --kv-cache-tokens"
        )
    return slots


def profile_peak_bytes(runner) -> int:
    """Run the largest step (a full token budget, logits for max_num_seqs rows) on a scratch pool and
    measure the activation memory it needs beyond the weights."""
    seqs = runner.max_num_seqs  # budget >= max_num_seqs: one row of logits per sequence
    tokens = min(runner.max_num_batched_tokens, seqs * runner.max_model_len)
    scratch = runner.make_kv_cache(tokens)
    lens = [tokens // seqs + (i < tokens % seqs) for i in range(seqs)]
    lens = [n for n in lens if n > 0]
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    batch = synthetic_batch(scratch, device, [], [(n, n) for n in lens])
    with torch.inference_mode():
        batch.record_slots()
        logits = runner.forward(batch)  # one row per sequence: max_num_seqs rows
        warm_sampling(logits)  # every sampling path: the peak is top-k/top-p's sort
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del scratch, batch, logits
    for layer in runner.model.attention_layers():
        layer.k_cache = layer.v_cache = torch.empty(0)
    torch.cuda.empty_cache()
    return peak
